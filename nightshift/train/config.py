"""The trainer's configuration: one typed object, validated before any process group exists."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError

# Fields that must match between a checkpoint and the run resuming from it: anything else would
# make the resumed run silently differ from the uninterrupted one.
RESUME_FIELDS = ("model", "model_kwargs", "dataset", "batch_size", "lr", "momentum", "epochs", "seed")


@dataclass
class TrainConfig:
    data: Path
    out: Path
    checkpoint_dir: Path
    model: str = "digits_cnn"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 20
    threads: int = 0
    mlflow_experiment: str | None = None
    mlflow_run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data, self.out, self.checkpoint_dir = Path(self.data), Path(self.out), Path(self.checkpoint_dir)
        for name in ("epochs", "batch_size", "checkpoint_every", "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum!r}")
        if self.threads < 0:
            raise UsageError(f"--threads must be 0 (automatic) or positive, got {self.threads!r}")
        if not isinstance(self.model_kwargs, dict):
            raise UsageError(f"--model-kwargs must be a JSON object, got {self.model_kwargs!r}")

    def resume_key(self, world_size: int) -> dict[str, Any]:
        """What a checkpoint must agree with for a resume to be exact."""
        key = {name: getattr(self, name) for name in RESUME_FIELDS}
        key["world_size"] = world_size
        return json.loads(json.dumps(key))

    def threads_per_process(self, local_size: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, local_size))

    def params(self) -> dict[str, Any]:
        """Hyperparameters as plain JSON values, for metrics, MLflow and the registry."""
        out = asdict(self)
        for key in ("data", "out", "checkpoint_dir"):
            out[key] = str(out[key])
        return out
