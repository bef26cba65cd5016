"""Hostile review of the one redaction (issue 20 item 14, commit 02293e1): nightshift/redaction.py, the rank
environment filter (operators/local_launcher.child_environment) and the Redis URLs of events/stream.

Each failing case is a secret that a real client reads as one (redis-py's parse_url, libpq's keyword/value
DSN, ODBC's braced values) but that `redact` shows, `carries_secret` lets through to the ranks, or a
command line accepts.
"""

from __future__ import annotations

import pytest

from nightshift import events
from nightshift.errors import UsageError
from nightshift.redaction import carries_secret, redact, secret_name
from nightshift.stream import redis_io
from nightshift.stream.errors import StreamConfigError
from operators.local_launcher import child_environment

SECRET = "s3cretVALUE"


# --- values: what redact shows and what reaches the ranks -------------------------------------------------


@pytest.mark.parametrize("value", [
    # MEDIUM: libpq ends an unquoted value at whitespace only, so the password is "s3cretVALUE;tail"...
    pytest.param(f"host=db password=ab;{SECRET} dbname=x", id="libpq-unquoted-semicolon"),
    pytest.param(f"host=db password=ab,{SECRET} dbname=x", id="libpq-unquoted-comma"),
    pytest.param(f"host=db password=ab&{SECRET} dbname=x", id="libpq-unquoted-ampersand"),
    pytest.param(f"host=db password=ab#{SECRET} dbname=x", id="libpq-unquoted-hash"),
    # ... Python's parse_qs (and redis-py) split a query on & only: the password is "ab;s3cretVALUE".
    pytest.param(f"redis://h:6379/0?password=ab;{SECRET}", id="query-semicolon"),
    # ODBC: a braced value may hold ; (Pwd={ab;cd}).
    pytest.param(f"Server=db;Uid=sa;Pwd={{ab;{SECRET}}};", id="odbc-braced"),
])
def test_redact_hides_the_whole_value_not_its_first_piece(value: str) -> None:
    shown = redact(value)
    assert SECRET not in shown, shown


@pytest.mark.parametrize("value", [
    # LOW: redis-py (parse_qs unquotes names) reads %70assword as password; urllib-based clients alike.
    pytest.param(f"redis://10.0.0.5:6379/0?%70assword={SECRET}", id="percent-encoded-name"),
    # MEDIUM: JSON and YAML/header shapes are the usual way a config blob lands in one variable.
    pytest.param(f'{{"host": "db", "password": "{SECRET}"}}', id="json"),
    pytest.param(f"password: {SECRET}", id="yaml"),
    pytest.param(f"Authorization: Bearer {SECRET}", id="bearer-header"),
    pytest.param(f"Connection(password={SECRET})", id="after-a-parenthesis"),
    pytest.param(f"--db-password {SECRET}", id="option-with-a-space"),
])
def test_a_value_holding_a_secret_stays_behind_and_is_redacted(value: str) -> None:
    env = child_environment({"NIGHTSHIFT_SETTINGS": value, "NIGHTSHIFT_HOME": "/srv/nightshift"})
    assert "NIGHTSHIFT_SETTINGS" not in env, "passed on to the ranks"
    assert carries_secret(value)
    assert SECRET not in redact(value), redact(value)


def test_redis_py_reads_a_percent_encoded_password_parameter() -> None:
    """Why the percent-encoded case is real: the client authenticates with it."""
    from redis.connection import parse_url

    assert parse_url(f"redis://h:6379/0?%70assword={SECRET}")["password"] == SECRET


# --- the command line -------------------------------------------------------------------------------------


def test_publish_data_refuses_a_percent_encoded_password_on_the_command_line() -> None:
    """LOW: `publish-data --redis redis://h/0?%70assword=...` is accepted and shows in the process list."""
    with pytest.raises(UsageError, match="NIGHTSHIFT_EVENTS_REDIS_URL instead") as caught:
        events.redis_url(f"redis://127.0.0.1:6390/0?%70assword={SECRET}")
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:6379/0", f"redis://127.0.0.1:6379/0?password={SECRET}"])
def test_score_stream_refuses_a_password_in_redis_on_the_command_line(url: str) -> None:
    """MEDIUM (rule: no secret on a command line): score-stream / stream-trim `--redis` (resolve_url with a
    given URL) take a password in the URL, where `ps` shows it; publish-data refuses the same URL."""
    with pytest.raises(StreamConfigError) as caught:
        redis_io.resolve_url(url)
    assert SECRET not in str(caught.value)


# --- names ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "NIGHTSHIFT_PASSPHRASE", "NIGHTSHIFT_GITHUB_PAT", "NIGHTSHIFT_JWT", "NIGHTSHIFT_CREDS",
    "NIGHTSHIFT_HMAC", "NIGHTSHIFT_WEBHOOK_BEARER", "HOROVOD_PW",
])
def test_an_allowlisted_name_that_says_secret_stays_behind(name: str) -> None:
    """LOW: names under an allowed prefix (NIGHTSHIFT_, HOROVOD_, ...) that announce a secret in words
    the list lacks (PASSPHRASE, PAT, JWT, CRED(S), HMAC, BEARER, PW) reach the ranks."""
    env = child_environment({name: SECRET})
    assert name not in env


@pytest.mark.parametrize("name", ["NCCL_IB_PKEY", "NIGHTSHIFT_MAX_TOKENS", "NIGHTSHIFT_TOKENIZER"])
def test_a_rank_setting_is_not_taken_for_a_secret(name: str) -> None:
    """LOW (over-blocking): NCCL_IB_PKEY is NCCL's InfiniBand partition key (a number, not a secret; without
    it NCCL uses the default partition); *TOKEN* anywhere drops MAX_TOKENS/TOKENIZER settings silently."""
    assert not secret_name(name)
    assert name in child_environment({name: "0x8001"})


# --- what was checked and holds ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    f"postgresql://u:{SECRET}@h/db?sslpassword={SECRET}",
    f"mysql://h/db?user=u&password={SECRET}",
    f"Password={SECRET};Server=h",
    f"redis://:{SECRET}@h",
    f"PASSWORD={SECRET}",
    f"https://h/x?token={SECRET}&access_token={SECRET}&secret={SECRET}",
    f"https://acct.blob.core.windows.net/c/b?sv=2020&sig={SECRET}",
    f"redis://u:{SECRET}@h1,u:{SECRET}@h2/0",
    f"postgres://u:{SECRET}@[::1]:5432/db",
])
def test_checked_and_holds(value: str) -> None:
    assert SECRET not in redact(value) and carries_secret(value)
    assert "NIGHTSHIFT_X" not in child_environment({"NIGHTSHIFT_X": value})


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "GITHUB_PAT",
                                  "DATABASE_URL", "NIGHTSHIFT_SIGNING_KEY", "HOROVOD_SECRET_KEY"])
def test_checked_and_holds_names(name: str) -> None:
    assert name not in child_environment({name: SECRET})


@pytest.mark.parametrize("name", ["NCCL_IB_HCA", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_CYCLE_TIME",
                                  "NCCL_SOCKET_IFNAME", "NIGHTSHIFT_HOME", "NIGHTSHIFT_KEY_PREFIX"])
def test_checked_and_holds_rank_settings(name: str) -> None:
    assert child_environment({name: "eth0"})[name] == "eth0"
