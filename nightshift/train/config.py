"""The trainer's configuration: one typed object, validated before any process group exists."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError
from nightshift.tasks import MULTICLASS, TASKS

DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("fp32", "bf16", "fp16")
COMPRESSIONS = ("none", "fp16")

# Fields that must match between a checkpoint and the run resuming from it: anything else would
# make the resumed run silently differ from the uninterrupted one, or hand back a model trained on
# other data. `data_version` is the content hash of the data directory's files (never its path: a DAG
# run cleared after its data was fixed reads new bytes from the same place) and `code_version` the code
# that trains. `device` enters the key resolved ("cpu" or "cuda", never "auto"): CPU and GPU kernels
# round differently. A checkpoint whose key differs is set aside and the run trains from step 0. The
# torch thread count is not in the key; see `threads_conflict`.
RESUME_FIELDS = ("model", "model_kwargs", "dataset", "dataset_options", "task", "data_version", "code_version",
                 "trainer_code", "batch_size", "lr", "momentum", "epochs", "seed", "device", "precision", "compression")


@dataclass
class TrainConfig:
    data: Path
    out: Path
    checkpoint_dir: Path
    model: str = "digits_cnn"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    # Keyword arguments of the dataset's factory (tabular: `label`, `features`), and what the model predicts
    # (nightshift.tasks): the loss, the validation metric and what the served model answers follow it.
    dataset_options: dict[str, Any] = field(default_factory=dict)
    task: str = MULTICLASS
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 20
    threads: int = 0
    device: str = "auto"
    precision: str = "fp32"
    compression: str = "none"
    # Filled by `with_identity` before training (the content hash of `data`, `nightshift.ledger.code_version`)
    # unless given (`--code-version`: the DAG run's code version, which every try of the run shares).
    data_version: str = ""
    code_version: str = ""
    # Always recomputed by `with_identity`: a hash of the `nightshift` sources this process trains with (on
    # Kubernetes the trainer image's, which `--code-version`, the Airflow side's commit, does not describe).
    trainer_code: str = ""
    mlflow_experiment: str | None = None
    mlflow_run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    # The per-epoch hook of a model search (nightshift.search.reporter): rank 0 reports val_accuracy to
    # trial `search_trial` of Optuna study `search_study` in `search_storage` after every epoch, and the
    # trainer stops (after a checkpoint) when the study prunes the trial. All three, or none.
    search_storage: str | None = None
    search_study: str | None = None
    search_trial: int | None = None
    # Horovod elastic training (nightshift.train.elastic): the world size may change while training; the state
    # is committed in memory about every `commit_seconds` of training (and every `commit_every` steps when set,
    # whichever comes first), and a lost host rolls back to the last commit: at most that much training is redone.
    elastic: bool = False
    commit_seconds: float = 10.0
    commit_every: int | None = None
    collective_timeout: int = 30  # elastic: HOROVOD_GLOO_TIMEOUT_SECONDS unless set (nightshift.train.elastic)
    join_timeout: int = 60  # elastic: HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS unless set (nightshift.train.elastic)

    def __post_init__(self) -> None:
        self.data, self.out, self.checkpoint_dir = Path(self.data), Path(self.out), Path(self.checkpoint_dir)
        for name in ("epochs", "batch_size", "checkpoint_every", "keep_checkpoints", "log_every", "commit_every",
                     "collective_timeout", "join_timeout"):
            value = getattr(self, name)
            if name == "commit_every" and value is None:  # commits by time only
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be a positive integer, got {value!r}")
        if (not isinstance(self.commit_seconds, (int, float)) or isinstance(self.commit_seconds, bool)
                or not 0 < self.commit_seconds < math.inf):
            raise UsageError(f"--commit-seconds must be a positive number of seconds, got {self.commit_seconds!r}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum!r}")
        if self.threads < 0:
            raise UsageError(f"--threads must be 0 (automatic) or positive, got {self.threads!r}")
        for name, allowed in (("device", DEVICES), ("precision", PRECISIONS), ("compression", COMPRESSIONS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not isinstance(self.model_kwargs, dict):
            raise UsageError(f"--model-kwargs must be a JSON object, got {self.model_kwargs!r}")
        if not isinstance(self.dataset_options, dict):
            raise UsageError(f"--dataset-options must be a JSON object, got {self.dataset_options!r}")
        if self.task not in TASKS:
            raise UsageError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        search = {"--search-storage": self.search_storage, "--search-study": self.search_study,
                  "--search-trial": self.search_trial}
        if any(v is not None for v in search.values()) and any(v is None for v in search.values()):
            missing = ", ".join(flag for flag, v in search.items() if v is None)
            raise UsageError(f"reporting to a search trial needs --search-storage, --search-study and "
                             f"--search-trial together; missing {missing}")
        if not isinstance(self.elastic, bool):
            raise UsageError(f"elastic must be true or false, got {self.elastic!r}")
        if self.search_trial is not None and (not isinstance(self.search_trial, int) or self.search_trial < 0):
            raise UsageError(f"--search-trial must be a trial number >= 0, got {self.search_trial!r}")

    def with_identity(self) -> TrainConfig:
        """This config with `data_version` (always recomputed from the bytes) and `code_version` resolved."""
        from nightshift.ledger import code_version, source_digest

        return replace(self, data_version=data_digest(self.data), code_version=self.code_version or code_version(),
                       trainer_code=source_digest(paths=("nightshift",)))

    def train_key(self, world_size: int, device: str) -> str:
        """A short digest of the resume key: what an MLflow run records, so that a run trained on other
        data, code or parameters is never reused in its place."""
        blob = json.dumps(self.resume_key(world_size, device), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resume_key(self, world_size: int, device: str) -> dict[str, Any]:
        """What a checkpoint must agree with for a resume to be exact, on `device` ("cpu" or "cuda")."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"the resume key needs the resolved device type, got {device!r}")
        key = {name: getattr(self, name) for name in RESUME_FIELDS}
        key["device"] = device
        # An elastic run's checkpoints do not depend on the world size (its samples and learning rate per step
        # follow the size of the moment), and never fit a fixed-size run, nor the other way round.
        key["world_size"] = "elastic" if self.elastic else world_size
        return json.loads(json.dumps(key))

    def threads_per_process(self, local_size: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, local_size))

    def threads_conflict(self, saved: list[int]) -> str | None:
        """Why a checkpoint whose ranks ran with `saved` torch threads cannot be resumed, or None.

        The thread count changes the reduction order of CPU kernels, so a resume with another count
        could end a few ulps away from the uninterrupted run. With `--threads 0` (automatic, the
        default) the trainer restores each rank's count from the checkpoint, so an Airflow retry on a
        machine with another core count still resumes exactly. An explicit `--threads N` is a choice
        the checkpoint must agree with, like the fields of the resume key.
        """
        if self.threads and any(count != self.threads for count in saved):
            there = saved[0] if len(set(saved)) == 1 else saved
            return f"threads: {there!r} there, {self.threads!r} here"
        return None

    def params(self) -> dict[str, Any]:
        """Hyperparameters as plain JSON values, for metrics, MLflow and the registry."""
        out = asdict(self)
        for key in ("data", "out", "checkpoint_dir"):
            out[key] = str(out[key])
        for key in ("search_storage", "search_study", "search_trial"):  # where to report, not how to train
            del out[key]
        return out


def data_digest(data: str | Path) -> str:
    """The content hash of a data directory: every regular file below it, symlinked directories followed
    (hidden names skipped), by relative path, size and bytes. The same files give the same digest wherever
    they lie."""
    root = Path(data)
    if not root.exists():
        raise UsageError(f"--data {root} does not exist")
    if not root.is_dir():
        raise UsageError(f"--data {root} is not a directory")
    files: list[tuple[str, Path]] = []
    seen: set[tuple[int, int]] = set()
    for here, dirs, names in os.walk(root, followlinks=True):
        info = os.stat(here)
        if (info.st_dev, info.st_ino) in seen:  # a link loop: that directory was walked already
            dirs[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(here) / name
            if not name.startswith(".") and path.is_file():
                files.append((path.relative_to(root).as_posix(), path))
    if not files:
        raise UsageError(f"--data {root} holds no files")
    digest = hashlib.sha256()
    for relative, path in sorted(files):
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(f"{relative}\0{size}\0".encode())
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
