from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from nightshift.train.checkpoint import FORMAT, CheckpointStore
from nightshift.train.config import TrainConfig
from nightshift.train.trainer import rng_state, set_rng_state


def draw() -> tuple[float, float, float, float]:
    return (float(torch.rand(1)), float(np.random.rand()), random.random(), float(np.random.randn()))


def test_rng_states_survive_a_weights_only_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    saved = rng_state()
    expected = draw()

    store = CheckpointStore(tmp_path)
    store.write({"format": FORMAT, "step": 1, "epoch": 0, "resume_key": {}, "model": {}, "optimizer": {},
                 "scheduler": {}, "rng": [saved]})
    draw()  # move every generator on
    _, loaded = store.latest_valid()  # type: ignore[misc]
    set_rng_state(loaded["rng"][0])
    assert draw() == expected


def test_resume_key_covers_what_changes_the_result() -> None:
    base = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"))
    other_paths = TrainConfig(data=Path("elsewhere"), out=Path("o2"), checkpoint_dir=Path("c"), log_every=3)
    assert base.resume_key(2) == other_paths.resume_key(2)  # paths and logging don't matter
    assert base.resume_key(2) != base.resume_key(4)
    for field, value in {"batch_size": 64, "lr": 0.1, "seed": 1, "model": "mlp", "epochs": 9}.items():
        changed = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), **{field: value})
        assert changed.resume_key(2) != base.resume_key(2), field
