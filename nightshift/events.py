"""The "new data" event: `nightshift publish-data DIR` announces a data source on a Redis pub/sub channel.

Airflow listens there (the `nightly_retrain` DAG's AssetWatcher, run by the triggerer) and starts a run on
that data. The message is one JSON object:

    {"kind": "nightshift.new-data", "version": 1, "source": "/abs/dir", "published_at": "...Z",
     "files": [{"name": "test.parquet", "bytes": 1234, "sha256": "..."}, ...], "fingerprint": "sha256:..."}

Configuration (environment):
- `NIGHTSHIFT_EVENTS_REDIS_URL`: the Redis the events go through (`redis://[:password@]host:port[/db]`).
  A password belongs here, never on a command line.
- `NIGHTSHIFT_EVENTS_CHANNEL`: the channel (default `nightshift.new-data`).

Redis pub/sub keeps nothing: a message nobody is subscribed to is gone. `publish` therefore fails when no
one heard it, so the caller knows to start Airflow's triggerer and publish again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nightshift.errors import BadEvent, EventNotHeard, EventsUnavailable, UsageError

KIND = "nightshift.new-data"
VERSION = 1
DEFAULT_CHANNEL = "nightshift.new-data"
URL_ENV = "NIGHTSHIFT_EVENTS_REDIS_URL"
CHANNEL_ENV = "NIGHTSHIFT_EVENTS_CHANNEL"
# The files a data source must hold (nightshift.datasets.SPLITS, which imports torch; a test keeps them equal).
SPLIT_FILES = ("train.parquet", "validation.parquet", "test.parquet")
CONNECT_TIMEOUT_S = 5.0


# --- configuration ----------------------------------------------------------------------------------------


def redis_url(given: str | None = None) -> str:
    """The Redis URL to publish to: `given` (a command-line value, which must not carry a password), else
    NIGHTSHIFT_EVENTS_REDIS_URL."""
    if given:
        if urlsplit(given).password:
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
    return url


def channel(given: str | None = None) -> str:
    name = (given if given is not None else os.environ.get(CHANNEL_ENV, "")).strip() or DEFAULT_CHANNEL
    if any(c in name for c in "*?[]") or any(c.isspace() for c in name):
        raise UsageError(f"channel {name!r} has spaces or glob characters (*?[]); use a plain name such as "
                         f"{DEFAULT_CHANNEL}")
    return name


def redact(url: str) -> str:
    """`url` without its password (for messages and logs)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


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


def publish(source: str | Path, *, url: str | None = None, channel_name: str | None = None) -> dict[str, Any]:
    """Publish one new-data event for `source`; returns the event, the channel and how many subscribers got it.

    UsageError: the directory is not an allowed data source (or not a data source); EventsUnavailable: Redis
    does not answer; EventNotHeard: nobody subscribes to the channel, so the event was dropped.
    """
    import redis

    url = redis_url(url)
    name = channel(channel_name)
    event = new_data_event(source)
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        receivers = int(client.publish(name, json.dumps(event, sort_keys=True)))
    except redis.AuthenticationError as err:
        raise EventsUnavailable(f"Redis at {redact(url)} refused the credentials ({err}); fix the password in "
                                f"{URL_ENV}") from err
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise EventsUnavailable(f"Redis at {redact(url)} does not answer ({err}); start it, or point {URL_ENV} "
                                f"(or --redis) at one that runs") from err
    except redis.RedisError as err:
        raise EventsUnavailable(f"Redis at {redact(url)} refused PUBLISH {name}: {err}") from err
    finally:
        client.close()
    if receivers == 0:
        raise EventNotHeard(f"nobody subscribes to channel {name} on {redact(url)}, so the event for "
                            f"{event['source']} was dropped (pub/sub keeps no messages); start Airflow with "
                            f"{URL_ENV} set to this Redis (its triggerer listens there), then publish again")
    return {"channel": name, "redis": redact(url), "receivers": receivers, "event": event}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "publish-data", help="announce a new data source: nightly_retrain starts a run on it",
        description="Publish one 'new data' event for DIR on a Redis pub/sub channel, where the nightly_retrain "
                    "DAG's AssetWatcher listens. DIR must lie under the data roots (NIGHTSHIFT_DATA_ROOTS).")
    parser.add_argument("dir", help="the data source: a directory with train/validation/test.parquet")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help=f"Redis URL without a password (default: {URL_ENV})")
    parser.add_argument("--channel", default=None, metavar="NAME",
                        help=f"pub/sub channel (default: {CHANNEL_ENV} or {DEFAULT_CHANNEL})")
    parser.set_defaults(func=_publish_data)


def _publish_data(args: argparse.Namespace) -> dict[str, Any]:
    return publish(args.dir, url=args.redis, channel_name=args.channel)
