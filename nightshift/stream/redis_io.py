"""Redis for stream scoring: the connection (its password kept out of logs), the consumer group, and the
one script that writes a batch's predictions and dead letters and acknowledges its inputs atomically.

Exactly once = at least once + idempotent output. An input is acknowledged only in the same script that
writes its prediction (or its dead letter), so a consumer killed at any point leaves its inputs pending (and
another consumer claims them). The script writes an outcome only for an entry still pending in the group, a
prediction only when the input id has no marker `<output>:scored:<s|i>:<digest of the id>` and the entry none
`<dead-letter>:seen:<entry id>`, and a dead letter only when the entry has neither: an input delivered
twice (claimed after a crash, retried after a lost reply, sent twice, or scored by one consumer and
dead-lettered by another in a claim race) gets one outcome. Markers expire after the dedup retention
(`--dedup-retention`), so they do not grow with the stream.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nightshift.redaction import redact
from nightshift.stream.errors import StreamConfigError

REDIS_URL_ENV = "NIGHTSHIFT_REDIS_URL"
PASSWORD_FILE_ENV = "NIGHTSHIFT_REDIS_PASSWORD_FILE"

# KEYS: input stream, output stream, dead-letter stream, then per input two markers: its prediction marker
# (<output>:scored:<marker_key(id)>; for a dead letter whose id is unknown, its dead-letter marker again) and
# its dead-letter marker (<dead-letter>:seen:<entry id>).
# ARGV: the group, the markers' time to live in ms, then per input three values: kind, the input's entry id,
# the payload. Kinds: "p" a prediction; "d" a dead letter; "f" a dead letter for an input one of whose marker
# keys holds another Redis type (another application's key: it is neither read nor set nor expired); "g" a
# dead letter for an entry XAUTOCLAIM found deleted from the stream (no longer pending).
# Returns {written, duplicates, dead_letters, own predictions, own dead letters}: the last two count
# duplicates whose outcome was for this very entry (what a retry after a lost reply finds of its own first
# run). Or, before writing anything, {"foreign", i, ...}: the 1-based positions of the "p"/"d" inputs whose
# marker keys hold another type; the consumer sends those again as "f".
#
# An entry gets an outcome only while it is pending in the group (XPENDING): an entry another consumer (or
# this one, before a lost reply) already acknowledged is a duplicate even when its marker has expired (a
# consumer that stalled past --dedup-retention with a batch in hand writes nothing).
#
# Every check comes before the first write (a Lua script is not rolled back when a command fails): the
# stream types, then the markers and the pending list. Only then, per input, the entry is added and its
# marker set after it, so a failed XADD leaves no marker behind. Redis denies a script for memory (OOM) only
# at its first write, so a script that started writing finishes.
WRITE_AND_ACK = """
for k = 1, 3 do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if t ~= 'stream' and t ~= 'none' then
    return redis.error_reply('WRONGTYPE ' .. KEYS[k] .. ' holds a ' .. t .. ', not a stream; nothing was written')
  end
end
local function marker(key)  -- nil when the key holds another type
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v['err'] then return nil end
  return v
end
local group, ttl = ARGV[1], ARGV[2]
local n = (#ARGV - 2) / 3
local skip, own, scored_ok, seen_ok, foreign = {}, {}, {}, {}, {}
for i = 0, n - 1 do
  local kind, entry = ARGV[3 + 3 * i], ARGV[4 + 3 * i]
  local by, dead = marker(KEYS[4 + 2 * i]), marker(KEYS[5 + 2 * i])
  scored_ok[i], seen_ok[i] = by ~= nil, dead ~= nil
  if (by == nil or dead == nil) and (kind == 'p' or kind == 'd') then
    foreign[#foreign + 1] = i + 1
  end
  if by == nil then by = false end
  if dead == nil then dead = false end
  local owed = kind == 'g' or #redis.call('XPENDING', KEYS[1], group, entry, entry, 1) > 0
  if kind == 'p' then
    skip[i] = not owed or by ~= false or dead ~= false
    own[i] = by == entry
  else
    skip[i] = not owed or dead ~= false or by == entry
    own[i] = dead ~= false
  end
end
if #foreign > 0 then
  return {'foreign', unpack(foreign)}
end
local written, duplicates, dead_letters, own_p, own_d = 0, 0, 0, 0, 0
local done, acks = {}, {}
for i = 0, n - 1 do
  local kind, entry, payload = ARGV[3 + 3 * i], ARGV[4 + 3 * i], ARGV[5 + 3 * i]
  local scored, seen = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  if skip[i] or (kind == 'p' and done[scored]) then
    duplicates = duplicates + 1
    if own[i] and kind == 'p' then own_p = own_p + 1 elseif own[i] then own_d = own_d + 1 end
    -- seen again: its markers live a retention longer
    if scored_ok[i] then redis.call('PEXPIRE', scored, ttl) end
    if seen_ok[i] then redis.call('PEXPIRE', seen, ttl) end
  elseif kind == 'p' then
    redis.call('XADD', KEYS[2], '*', 'data', payload)
    redis.call('SET', scored, entry, 'PX', ttl)
    done[scored] = true
    written = written + 1
  else
    redis.call('XADD', KEYS[3], '*', 'data', payload)
    if seen_ok[i] then redis.call('SET', seen, 'd', 'PX', ttl) end
    dead_letters = dead_letters + 1
  end
  if kind ~= 'g' then acks[#acks + 1] = entry end
end
for j = 1, #acks, 1000 do
  redis.call('XACK', KEYS[1], group, unpack(acks, j, math.min(j + 999, #acks)))
end
return {written, duplicates, dead_letters, own_p, own_d}
"""

# KEYS: the input stream. ARGV: group, consumer, min idle ms, start id, count. XAUTOCLAIM ... JUSTID: claims
# without counting a delivery (the consumer then reads what it claimed from its own pending list, so that
# entries are counted as it reads them). Returns {next start id, claimed ids, ids deleted from the stream
# (which XAUTOCLAIM has dropped from the pending list)}. A script, because redis-py drops the third element.
CLAIM_IDLE = """
return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5], 'JUSTID')
"""

# KEYS: the input stream. ARGV: group, consumer, entry ids. Resets the idle time of those of the entries still
# pending for this consumer (XCLAIM ... JUSTID counts no delivery), so that claimers leave alone a batch the
# consumer holds while it waits out a model failure or a Redis that says "not now". Returns how many.
HEARTBEAT = """
local owned = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    owned[#owned + 1] = ARGV[i]
  end
end
if #owned == 5 then return 0 end
owned[#owned + 1] = 'JUSTID'
redis.call(unpack(owned))
return #owned - 6
"""


def scored_key(output_stream: str) -> str:
    """The prefix of `output_stream`'s prediction markers: `<prefix>:<marker_key(id)>` holds the entry id of
    the input that got the prediction."""
    return f"{output_stream}:scored"


def dead_key(dead_letter_stream: str) -> str:
    """The prefix of `dead_letter_stream`'s markers: `<prefix>:<entry id>` is set once the entry is there."""
    return f"{dead_letter_stream}:seen"


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
    """--redis, else $NIGHTSHIFT_REDIS_URL; checked for a scheme Redis understands. A --redis URL holding a
    password (userinfo, ?password=) is refused: the command line shows in the process list."""
    from nightshift.redaction import carries_secret

    if url and carries_secret(url):
        raise StreamConfigError(f"--redis {redact(url)} has a password in it, which would show in the process "
                                f"list; put the password in a file named by --redis-password-file "
                                f"(${PASSWORD_FILE_ENV}), or the URL in ${REDIS_URL_ENV}")
    url = url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise StreamConfigError(f"no Redis URL: pass --redis redis://HOST:PORT/DB or set {REDIS_URL_ENV}")
    scheme = urlsplit(url).scheme
    if scheme not in {"redis", "rediss", "unix"}:
        raise StreamConfigError(f"--redis {redact(url)}: the URL must start with redis://, rediss:// or unix://")
    return url


def connect(url: str, *, password: str | None = None, timeout: float = 10.0, single_connection: bool = False) -> Any:
    """A redis-py client (bytes in and out). Nothing is sent yet; redis-py connects on first use.
    `single_connection`: every command on one connection (WAIT counts the writes of its own connection)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py: the consumer's own loop decides what is retried (a read is not: entries
    # a lost reply delivered are read again from the pending list) and how long it waits.
    kwargs: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": 30.0,
                              "health_check_interval": 30, "retry": Retry(NoBackoff(), 0)}
    if password is not None:
        kwargs["password"] = password
    return redis.Redis.from_url(url, single_connection_client=single_connection, **kwargs)


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


def retryable_errors() -> tuple[type[BaseException], ...]:
    """Replies that say "not now" rather than "never": the connection errors, and a server that is a
    replica now (READONLY, after a failover), out of memory (OOM: maxmemory with noeviction), a replica that
    lost its master (MASTERDOWN) or a cluster slot in migration (TRYAGAIN). The consumer backs off and
    retries them."""
    import redis

    return (*connection_errors(), redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError,
            redis.exceptions.MasterDownError, redis.exceptions.TryAgainError)


def is_wrong_type(err: BaseException) -> bool:
    """A WRONGTYPE reply: a key named for a stream or a marker holds another type."""
    return "WRONGTYPE" in str(err)
