"""The stream part of `make demo` fails loudly: a score-stream that fails or never finishes is an error that stops the
demo (exit 1), not a line printed before the demo says it is done. A private redis-server (the machine's binary)
and a stand-in for the `nightshift` command the demo runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nightshift.errors import StreamDemoFailed
from nightshift.stream import demo

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    frame = pd.DataFrame({f"pixel_{i}": np.arange(5, dtype="float32") for i in range(4)})
    frame["label"] = np.arange(5) % 2
    frame.to_parquet(data / "test.parquet")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nightshift").write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / "nightshift").chmod(0o755)
    monkeypatch.setattr(demo, "BIN", bin_dir)
    home = tmp_path / "home"
    home.mkdir()
    return home, data


def test_a_score_stream_that_fails_fails_the_demo_with_its_message(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    home, data = _setup(tmp_path, monkeypatch, "echo 'no model nightshift-digits@champion' >&2; exit 3")
    with pytest.raises(StreamDemoFailed, match=r"score-stream exited 3: no model nightshift-digits@champion"):
        demo.stream_demo(home, data)
    assert not (home / "redis-demo").exists()  # the private Redis was stopped and its folder removed


def test_a_score_stream_that_never_finishes_is_stopped_and_named(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    home, data = _setup(tmp_path, monkeypatch, "exec sleep 60")
    with pytest.raises(StreamDemoFailed, match=r"did not finish within 2 s \(0 of 6 rows answered"):
        demo.stream_demo(home, data, timeout=2)
    assert not (home / "redis-demo").exists()
