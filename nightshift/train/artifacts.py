"""The trainer's output directory (`--out`): its file names, and the trained model in it.

Every module that reads or writes a training output names its files from here: `model.pt` (state dict),
`model.json` (how to rebuild the network), `metrics.jsonl` (progress and per-epoch lines), `metrics.json`
(the final summary) and `mlflow_run.json` (the MLflow run that logged it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nightshift.errors import DataError
from nightshift.fsutil import atomic_write_bytes, atomic_write_json

MODEL_FILE = "model.pt"
MODEL_INFO = "model.json"
METRICS_LOG = "metrics.jsonl"
METRICS_SUMMARY = "metrics.json"
RUN_RECORD = "mlflow_run.json"


def save_trained_model(out: Path, model: nn.Module, *, model_name: str, model_kwargs: dict[str, Any],
                       dataset: str, params: dict[str, Any], train_key: str | None = None,
                       task: str = "multiclass", preprocessing: dict[str, Any] | None = None) -> Path:
    """Write the weights, then the description that makes them loadable; return the weights' path.

    `model.json` records `task` and, for a dataset that has it (tabular), `preprocessing`: the feature columns
    in order, their train-split mean, std, min and max, and the classes or the target's mean and std.
    """
    import io

    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    # CPU tensors whatever device trained the model, so the weights load anywhere without a map_location.
    torch.save({name: value.detach().cpu() for name, value in model.state_dict().items()}, buffer)
    atomic_write_bytes(out / MODEL_FILE, buffer.getvalue())
    info = {
        "model": model_name,
        "model_kwargs": json.loads(json.dumps(model_kwargs)),
        "dataset": dataset,
        "input_shape": list(model_kwargs.get("input_shape", ())),
        "num_classes": model_kwargs.get("num_classes"),
        "task": task,
        "params": params,
    }
    if preprocessing is not None:
        info["preprocessing"] = json.loads(json.dumps(preprocessing))
    if train_key:  # the digest of the resume key: data version, code version, parameters, world size, device
        info["train_key"] = train_key
    atomic_write_json(out / MODEL_INFO, info)
    return out / MODEL_FILE


def read_model_info(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MODEL_INFO
    if not path.is_file():
        raise DataError(f"{path} is missing: {out_dir} is not a trainer output directory")
    return json.loads(path.read_text())


def load_trained_model(out_dir: str | Path) -> nn.Module:
    """Rebuild the model described in `model.json` and load `model.pt` into it (eval mode)."""
    from nightshift.models import build_model

    info = read_model_info(out_dir)
    kwargs = dict(info["model_kwargs"])
    if "input_shape" in kwargs:
        kwargs["input_shape"] = tuple(kwargs["input_shape"])
    model = build_model(info["model"], **kwargs)
    weights = Path(out_dir) / MODEL_FILE
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    except Exception as err:
        raise DataError(f"{weights} cannot be loaded into model {info['model']!r}: {err}") from err
    return model.eval()
