"""score-stream options: bad values are refused with the flag's name; the password stays out of sight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nightshift.cli import build_parser, main
from nightshift.stream.consumer import StreamConfig
from nightshift.stream.errors import StreamConfigError
from nightshift.stream.redis_io import read_password_file, redact, resolve_url

BASE: dict[str, Any] = {"input": "in", "output": "out", "dead_letter": "dlq", "group": "g", "consumer": "c"}


@pytest.mark.parametrize(("change", "flag"), [
    ({"batch_rows": 0}, "--batch-rows 0"),
    ({"batch_rows": 100_000}, "--batch-rows 100000"),
    ({"batch_ms": 0}, "--batch-ms 0"),
    ({"stop_after": 0}, "--stop-after 0"),
    ({"claim_idle_ms": 0}, "--claim-idle-ms 0"),
    ({"output": "in"}, "three different streams"),
    ({"group": ""}, "--group must not be empty"),
    ({"max_deliveries": 0}, "--max-deliveries 0"),
    ({"dedup_retention_s": 0}, "--dedup-retention 0"),
    ({"wait_replicas": -1}, "--wait-replicas -1"),
    ({"model_retry_s": -1}, "--model-retry-s -1"),
    ({"threads": 0}, "--threads 0"),
    ({"dead_letter": "out:scored:x"}, "among the markers of --output"),
    ({"output": "dlq:seen:1"}, "among the markers of --dead-letter"),
])
def test_bad_options_name_the_flag(change: dict[str, object], flag: str) -> None:
    with pytest.raises(StreamConfigError, match=flag):
        StreamConfig(**{**BASE, **change})


def test_claims_are_checked_often_enough_for_the_idle_time() -> None:
    assert StreamConfig(**BASE, claim_idle_ms=1000).claim_interval_s == 0.5
    assert StreamConfig(**BASE, claim_idle_ms=600_000).claim_interval_s == 5.0


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6390/0", "redis://***@127.0.0.1:6390/0"),
    ("redis://user:s3cret@localhost/2", "redis://***@localhost/2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redact_hides_the_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_resolve_url_needs_a_redis_scheme_and_never_echoes_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIGHTSHIFT_REDIS_URL", raising=False)
    with pytest.raises(StreamConfigError, match="pass --redis"):
        resolve_url(None)
    with pytest.raises(StreamConfigError) as info:
        resolve_url("http://:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in str(info.value)
    monkeypatch.setenv("NIGHTSHIFT_REDIS_URL", "redis://127.0.0.1:1/0")
    assert resolve_url(None) == "redis://127.0.0.1:1/0"


def test_password_file(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("hunter2\n")
    assert read_password_file(path) == "hunter2"
    path.write_text("\n")
    with pytest.raises(StreamConfigError, match="is empty"):
        read_password_file(path)
    with pytest.raises(StreamConfigError, match="cannot read"):
        read_password_file(tmp_path / "missing")


def test_score_stream_is_a_subcommand() -> None:
    args = build_parser().parse_args(["score-stream", "--input", "i", "--output", "o", "--dead-letter", "d",
                                      "--group", "g", "--consumer", "c", "--batch-rows", "64"])
    assert args.batch_rows == 64 and args.batch_ms == 50 and args.stop_after is None


def test_a_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["score-stream", "--redis", "redis://127.0.0.1:1/0", "--input", "i", "--output", "i",
                 "--dead-letter", "d", "--group", "g", "--consumer", "c"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nightshift score-stream:")]
    assert code == 2 and len(lines) == 1 and "three different streams" in lines[0]


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("24h", 86400),
                                               ("7d", 604800), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    from nightshift.stream.trim import parse_duration

    assert parse_duration(text, "--max-age") == seconds


def test_a_bad_duration_names_the_flag() -> None:
    from nightshift.stream.trim import parse_duration

    with pytest.raises(StreamConfigError, match="--max-age '7 weeks'"):
        parse_duration("7 weeks", "--max-age")


def test_new_score_stream_options_and_stream_trim_are_wired() -> None:
    args = build_parser().parse_args(["score-stream", "--input", "i", "--output", "o", "--dead-letter", "d",
                                      "--group", "g", "--max-deliveries", "3", "--dedup-retention", "2d",
                                      "--wait-replicas", "1"])
    assert (args.max_deliveries, args.dedup_retention, args.wait_replicas, args.wait_timeout_ms) == (3, "2d", 1, 1000)
    trim = build_parser().parse_args(["stream-trim", "--input", "i", "--output", "o", "--dead-letter", "d",
                                      "--max-age", "24h"])
    assert (trim.max_age, trim.dedup_retention) == ("24h", "7d")


def test_the_consumer_process_gives_torch_its_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads reaches torch before the consumer runs (two consumers with torch's default threads each were
    slower than one on 2 cores); without the flag OMP_NUM_THREADS, else 1; a bad OMP_NUM_THREADS is named."""
    import torch

    from nightshift.stream import consumer as consumer_mod
    from nightshift.stream.cli import _threads

    seen: dict[str, int] = {}

    class Stub:
        def __init__(self, config: StreamConfig, url: str, password: str | None = None) -> None:
            pass

        def run(self) -> dict[str, Any]:
            seen["threads"] = torch.get_num_threads()
            return {}

        def close(self) -> None:
            pass

    monkeypatch.setattr(consumer_mod, "StreamConsumer", Stub)
    saved = torch.get_num_threads()
    try:
        consumer_mod.run_consumer(StreamConfig(**{**BASE, "threads": 3}), "redis://127.0.0.1:1/0",
                                  install_signals=False)
    finally:
        torch.set_num_threads(saved)
    assert seen["threads"] == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (_threads(None), _threads(2)) == (1, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert _threads(None) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "four")
    with pytest.raises(StreamConfigError, match="OMP_NUM_THREADS='four'"):
        _threads(None)
