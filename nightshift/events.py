"""The "new data" event: `nightshift publish-data DIR` appends one entry to a Redis stream.

Airflow reads it there (the `nightly_retrain` DAG's AssetWatcher, a consumer group on the stream run by the
triggerer: operators/event_triggers.py) and starts a run on that data. The entry has one field, `data`, holding
one JSON object:

    {"kind": "nightshift.new-data", "version": 1, "source": "/abs/dir", "published_at": "...Z",
     "files": [{"name": "test.parquet", "bytes": 1234, "sha256": "..."}, ...], "fingerprint": "sha256:..."}

Configuration (environment):
- `NIGHTSHIFT_EVENTS_REDIS_URL`: the Redis the events go through (`redis://[:password@]host:port[/db]`).
  A password belongs here, never on a command line.
- `NIGHTSHIFT_EVENTS_STREAM`: the stream's key (default `nightshift.new-data`).
- `NIGHTSHIFT_EVENTS_RETENTION`: about how many entries the stream keeps (default 10000; `XADD MAXLEN ~`).

A stream keeps its entries: an event published while nobody reads (Airflow stopped, the triggerer restarting)
waits in the stream, and the consumer group delivers it when the triggerer reads again. Only an entry trimmed
by the retention before any triggerer read it is lost; `publish` says how many entries the group has not yet
acknowledged, so a backlog shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nightshift.errors import BadEvent, EventsUnavailable, UsageError
from nightshift.redaction import carries_secret, redact

KIND = "nightshift.new-data"
VERSION = 1
DEFAULT_STREAM = "nightshift.new-data"
# The consumer group Airflow's watcher reads with (dags/nightly_tasks/events.py; a test keeps them equal).
CONSUMER_GROUP = "airflow-new-data"
DEFAULT_RETENTION = 10_000
URL_ENV = "NIGHTSHIFT_EVENTS_REDIS_URL"
STREAM_ENV = "NIGHTSHIFT_EVENTS_STREAM"
RETENTION_ENV = "NIGHTSHIFT_EVENTS_RETENTION"
# The files a data source must hold (nightshift.datasets.SPLITS, whose module imports pandas; a test keeps them equal).
SPLIT_FILES = ("train.parquet", "validation.parquet", "test.parquet")
CONNECT_TIMEOUT_S = 5.0


# --- configuration ----------------------------------------------------------------------------------------


def redis_url(given: str | None = None) -> str:
    """The Redis URL to publish to: `given` (a command-line value, which must not carry a password), else
    NIGHTSHIFT_EVENTS_REDIS_URL."""
    if given:
        if carries_secret(given):
            raise UsageError(f"--redis {redact(given)} has a password in it, which would show in the process "
                             f"list; put the URL in {URL_ENV} instead")
        url = given
    else:
        url = os.environ.get(URL_ENV, "").strip()
        if not url:
            raise UsageError(f"no Redis to publish to: pass --redis redis://HOST:PORT or set {URL_ENV}")
    scheme = urlsplit(url).scheme
    if scheme not in {"redis", "rediss", "unix"}:
        raise UsageError(f"Redis URL {redact(url)} has scheme {scheme or '(none)'}; expected redis://HOST:PORT[/DB] "
                         f"(rediss:// for TLS)")
    from redis.connection import parse_url

    try:  # what redis-py will read; its error can quote the password (a '/' or '#' in it cuts the host there)
        parse_url(url)
    except ValueError:
        raise UsageError(f"{'--redis' if given else URL_ENV} {redact(url)} is not a Redis URL redis-py can read: "
                         f"percent-encode any '/', '?', '#', '@' or ':' in the user name and password "
                         f"(e.g. / as %2F), and give the port and database as numbers") from None
    return url


def stream(given: str | None = None) -> str:
    """The stream's key: `given` (--stream), else NIGHTSHIFT_EVENTS_STREAM, else nightshift.new-data."""
    name = (given if given is not None else os.environ.get(STREAM_ENV, "")).strip() or DEFAULT_STREAM
    if any(c in name for c in "*?[]") or any(c.isspace() for c in name):
        raise UsageError(f"stream {name!r} has spaces or glob characters (*?[]); use a plain name such as "
                         f"{DEFAULT_STREAM}")
    return name


def retention() -> int:
    text = os.environ.get(RETENTION_ENV, "").strip() or str(DEFAULT_RETENTION)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 100:
        raise UsageError(f"{RETENTION_ENV}={text!r} is not a whole number of entries of at least 100 "
                         f"(default {DEFAULT_RETENTION})")
    return value


# --- the event --------------------------------------------------------------------------------------------


def data_manifest(source: str | Path) -> dict[str, Any]:
    """The data source, confined to the data roots, with every Parquet file's name, size and SHA-256, and one
    fingerprint over them (what a run can check it still reads the data that was announced)."""
    from nightshift.settings import confined_data_source

    path = confined_data_source(source)
    if not path.is_dir():
        raise UsageError(f"data source {source} is not a directory; pass the directory holding "
                         f"{', '.join(SPLIT_FILES)}")
    missing = [name for name in SPLIT_FILES if not (path / name).is_file()]
    if missing:
        raise UsageError(f"data source {path} lacks {', '.join(missing)}; a data source holds "
                         f"{', '.join(SPLIT_FILES)}")
    files = []
    digest = hashlib.sha256()
    for file in sorted(p for p in path.glob("*.parquet") if p.is_file()):
        with file.open("rb") as handle:
            sha = hashlib.file_digest(handle, "sha256")
        digest.update(file.name.encode() + b"\0" + sha.digest())
        files.append({"name": file.name, "bytes": file.stat().st_size, "sha256": sha.hexdigest()})
    return {"source": str(path), "files": files, "fingerprint": f"sha256:{digest.hexdigest()}"}


def new_data_event(source: str | Path, *, now: datetime | None = None) -> dict[str, Any]:
    published = (now or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")
    return {"kind": KIND, "version": VERSION, **data_manifest(source), "published_at": published}


def parse_event(data: Any) -> dict[str, Any]:
    """A published message (its JSON text, bytes or the decoded object) as the event dict, or BadEvent naming
    what is wrong with it. The source is not confined here: the reader does that (settings.confined_data_source)."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as err:
            raise BadEvent(f"the new-data event is not JSON ({err}): {data[:200]!r}; publish it with "
                           f"`nightshift publish-data DIR`") from err
    if not isinstance(data, dict):
        raise BadEvent(f"the new-data event is a JSON {type(data).__name__}, not an object; publish it with "
                       f"`nightshift publish-data DIR`")
    if data.get("kind") != KIND:
        raise BadEvent(f"the event's kind is {data.get('kind')!r}, not {KIND!r}; publish it with "
                       f"`nightshift publish-data DIR`")
    source = data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise BadEvent("the new-data event names no data source (its 'source' is missing or empty)")
    files = data.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in files):
        raise BadEvent("the new-data event's 'files' is not a list of {name, bytes, sha256} objects")
    return data


def changes_since(event: dict[str, Any]) -> list[str]:
    """How the data source differs now from what `event` announced: one line per file added, removed or
    changed (empty: the same bytes)."""
    announced = {f["name"]: f for f in event.get("files", [])}
    now = {f["name"]: f for f in data_manifest(event["source"])["files"]}
    lines = [f"{name}: added since" for name in sorted(now.keys() - announced.keys())]
    lines += [f"{name}: removed since" for name in sorted(announced.keys() - now.keys())]
    lines += [f"{name}: changed since ({announced[name].get('bytes')} -> {now[name]['bytes']} bytes)"
              for name in sorted(now.keys() & announced.keys()) if now[name]["sha256"] != announced[name].get("sha256")]
    return lines


# --- publishing -------------------------------------------------------------------------------------------


def publish(source: str | Path, *, url: str | None = None, stream_name: str | None = None) -> dict[str, Any]:
    """Append one new-data event for `source` to the stream; returns the event, the stream, the entry's id and
    how many entries Airflow's consumer group has not acknowledged yet (`waiting`, this one included; None when
    no triggerer has read the stream yet: the event is kept and read once one does).

    UsageError: the directory is not an allowed data source (or not a data source); EventsUnavailable: Redis
    does not answer or refuses the entry.
    """
    import redis

    url = redis_url(url)
    name = stream(stream_name)
    keep = retention()
    event = new_data_event(source)
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        entry_id = client.xadd(name, {"data": json.dumps(event, sort_keys=True)}, maxlen=keep, approximate=True)
        waiting = unacknowledged(client, name)
    except redis.AuthenticationError as err:
        raise EventsUnavailable(f"Redis at {redact(url)} refused the credentials ({err}); fix the password in "
                                f"{URL_ENV}") from err
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise EventsUnavailable(f"Redis at {redact(url)} does not answer ({err}); start it, or point {URL_ENV} "
                                f"(or --redis) at one that runs") from err
    except redis.RedisError as err:
        raise EventsUnavailable(f"Redis at {redact(url)} refused XADD {name}: {err}") from err
    finally:
        client.close()
    entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return {"stream": name, "id": entry, "redis": redact(url), "waiting": waiting, "event": event}


def unacknowledged(client: Any, name: str) -> int | None:
    """Entries of `name` that Airflow's consumer group has not acknowledged (delivered or not), or None when the
    group does not exist yet."""
    for group in client.xinfo_groups(name):
        group_name = group.get("name")
        if (group_name.decode() if isinstance(group_name, bytes) else group_name) == CONSUMER_GROUP:
            lag = group.get("lag")  # None when Redis cannot tell (entries were trimmed or deleted)
            return int(group.get("pending") or 0) + (int(lag) if lag is not None else 0)
    return None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "publish-data", help="announce a new data source: nightly_retrain starts a run on it",
        description="Append one 'new data' event for DIR to a Redis stream, which the nightly_retrain DAG's "
                    "AssetWatcher reads with a consumer group; the event is kept until Airflow has recorded it. "
                    "DIR must lie under the data roots (NIGHTSHIFT_DATA_ROOTS).")
    parser.add_argument("dir", help="the data source: a directory with train/validation/test.parquet")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help=f"Redis URL without a password (default: {URL_ENV})")
    parser.add_argument("--stream", default=None, metavar="KEY",
                        help=f"the stream's key (default: {STREAM_ENV} or {DEFAULT_STREAM})")
    parser.set_defaults(func=_publish_data)


def _publish_data(args: argparse.Namespace) -> dict[str, Any]:
    return publish(args.dir, url=args.redis, stream_name=args.stream)
