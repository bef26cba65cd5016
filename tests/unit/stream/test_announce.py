"""The deploy step's champion announcement: only with $NIGHTSHIFT_REDIS_URL, never a failed deploy."""

from __future__ import annotations

from pathlib import Path

import pytest

from nightshift.deploy import _announced
from nightshift.stream.announce import announce_champion, champion_key
from nightshift.stream.redis_io import connect
from tests.integration.redis_helpers import free_port, redis_server

RESULT = {"target": "local", "status": "promoted", "model_name": "m", "version": "4"}


def test_without_a_redis_url_a_deploy_announces_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIGHTSHIFT_REDIS_URL", raising=False)
    assert _announced(dict(RESULT)) == RESULT
    assert announce_champion("m", "4") is False


def test_a_redis_that_does_not_answer_is_a_warning_not_a_failed_deploy(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NIGHTSHIFT_REDIS_URL", f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0")
    result = _announced(dict(RESULT))
    assert result["announced"] is False
    assert "registry poll" in caplog.text and "s3cret-pw" not in caplog.text


def test_a_promotion_sets_the_champion_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server:
        monkeypatch.setenv("NIGHTSHIFT_REDIS_URL", server.url)
        assert _announced(dict(RESULT))["announced"] is True
        assert "announced" not in _announced({**RESULT, "version": "5", "status": "failed"})
        client = connect(server.url)
        assert client.get(champion_key("m")) == b"4"
        client.close()
