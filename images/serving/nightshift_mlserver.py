"""MLServer's MLflow runtime, answering a request the model refuses with a 4xx instead of a 500.

`mlserver_mlflow.MLflowRuntime.predict` (the V2 `infer` path, MLServer 1.7.1) lets every exception of
`pyfunc.predict` through, and MLServer answers what it does not know with 500: a request missing a column
(MLflow's schema enforcement) or with a value the model refuses (a Nightshift model raises MLflow's
INVALID_PARAMETER_VALUE) would read as a server fault, which clients and KServe retry. Here an
MlflowException whose error code MLflow maps to a 4xx becomes MLServer's InferenceError (400), with MLflow's
message; anything else stays a 500. Installed in the serving image's site-packages; the ServingRuntime names
it in MLSERVER_MODEL_IMPLEMENTATION (deploy/kserve/servingruntime.yaml).
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver_mlflow import MLflowRuntime


class NightshiftMLflowRuntime(MLflowRuntime):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        try:
            return await super().predict(payload)
        except MlflowException as err:
            if 400 <= err.get_http_status_code() < 500:
                raise InferenceError(err.message) from err
            raise
