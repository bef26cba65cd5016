"""The new-data event (nightshift.events) without Redis: what it says about a data source, which sources and
URLs it refuses, how a received message is read back. Publishing over a real Redis: tests/integration/
test_publish_data.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nightshift import events
from nightshift.errors import BadEvent, UsageError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def source(nightshift_home: Path, demo_data: Path) -> Path:
    """A copy of the demo dataset under a data root (NIGHTSHIFT_HOME/data)."""
    out = nightshift_home / "data" / "batch-1"
    out.mkdir(parents=True)
    for file in demo_data.glob("*.parquet"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


def test_the_event_names_the_source_and_every_file_with_size_and_hash(source: Path) -> None:
    event = events.new_data_event(source)
    assert event["kind"] == "nightshift.new-data" and event["version"] == 1
    assert event["source"] == str(source.resolve())
    assert [f["name"] for f in event["files"]] == ["test.parquet", "train.parquet", "validation.parquet"]
    train = next(f for f in event["files"] if f["name"] == "train.parquet")
    assert train["bytes"] == (source / "train.parquet").stat().st_size
    assert len(train["sha256"]) == 64
    assert event["fingerprint"].startswith("sha256:")
    assert event["published_at"].endswith("Z")
    assert events.parse_event(json.dumps(event)) == event  # what a subscriber reads back


def test_the_fingerprint_follows_the_bytes(source: Path) -> None:
    before = events.data_manifest(source)["fingerprint"]
    assert events.data_manifest(source)["fingerprint"] == before
    (source / "extra.parquet").write_bytes((source / "test.parquet").read_bytes())
    assert events.data_manifest(source)["fingerprint"] != before


def test_changes_since_names_each_added_removed_and_changed_file(source: Path) -> None:
    event = events.new_data_event(source)
    assert events.changes_since(event) == []
    (source / "test.parquet").write_bytes(b"PAR1 not the same")
    (source / "more.parquet").write_bytes(b"PAR1")
    event["files"].append({"name": "gone.parquet", "bytes": 1, "sha256": "0" * 64})
    changes = events.changes_since(event)
    assert changes[0] == "more.parquet: added since"
    assert changes[1] == "gone.parquet: removed since"
    assert changes[2].startswith("test.parquet: changed since (") and "-> 17 bytes" in changes[2]


def test_a_source_outside_the_data_roots_is_refused(tmp_path: Path, demo_data: Path) -> None:
    with pytest.raises(UsageError, match="outside the allowed data roots"):
        events.new_data_event(demo_data)  # a real dataset, but not under NIGHTSHIFT_HOME/data
    with pytest.raises(UsageError, match="outside the allowed data roots"):
        events.new_data_event("/etc")


def test_a_source_that_is_not_a_dataset_is_refused(nightshift_home: Path, source: Path) -> None:
    (source / "validation.parquet").unlink()
    with pytest.raises(UsageError, match=r"lacks validation\.parquet"):
        events.new_data_event(source)
    with pytest.raises(UsageError, match="is not a directory"):
        events.new_data_event(source / "train.parquet")
    with pytest.raises(UsageError, match="is not a directory"):
        events.new_data_event(nightshift_home / "data" / "missing")


def test_the_redis_url_comes_from_the_option_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(events.URL_ENV, raising=False)
    with pytest.raises(UsageError, match="pass --redis redis://HOST:PORT or set NIGHTSHIFT_EVENTS_REDIS_URL"):
        events.redis_url(None)
    monkeypatch.setenv(events.URL_ENV, "redis://:s3cret@127.0.0.1:6390/0")
    assert events.redis_url(None) == "redis://:s3cret@127.0.0.1:6390/0"
    assert events.redis_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"


def test_a_password_on_the_command_line_is_refused_without_showing_it() -> None:
    with pytest.raises(UsageError, match="NIGHTSHIFT_EVENTS_REDIS_URL instead") as caught:
        events.redis_url("redis://user:s3cret@127.0.0.1:6390/0")
    assert "s3cret" not in str(caught.value) and "redis://***@127.0.0.1:6390" in str(caught.value)
    with pytest.raises(UsageError, match="expected redis://HOST:PORT"):
        events.redis_url("http://127.0.0.1:6379")


def test_redact_hides_the_user_and_password() -> None:
    assert events.redact("redis://:pw@h:1/0") == "redis://***@h:1/0"
    assert events.redact("rediss://u:pw@h:1/2") == "rediss://***@h:1/2"
    assert events.redact("redis://h:1/0") == "redis://h:1/0"


def test_the_stream_is_a_plain_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(events.STREAM_ENV, raising=False)
    assert events.stream(None) == "nightshift.new-data"
    monkeypatch.setenv(events.STREAM_ENV, "team-a.new-data")
    assert events.stream(None) == "team-a.new-data"
    assert events.stream("x") == "x"
    with pytest.raises(UsageError, match="glob characters"):
        events.stream("new-*")


def test_the_retention_is_a_number_of_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(events.RETENTION_ENV, raising=False)
    assert events.retention() == 10_000
    monkeypatch.setenv(events.RETENTION_ENV, "500")
    assert events.retention() == 500
    for bad in ("lots", "10"):
        monkeypatch.setenv(events.RETENTION_ENV, bad)
        with pytest.raises(UsageError, match="NIGHTSHIFT_EVENTS_RETENTION"):
            events.retention()


@pytest.mark.parametrize(("data", "reason"), [
    ("not json", "is not JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"kind": "other", "source": "/x"}), "kind is 'other'"),
    (json.dumps({"kind": "nightshift.new-data"}), "names no data source"),
    (json.dumps({"kind": "nightshift.new-data", "source": " "}), "names no data source"),
    (json.dumps({"kind": "nightshift.new-data", "source": "/x", "files": "a"}), "'files' is not a list"),
    (None, "a JSON NoneType, not an object"),
])
def test_a_message_that_is_not_a_new_data_event_is_refused(data: str | None, reason: str) -> None:
    with pytest.raises(BadEvent, match=reason):
        events.parse_event(data)


def test_bytes_are_read_as_utf8() -> None:
    assert events.parse_event(b'{"kind": "nightshift.new-data", "source": "/d"}')["source"] == "/d"


def _string_constant(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def test_the_copies_kept_apart_for_import_cost_stay_equal() -> None:
    from nightshift.datasets import SPLITS

    assert events.SPLIT_FILES == tuple(f"{s}.parquet" for s in SPLITS)
    dag_side = REPO / "dags" / "nightly_tasks" / "events.py"
    assert _string_constant(dag_side, "DEFAULT_STREAM") == events.DEFAULT_STREAM
    assert _string_constant(dag_side, "CONSUMER_GROUP") == events.CONSUMER_GROUP
    assert _string_constant(dag_side, "URL_ENV") == events.URL_ENV
    assert _string_constant(dag_side, "STREAM_ENV") == events.STREAM_ENV
