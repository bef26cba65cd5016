"""`nightshift stream-trim`: trim a scoring stream's input, output and dead letters together, by age, without
reopening duplicates.

- The input is trimmed only below every consumer group's oldest pending entry and below the first entry it
  has not delivered yet: nothing a consumer still owes a prediction is removed. An input with no group is
  left alone.
- The output and dead-letter streams are trimmed by age alone (readers downstream must keep up).
- The markers (`<output>:scored:<digest>`, `<dead-letter>:seen:<entry>`) expire by themselves after the
  consumers' `--dedup-retention`. Trimming never deletes one, and it refuses an age longer than the
  retention: an input entry older than its marker, read again (a group created again, XGROUP SETID), would
  be scored a second time.
- That bound holds only for what the trim removes. A pending entry older than the retention (a consumer
  that is gone, a group nobody reads) holds the input's trim back, and the inputs after it outlive their
  markers. The trim says so (`warnings`, and the CLI exits 1) naming the group, the entry and its consumer.
"""

from __future__ import annotations

import re
from typing import Any

from nightshift.stream.errors import StreamConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    """'90', '90s', '30m', '24h', '7d' -> seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise StreamConfigError(f"{flag} {text!r}: give a duration such as 3600, 90s, 30m, 24h or 7d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-", 1)
    return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-", 1)
    return int(ms), int(seq)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def trim_streams(client: Any, *, input: str, output: str, dead_letter: str, max_age_s: float,
                 dedup_retention_s: float) -> dict[str, Any]:
    """Trim the three streams to entries younger than `max_age_s` (Redis's clock), keeping every input a
    consumer group still owes. Returns what was trimmed per stream."""
    if max_age_s <= 0:
        raise StreamConfigError(f"--max-age {max_age_s:g} s: must be positive")
    if max_age_s > dedup_retention_s:
        raise StreamConfigError(
            f"--max-age {max_age_s:g} s is longer than --dedup-retention {dedup_retention_s:g} s: inputs would "
            f"outlive their markers and be scored again if read again; trim to at most the retention")
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    cutoff = f"{now_ms - int(max_age_s * 1000)}-0"
    result: dict[str, Any] = {"cutoff": cutoff, "max_age_s": max_age_s}

    keep_from = cutoff
    groups = client.xinfo_groups(input) if client.exists(input) else []
    held_by: list[str] = []
    warnings: list[str] = []
    retention_ms = now_ms - int(dedup_retention_s * 1000)
    for group in groups:
        name = _text(group["name"])
        bounds = [_next_id(_text(group["last-delivered-id"]))]
        if int(group["pending"]):
            oldest = _text(client.xpending(input, name)["min"])
            bounds.append(oldest)
            if _id_key(oldest)[0] < retention_ms:
                warnings.append(_stale_pending(client, input, name, oldest, dedup_retention_s))
        first = min(bounds, key=_id_key)
        if _id_key(first) < _id_key(keep_from):
            keep_from = first
            held_by.append(name)
    if groups:
        trimmed = int(client.xtrim(input, minid=keep_from, approximate=False))
        result["input"] = {"stream": input, "trimmed": trimmed, "kept_from": keep_from, "held_by_groups": held_by}
        if warnings:
            result["warnings"] = warnings
    else:
        result["input"] = {"stream": input, "trimmed": 0, "note": "no consumer group: left untrimmed"}
    for key, stream in (("output", output), ("dead_letter", dead_letter)):
        result[key] = {"stream": stream, "trimmed": int(client.xtrim(stream, minid=cutoff, approximate=False))}
    result["markers"] = f"expire by themselves after --dedup-retention {dedup_retention_s:g} s; none deleted"
    return result


def _stale_pending(client: Any, stream: str, group: str, entry: str, dedup_retention_s: float) -> str:
    """The warning for a pending entry older than the retention: it holds the trim back past the markers."""
    [item] = client.xpending_range(stream, group, min=entry, max=entry, count=1) or [None]
    owner = (f"consumer {_text(item['consumer'])!r}, idle {int(item['time_since_delivered']) / 1000:.0f} s, "
             f"delivered {int(item['times_delivered'])} times") if item else "its consumer unknown"
    return (f"group {group!r} has entry {entry} pending ({owner}), older than --dedup-retention "
            f"{dedup_retention_s:g} s: it holds the trim of {stream!r} back, and the inputs after it have outlived "
            f"their markers (a group reading {stream!r} again, XGROUP SETID ... 0, would score them a second "
            f"time). Let a consumer of {group!r} claim it (after --claim-idle-ms), or XACK it, or XGROUP "
            f"DELCONSUMER a consumer that is gone; then trim again")
