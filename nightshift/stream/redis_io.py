"""Redis for stream scoring: the connection (its password kept out of logs), the consumer group, and the
one script that writes a batch's predictions and acknowledges its inputs atomically.

Exactly once = at least once + idempotent output. An input is acknowledged only in the same script that
writes its prediction, so a consumer killed at any point leaves its inputs pending (and another consumer
claims them); and the script writes a prediction only when `HSETNX <output>:scored <id>` sets a new field,
so an input delivered twice (claimed after a crash, retried after a lost reply, or sent twice) is
acknowledged without a second prediction.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nightshift.stream.errors import StreamConfigError

REDIS_URL_ENV = "NIGHTSHIFT_REDIS_URL"
PASSWORD_FILE_ENV = "NIGHTSHIFT_REDIS_PASSWORD_FILE"

# KEYS: input stream, output stream, dead-letter stream, scored-ids hash, dead-lettered-entries hash.
# ARGV: the group, then per input four values: kind ("p" prediction | "d" dead letter), the input's entry
# id, the marker key (the input id for "p"), the payload. Returns {written, duplicates, dead_letters}.
WRITE_AND_ACK = """
local written, duplicates, dead = 0, 0, 0
for i = 2, #ARGV, 4 do
  local kind, entry, key, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if kind == 'p' then
    if redis.call('HSETNX', KEYS[4], key, entry) == 1 then
      redis.call('XADD', KEYS[2], '*', 'data', payload)
      written = written + 1
    else
      duplicates = duplicates + 1
    end
  else
    if redis.call('HSETNX', KEYS[5], entry, '1') == 1 then
      redis.call('XADD', KEYS[3], '*', 'data', payload)
      dead = dead + 1
    else
      duplicates = duplicates + 1
    end
  end
  redis.call('XACK', KEYS[1], ARGV[1], entry)
end
return {written, duplicates, dead}
"""


def scored_key(output_stream: str) -> str:
    """The hash of input ids that have a prediction in `output_stream` (id → the input's entry id)."""
    return f"{output_stream}:scored"


def dead_key(dead_letter_stream: str) -> str:
    """The hash of input entry ids already written to `dead_letter_stream`."""
    return f"{dead_letter_stream}:seen"


def redact(url: str) -> str:
    """`url` without its password (and user), for logs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def read_password_file(path: str | Path) -> str:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise StreamConfigError(f"cannot read the Redis password file {path} ({err.strerror}); pass a readable "
                                f"file holding only the password") from err
    password = text.strip("\r\n")
    if not password:
        raise StreamConfigError(f"the Redis password file {path} is empty")
    return password


def resolve_url(url: str | None) -> str:
    """--redis, else $NIGHTSHIFT_REDIS_URL; checked for a scheme Redis understands."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise StreamConfigError(f"no Redis URL: pass --redis redis://HOST:PORT/DB or set {REDIS_URL_ENV}")
    scheme = urlsplit(url).scheme
    if scheme not in {"redis", "rediss", "unix"}:
        raise StreamConfigError(f"--redis {redact(url)}: the URL must start with redis://, rediss:// or unix://")
    return url


def connect(url: str, *, password: str | None = None, timeout: float = 10.0) -> Any:
    """A redis-py client (bytes in and out). Nothing is sent yet; redis-py connects on first use."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py: the consumer's own loop decides what is retried (a read is not: entries
    # a lost reply delivered are read again from the pending list) and how long it waits.
    kwargs: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": 30.0,
                              "health_check_interval": 30, "retry": Retry(NoBackoff(), 0)}
    if password is not None:
        kwargs["password"] = password
    return redis.Redis.from_url(url, **kwargs)


def ensure_group(client: Any, stream: str, group: str) -> bool:
    """Create consumer group `group` on `stream` (and the stream) from its start; False if it existed."""
    import redis

    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" in str(err):
            return False
        raise
    return True


def connection_errors() -> tuple[type[BaseException], ...]:
    """What a Redis restart or an unreachable server raises (redis-py's BusyLoadingError, while the
    append-only file is replayed, is a ConnectionError)."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
