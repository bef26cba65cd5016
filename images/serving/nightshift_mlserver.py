"""MLServer's MLflow runtime, answering a request it cannot read or the model refuses with a 4xx instead of a 500,
and never echoing the request's headers.

`mlserver_mlflow.MLflowRuntime.predict` (the V2 `infer` path, MLServer 1.7.1) lets every exception through, and
MLServer answers what it does not know with 500, which clients and KServe read as a server fault and retry:
- decoding the request into the model's input (a `shape` that does not fit its data, BYTES for a numeric
  column: ValueError, pyarrow's ArrowInvalid) happens before the model runs: the request's fault;
- an MlflowException whose error code MLflow maps to a 4xx (a missing column, MLflow's schema enforcement; a
  value a Nightshift model refuses, INVALID_PARAMETER_VALUE).
Both become MLServer's InferenceError (400); anything else the model raises stays a 500. MLflow's schema message
quotes the whole request, in which MLServer keeps every HTTP header (an `Authorization` token among them): the
answer keeps only MLflow's reason, every header value is masked, and the exception is raised without its cause,
so that neither the answer nor the server's log carries them. Installed in the serving image's site-packages;
the ServingRuntime names it in MLSERVER_MODEL_IMPLEMENTATION (deploy/kserve/servingruntime.yaml).
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlserver.errors import InferenceError
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver_mlflow import MLflowRuntime
from mlserver_mlflow.codecs import TensorDictCodec

SCHEMA_FAILURE = "Failed to enforce schema of data"


def _header_values(payload: InferenceRequest) -> list[str]:
    parameters = payload.parameters
    headers = (parameters.model_extra or {}).get("headers") if parameters is not None else None
    if parameters is not None and getattr(parameters, "headers", None):
        headers = parameters.headers
    return [str(v) for v in (headers or {}).values() if str(v)]


def _safe(message: str, payload: InferenceRequest) -> str:
    """MLflow's reason without the request it quotes, and no header value anywhere."""
    if SCHEMA_FAILURE in message and "Error: " in message:
        message = "the request does not match the model's input schema: " + message.rsplit("Error: ", 1)[1]
    for value in sorted(_header_values(payload), key=len, reverse=True):
        message = message.replace(value, "***")
    return message


class NightshiftMLflowRuntime(MLflowRuntime):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        try:
            decoded = self.decode_request(payload)
        except (ValueError, TypeError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise InferenceError(_safe(f"the request cannot be read as the model's input: {err}", payload)) from None
        params = None
        if payload.parameters and payload.parameters.model_extra:
            params = {k: v for k, v in payload.parameters.model_extra.items() if k != "headers"} or None
        try:
            output = self._model.predict(decoded, params=params)
        except MlflowException as err:
            if 400 <= err.get_http_status_code() < 500:
                raise InferenceError(_safe(err.message, payload)) from None
            raise
        return self.encode_response(output, default_codec=TensorDictCodec)
