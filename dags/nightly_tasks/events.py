"""`nightly_retrain` also starts when new data lands: the "new data" Asset, its AssetWatcher and the schedule.

`nightshift publish-data DIR` appends one JSON event to a Redis stream. Airflow's triggerer runs the watcher's
trigger, operators.event_triggers.RedisStreamTrigger, which reads the stream with the consumer group
`airflow-new-data` and acknowledges an entry only after the triggerer stored its asset event, so an event
published in a burst, or while the triggerer is down, is recorded when it reads again (at least once: see that
module). Each entry becomes an event of the Asset `nightshift://events/new-data` (extra: `{"from_trigger":
true, "payload": {"type": "stream", "stream", "id": <the entry's id>, "data": <the event's JSON>}}`), and the
DAG runs on the cron or on that Asset, whichever comes first (`AssetOrTimeSchedule`). `validate_data` of a run
the event started reads the data source from the event, confined to the data roots like the `data_source` Param.

Turned on by configuration, read when the DAG file is parsed:
- `NIGHTSHIFT_EVENTS_REDIS_URL`: the Redis; scripts/airflow.sh turns it into the Airflow connection
  `nightshift_events` (AIRFLOW_CONN_NIGHTSHIFT_EVENTS) that the triggerer connects with;
- or `NIGHTSHIFT_EVENTS_CONN_ID`: an Airflow connection (type redis) defined elsewhere (a secrets backend);
- `NIGHTSHIFT_EVENTS_STREAM` (default `nightshift.new-data`), `NIGHTSHIFT_EVENTS_POLL_S` (default 1): how long
  one read of the stream waits for new entries.
With neither the URL nor the connection id, the DAG keeps its time schedule alone, and the trigger module is
not even imported.

An event names a directory, not a pipeline, so it starts only the pipeline DAGs listed in
`NIGHTSHIFT_EVENTS_PIPELINES` (dag_ids separated by commas; default `nightly_retrain`, the demo pipeline): another
pipeline would validate the digits directory against its own suite and fail.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset

if TYPE_CHECKING:
    from airflow.sdk import Context

log = logging.getLogger(__name__)

NEW_DATA_URI = "nightshift://events/new-data"
URL_ENV = "NIGHTSHIFT_EVENTS_REDIS_URL"
CONN_ENV = "NIGHTSHIFT_EVENTS_CONN_ID"
STREAM_ENV = "NIGHTSHIFT_EVENTS_STREAM"
POLL_ENV = "NIGHTSHIFT_EVENTS_POLL_S"
PIPELINES_ENV = "NIGHTSHIFT_EVENTS_PIPELINES"
DEFAULT_EVENT_PIPELINES = ("nightly_retrain",)
DEFAULT_CONN_ID = "nightshift_events"
# nightshift.events.DEFAULT_STREAM and CONSUMER_GROUP (not imported: the DAG file must not import nightshift); a
# test keeps them equal.
DEFAULT_STREAM = "nightshift.new-data"
CONSUMER_GROUP = "airflow-new-data"
WATCHER_NAME = "nightshift_new_data"

# The Asset as a key (name and URI): what a run's triggering events are looked up by.
NEW_DATA = Asset(NEW_DATA_URI, group="nightshift")


class EventsMisconfigured(ValueError):
    """An events setting (poll interval, stream) cannot be used; the DAG fails to import with this message."""


def events_connection() -> str | None:
    """The Airflow connection id of the Redis the new-data events come through, or None: events are off."""
    conn_id = os.environ.get(CONN_ENV, "").strip()
    if conn_id:
        return conn_id
    return DEFAULT_CONN_ID if os.environ.get(URL_ENV, "").strip() else None


def events_stream() -> str:
    name = os.environ.get(STREAM_ENV, "").strip() or DEFAULT_STREAM
    if any(c in name for c in "*?[]") or any(c.isspace() for c in name):
        raise EventsMisconfigured(f"{STREAM_ENV}={name!r} has spaces or glob characters (*?[]); use a plain "
                                  f"stream name such as {DEFAULT_STREAM}")
    return name


def poll_interval() -> float:
    text = os.environ.get(POLL_ENV, "").strip() or "1"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise EventsMisconfigured(f"{POLL_ENV}={text!r} is not a number of seconds between 0 and 3600 (default 1)")
    return value


def new_data_asset(conn_id: str) -> Asset:
    """The new-data Asset with its watcher: a RedisStreamTrigger on the stream of connection `conn_id`."""
    # Imported here, only when events are on.
    from airflow.sdk import AssetWatcher

    from operators.event_triggers import RedisStreamTrigger

    trigger = RedisStreamTrigger(stream=events_stream(), group=CONSUMER_GROUP, redis_conn_id=conn_id,
                                 poll_interval=poll_interval())
    return Asset(NEW_DATA_URI, group="nightshift", watchers=[AssetWatcher(name=WATCHER_NAME, trigger=trigger)])


def event_pipelines() -> tuple[str, ...]:
    """The dag_ids new-data events start (NIGHTSHIFT_EVENTS_PIPELINES, default: nightly_retrain)."""
    text = os.environ.get(PIPELINES_ENV, "").strip()
    if not text:
        return DEFAULT_EVENT_PIPELINES
    return tuple(name.strip() for name in text.split(",") if name.strip())


def retrain_schedule(cron: str | None, dag_id: str = DEFAULT_EVENT_PIPELINES[0]) -> Any:
    """`cron` alone when events are off (or not for `dag_id`); with them, the new-data Asset alone (no cron) or
    either of the two."""
    conn_id = events_connection()
    if conn_id is None or dag_id not in event_pipelines():
        return cron
    asset = new_data_asset(conn_id)
    if cron is None:
        return [asset]
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    # The cron in UTC, as DAG(schedule=cron) with the UTC start_date would make it.
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC"), assets=[asset])


def event_data_source(context: Context) -> str | None:
    """The data source of the new-data event that started this run (the newest, when several were folded into
    one run), or None when no event started it (the cron, a manual trigger). Not yet confined: the caller
    resolves it like the `data_source` Param."""
    from airflow.sdk.exceptions import AirflowFailException

    from nightshift.errors import BadEvent, NightshiftError
    from nightshift.events import changes_since, parse_event

    accessor = context.get("triggering_asset_events")
    found = list(accessor.get(NEW_DATA) or []) if accessor else []
    if not found:
        return None
    newest = max(found, key=lambda e: e.timestamp)
    if len(found) > 1:
        log.warning("%d new-data events started this run; using the newest (%s)", len(found), newest.timestamp)
    payload = (newest.extra or {}).get("payload")
    data = payload.get("data") if isinstance(payload, dict) else None
    try:
        event = parse_event(data)
    except BadEvent as err:
        raise AirflowFailException(f"validate_data: this run was started by a new-data event that cannot be "
                                   f"used: {err}") from err
    log.info("Started by the new-data event published at %s for %s (%d files, %s)", event.get("published_at"),
             event["source"], len(event.get("files", [])), event.get("fingerprint"))
    try:
        changed = changes_since(event)
    except (NightshiftError, OSError) as err:  # resolving the source below says precisely what is wrong
        log.warning("Could not compare %s with the event: %s", event["source"], err)
    else:
        if changed:
            log.warning("The data in %s changed since the event was published; validating what is there now: %s",
                        event["source"], "; ".join(changed))
    return str(event["source"])
