"""Faults found by a hostile review of issue 20 items 1, 16 and 17: the resume key (data content hash, code
version, the trainer's own code, parameters), setting mismatched checkpoints aside, superseding MLflow runs,
code_version, safe_name. Each test failed on the first version of the fix."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import torch

from nightshift import ledger
from nightshift.train.checkpoint import CheckpointStore
from nightshift.train.config import TrainConfig, data_digest
from tests.git_checkout import git_checkout

REPO = Path(__file__).resolve().parents[3]


def _copy_data(src: Path, dst: Path, train_fraction: tuple[int, int] = (1, 1)) -> Path:
    """A dataset directory like `src`, its train split cut to `train_fraction` of the rows."""
    dst.mkdir(parents=True)
    num, den = train_fraction
    for split in ("train", "validation", "test"):
        frame = pd.read_parquet(src / f"{split}.parquet")
        (frame.iloc[: len(frame) * num // den] if split == "train" else frame).to_parquet(dst / f"{split}.parquet")
    return dst


def _steps() -> Any:
    if str(REPO / "dags") not in sys.path:
        sys.path.insert(0, str(REPO / "dags"))  # as Airflow puts the DAG folder on sys.path
    from nightly_tasks import steps

    return steps


# -- item 17: code_version ------------------------------------------------------------------------------------


def test_check_changes_with_a_pinned_bundle_version_needs_no_local_git(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """The git DAG bundle pins the run to a commit, and check_changes records that commit. But it first calls
    `ledger.fingerprint`, which runs `code_version()` against the worker's own checkout: where that checkout's
    git fails (dubious ownership, a broken HEAD, no git binary) check_changes now raises CodeVersionUnknown on
    every try although the code version it is about to record needs no git at all."""
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    root = git_checkout(tmp_path / "repo")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/gone\n")  # the worker's checkout: git fails there
    monkeypatch.setattr(ledger, "_repo_root", lambda: root)

    class TI:
        bundle_instance = SimpleNamespace(name="nightshift", version="0123456789abcdef0123456789abcdef01234567")
        pushed: dict[str, Any] = {}

        def xcom_push(self, key: str, value: Any) -> None:
            self.pushed[key] = value

    ti = TI()
    params = {"epochs": 5, "workers": 2, "learning_rate": None, "batch_size": None, "momentum": None,
              "model_kwargs": None, "force": False}
    from nightshift.pipelines import load_pipeline

    digits = load_pipeline(REPO / "pipelines" / "digits.yaml")
    _steps().check_changes(digits, {"hash": "md5:data"}, params, "nightly_retrain", "r1", ti)
    assert ti.pushed["fingerprint"]["code_version"] == "0123456789abcdef0123456789abcdef01234567"


def test_the_trainers_own_code_is_part_of_the_key_when_the_dag_passes_code_version(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_data: Path) -> None:
    """On Kubernetes the code that trains is the trainer image's (nightshift installed in site-packages), while
    `--code-version` is the Airflow side's (the DAG bundle's commit, or the Airflow image's). A trainer image
    rebuilt with a training fix, and a DAG run cleared to use it, gets the same resume key and train key as
    before: it resumes the old code's final checkpoint (0 steps) and MLflow reuses the old run."""
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    site = tmp_path / "site-packages"
    (site / "nightshift").mkdir(parents=True)
    trainer_py = site / "nightshift" / "trainer.py"
    monkeypatch.setattr(ledger, "_repo_root", lambda: site)  # the trainer image: an installed package, no .git
    config = TrainConfig(data=demo_data, out=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                         code_version="bundle-commit-1")
    trainer_py.write_text("LOSS = 'cross_entropy'\n")
    before = config.with_identity().train_key(1, "cpu")
    trainer_py.write_text("LOSS = 'cross_entropy_fixed'\n")  # the image is rebuilt with a training fix
    after = config.with_identity().train_key(1, "cpu")
    assert before != after, "the trainer's own code changed but the resume key / train key did not"


# -- item 1: the data digest -----------------------------------------------------------------------------------


def test_the_data_digest_covers_files_below_a_symlinked_directory(tmp_path: Path) -> None:
    """`data_digest` says "every regular file below it", but Path.rglob (Python 3.11) does not descend into
    symlinked directories: a data directory laid out with a linked subdirectory (a dataset plugin reading
    `images/`, a cache link) gets the same digest when the bytes there change, so a cleared run resumes the
    old run's checkpoint."""
    cache = tmp_path / "cache" / "images"
    cache.mkdir(parents=True)
    (cache / "0001.bin").write_bytes(b"v1")
    data = tmp_path / "data"
    data.mkdir()
    (data / "labels.csv").write_text("0001,3\n")
    (data / "images").symlink_to(cache, target_is_directory=True)
    first = data_digest(data)
    (cache / "0001.bin").write_bytes(b"v2 - the fixed data")
    assert data_digest(data) != first


def test_the_data_version_is_the_digest_of_the_bytes_the_trainer_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_data: Path) -> None:
    """`run` loads the splits first and hashes the directory afterwards. When the files change in between (a
    re-stage into the same workspace, a user's --data directory rewritten), the model is trained on v1 while its
    checkpoints, model.json and MLflow train key say v2: the next run on v2 resumes it as if it were v2's."""
    import horovod

    import nightshift.datasets as datasets
    import nightshift.train.trainer as trainer_module
    from nightshift.train import cli

    _copy_data(demo_data, tmp_path / "v1")
    v2 = _copy_data(demo_data, tmp_path / "v2", train_fraction=(4, 5))
    data = _copy_data(demo_data, tmp_path / "data")  # what the trainer is pointed at: v1 bytes at first
    real_load = datasets.load_split

    def load_then_data_changes(name: str, directory: Any, split: str, **kwargs: Any) -> Any:
        loaded = real_load(name, directory, split, **kwargs)
        if split == "validation":  # both splits are in memory now; the directory is re-staged with v2
            shutil.copy(v2 / "train.parquet", data / "train.parquet")
        return loaded

    seen: dict[str, Any] = {}

    class RecordingTrainer:
        def __init__(self, config: TrainConfig, train: Any, validation: Any, hvd: Any, on_epoch: Any = None) -> None:
            seen["config"], seen["train_rows"] = config, len(train)

        def fit(self) -> dict[str, Any]:
            return {}

    fake_hvd = types.ModuleType("horovod.torch")
    fake_hvd.init = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "horovod.torch", fake_hvd)
    monkeypatch.setattr(horovod, "torch", fake_hvd, raising=False)
    monkeypatch.setattr(datasets, "load_split", load_then_data_changes)
    monkeypatch.setattr(trainer_module, "Trainer", RecordingTrainer)
    from nightshift.errors import DataError

    with pytest.raises(DataError, match="changed while the trainer read them"):
        cli.run(TrainConfig(data=data, out=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", code_version="c"))
    assert "config" not in seen  # refused before any training: no checkpoint or model names the wrong bytes


# -- item 1: setting checkpoints aside -------------------------------------------------------------------------


def _verdict(config: TrainConfig, store: CheckpointStore) -> dict[str, Any]:
    """Rank 0's `_find_checkpoint` on a single CPU rank, without building a model."""
    from nightshift.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.store, trainer.size, trainer.device = config, store, 1, torch.device("cpu")
    return trainer._find_checkpoint()


def _state(config: TrainConfig, step: int) -> dict[str, Any]:
    return {"format": "nightshift-checkpoint/1", "step": step, "epoch": 0, "resume_key": config.resume_key(1, "cpu"),
            "model": {}, "optimizer": {}, "scheduler": {}, "rng": [], "threads": [1], "epoch_loss": [0.0, 0]}


def test_a_stale_writers_newer_checkpoint_does_not_throw_away_the_matching_ones(tmp_path: Path) -> None:
    """An older try still running on v1 (an MPIJob whose Airflow worker died: nothing deleted it) keeps writing
    into the task's checkpoint directory after the cleared run (v2) set the v1 checkpoints aside. When the v2
    run is retried, the newest checkpoint is the stale writer's: every checkpoint, the v2 run's matching ones
    included, is moved aside and v2 trains from step 0 again (and again, while the stale writer lives)."""
    base = dict(out=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", code_version="c")
    v1 = TrainConfig(data=tmp_path, data_version="sha256:v1", **base)  # type: ignore[arg-type]
    v2 = TrainConfig(data=tmp_path, data_version="sha256:v2", **base)  # type: ignore[arg-type]
    store = CheckpointStore(tmp_path / "ckpt", keep=5)
    store.write(_state(v2, 10))
    store.write(_state(v2, 20))  # the cleared run's progress
    store.write(_state(v1, 500))  # the stale v1 writer, further along
    verdict = _verdict(v2, store)
    assert verdict.get("state", {}).get("step") == 20, f"v2's own checkpoint at step 20 was not resumed: {verdict}"


def test_set_aside_keeps_what_an_earlier_set_aside_kept(tmp_path: Path) -> None:
    """The docs (docs/concepts/training.md) promise the set-aside checkpoints are kept for a person to look at,
    but each set_aside deletes every earlier one: v1's finished checkpoints (set aside when the run was cleared
    for v2) are gone as soon as the run is cleared once more (back to v1, or v3)."""
    base = dict(out=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", code_version="c")
    store = CheckpointStore(tmp_path / "ckpt")
    v1 = TrainConfig(data=tmp_path, data_version="sha256:v1", **base)  # type: ignore[arg-type]
    v2 = TrainConfig(data=tmp_path, data_version="sha256:v2", **base)  # type: ignore[arg-type]
    store.write(_state(v1, 40))
    first = store.set_aside()
    store.write(_state(v2, 40))
    store.set_aside()
    assert [c.step for c in CheckpointStore(first).files()] == [40], "v1's set-aside checkpoints were deleted"


# -- item 1: MLflow ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Path:
    from tests.trained_model import write_trained_output

    return write_trained_output(tmp_path_factory.mktemp("trained"), demo_data, epochs=1, steps_per_epoch=2)


def _output(trained: Path, out: Path, train_key: str, dataset_version: str) -> Path:
    out.mkdir(parents=True)
    for name in ("model.pt", "model.json", "metrics.json", "metrics.jsonl"):
        (out / name).write_bytes((trained / name).read_bytes())
    info = json.loads((out / "model.json").read_text())
    (out / "model.json").write_text(json.dumps({**info, "train_key": train_key}))
    return out


def test_a_stale_try_logging_last_does_not_take_the_run_key_from_the_current_one(trained: Path,
                                                                                 tmp_path: Path) -> None:
    """Superseding is last-writer-wins. The cleared run's try trains on v2 and logs (superseding v1's run).
    An older try of the same task, still running on v1 (its MPIJob was never deleted: try names differ per
    try), finishes afterwards and logs with its v1 train key: it renames the v2 run's run key and takes it.
    `find_training_run` (the operator's collect_results) then hands evaluate/register the v1 model."""
    from nightshift import tracking
    from nightshift.tracking import RUN_KEY_TAG, TRAIN_KEY_TAG, log_training_run

    key = {RUN_KEY_TAG: "nightly_retrain/manual__1/train"}
    v2_out = _output(trained, tmp_path / "v2", "2222222222222222", "v2")
    v1_out = _output(trained, tmp_path / "v1", "1111111111111111", "v1")
    current = log_training_run(v2_out, experiment="hostile", tags={**key, "nightshift.dataset_version": "v2"})
    log_training_run(v1_out, experiment="hostile", tags={**key, "nightshift.dataset_version": "v1"})  # stale try
    # the operator asks for the run of the data and code its task trained for (TrackingConfig.mlflow_expect_tags)
    found = tracking.find_training_run("hostile", key[RUN_KEY_TAG], expect={"nightshift.dataset_version": "v2"})
    run = tracking.client().get_run(found["run_id"])
    assert run.data.tags[TRAIN_KEY_TAG] == "2222222222222222" and found["run_id"] == current, (
        f"the run key now names the stale v1 run {found['run_id']} (train key {run.data.tags[TRAIN_KEY_TAG]})")


# -- item 16: injective names ----------------------------------------------------------------------------------


def test_model_search_study_names_are_injective_in_the_run_id() -> None:
    """workspace_for and checkpoint_subdir use safe_name now, but model_search's default study name still maps
    `:` and `+` to `_`: run ids `manual__2026-01-01T00:00:00+00:00` and `manual__2026-01-01T00_00_00_00_00` open
    one Optuna study (trial numbers, trial directories and checkpoints, best.json shared); the second run finds
    the study already holding n_trials and trains nothing."""
    from nightshift.search.steps import default_study_name

    a = default_study_name("model_search", "manual__2026-01-01T00:00:00+00:00")
    b = default_study_name("model_search", "manual__2026-01-01T00_00_00_00_00")
    assert a != b


def test_study_directories_are_injective() -> None:
    """study_dir maps `/` to `_`: studies `team/a` and `team_a` share `search/team_a/trial-N/checkpoints`;
    one's trial-0 sets aside (or resumes) the other's trial-0 checkpoints."""
    from nightshift.search.study import study_dir

    assert study_dir("team/a") != study_dir("team_a")


# -- attacks that found nothing (these pass) ----------------------------------------------------------------------


def test_safe_name_fuzz_is_injective_and_stays_one_component(tmp_path: Path) -> None:
    import random

    from nightshift.fsutil import safe_name

    rng = random.Random(20)
    alphabet = "aA0_.=@+-:/~ \\\x00é\n"
    texts = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(20000)}
    texts |= {".", "..", "...", "~", "a~b", "x" * 120, "x" * 121, "-rf", "superseded"}
    names = {safe_name(t): t for t in texts}
    assert len(names) == len(texts)
    for name in names:
        assert name not in ("", ".", "..") and "/" not in name and "\x00" not in name and len(name.encode()) <= 255
        assert (tmp_path / name).parent == tmp_path


def test_a_legitimate_retry_keeps_the_same_key(tmp_path: Path, demo_data: Path) -> None:
    """A retry of `train` alone: the same staged bytes and the same --code-version give the same train key,
    whatever the checkout's state (the given code version wins)."""
    config = TrainConfig(data=demo_data, out=tmp_path / "o", checkpoint_dir=tmp_path / "c", code_version="abc")
    assert config.with_identity().train_key(2, "cpu") == config.with_identity().train_key(2, "cpu")
