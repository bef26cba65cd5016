"""`uvicorn nightshift.deploy.asgi:app`: MLflow's own scoring app for one model, behind RequestGuard.

The model directory comes from `NIGHTSHIFT_SERVING_MODEL`; limits from `NIGHTSHIFT_SERVING_MAX_BODY`
(bytes, default 2 MiB). It loads and serves the model exactly as `mlflow models serve --env-manager
local` does (the same `scoring_server.init`), in the current environment, installing nothing.
"""

from __future__ import annotations

import os

from mlflow.pyfunc import scoring_server

from nightshift.deploy.guard import RequestGuard

MODEL_ENV = "NIGHTSHIFT_SERVING_MODEL"
MAX_BODY_ENV = "NIGHTSHIFT_SERVING_MAX_BODY"

app = RequestGuard(scoring_server.init(scoring_server.load_model_with_mlflow_config(os.environ[MODEL_ENV])),
                   max_body=int(os.environ.get(MAX_BODY_ENV, str(2 * 1024 * 1024))))
