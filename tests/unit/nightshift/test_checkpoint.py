from __future__ import annotations

import io
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

from nightshift.errors import CheckpointCorrupt
from nightshift.train.checkpoint import FORMAT, AsyncCheckpointWriter, CheckpointStore, snapshot


def state(step: int, value: float = 1.0) -> dict:
    return {
        "format": FORMAT, "step": step, "epoch": 0, "resume_key": {"model": "m"},
        "model": {"w": torch.full((3,), value)}, "optimizer": {}, "scheduler": {}, "rng": [],
    }


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", keep=2)


def test_write_then_load_round_trips_and_names_sort_by_step(store: CheckpointStore) -> None:
    store.write(state(5, 0.5))
    store.write(state(10, 1.5))
    checkpoint, loaded = store.latest_valid()  # type: ignore[misc]
    assert checkpoint.step == 10
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 1.5))



def test_loss_scaler_and_thread_counts_survive_a_weights_only_load(store: CheckpointStore) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    full = {**state(1), "scaler": scaler.state_dict(), "threads": [2, 3]}
    store.write(full)
    _, loaded = store.latest_valid()  # type: ignore[misc]
    assert loaded["threads"] == [2, 3]
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(loaded["scaler"])
    assert restored.get_scale() == 1024.0 and restored.get_growth_interval() == 7

def test_keeps_only_the_newest_k(store: CheckpointStore) -> None:
    for step in (1, 2, 3, 4):
        store.write(state(step))
    assert [c.step for c in store.files()] == [3, 4]


def test_rewriting_a_step_replaces_its_file(store: CheckpointStore) -> None:
    store.write(state(7, 1.0))
    store.write(state(7, 2.0))
    files = store.files()
    assert [c.step for c in files] == [7]
    assert torch.equal(store.load(files[0])["model"]["w"], torch.full((3,), 2.0))


def test_truncated_newest_is_skipped_with_a_warning_naming_it(store: CheckpointStore,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    store.write(state(1, 1.0))
    newest = store.write(state(2, 2.0))
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        checkpoint, loaded = store.latest_valid()  # type: ignore[misc]
    assert checkpoint.step == 1 and torch.equal(loaded["model"]["w"], torch.full((3,), 1.0))
    assert newest.name in caplog.text and "truncated or corrupted" in caplog.text


def test_a_flipped_byte_is_detected(store: CheckpointStore) -> None:
    path = store.write(state(3))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=path.name):
        store.load(store.files()[0])
    assert store.latest_valid() is None


def test_a_pickle_that_would_run_code_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "payload": Exploit()}, buffer, pickle_module=pickle)
    store.write_bytes(9, buffer.getvalue())
    assert store.latest_valid() is None
    assert not (tmp_path / "pwned").exists()


def test_a_foreign_file_is_not_a_checkpoint(store: CheckpointStore) -> None:
    store.write_bytes(4, b"")  # a valid hash of nothing, but no checkpoint inside
    buffer = io.BytesIO()
    torch.save({"step": 5}, buffer)
    store.write_bytes(5, buffer.getvalue())
    with pytest.raises(CheckpointCorrupt, match="not a Nightshift checkpoint"):
        store.load(store.files()[-1])
    assert store.latest_valid() is None


def test_missing_keys_are_named(store: CheckpointStore) -> None:
    incomplete = state(6)
    del incomplete["rng"]
    store.write(incomplete)
    with pytest.raises(CheckpointCorrupt, match="lacks rng"):
        store.load(store.files()[0])


def test_leftover_temporaries_are_ignored_and_removed(store: CheckpointStore) -> None:
    store.write(state(1))
    tmp = store.directory / ".ckpt-abc.tmp"
    tmp.write_bytes(b"half a checkpoint")
    assert [c.step for c in store.files()] == [1]
    store.remove_temporaries()
    assert not tmp.exists()


def test_snapshot_is_independent_of_later_updates() -> None:
    live = {"model": {"w": torch.zeros(2)}, "opt": [torch.ones(1)]}
    frozen = snapshot(live)
    live["model"]["w"].add_(5)
    live["opt"][0].add_(5)
    assert torch.equal(frozen["model"]["w"], torch.zeros(2)) and torch.equal(frozen["opt"][0], torch.ones(1))


def test_async_writer_writes_in_order_and_reraises_errors(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=5)
    writer = AsyncCheckpointWriter(store)
    for step in (1, 2, 3):
        writer.submit(state(step))
    writer.wait()
    assert [c.step for c in store.files()] == [1, 2, 3]

    (tmp_path / "file").write_text("")
    broken = AsyncCheckpointWriter(CheckpointStore(tmp_path / "file" / "ckpt"))
    broken.submit(state(1))
    with pytest.raises(OSError):
        broken.wait()
