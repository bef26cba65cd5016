"""Stream entries in and out, as pure functions: parse an input, build a prediction or a dead letter.

What this module rejects is the stream's own contract (an entry is one `data` field holding a JSON object
with an `id` and only the model's columns, each a JSON number). Whether the values suit the model
(missing columns, NaN, range) is the served model's validation (`TorchTableClassifier.validate`), which the
scorer applies; a row with missing columns is passed on incomplete so that that validation names them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from typing import Any

DATA_FIELD = b"data"
MAX_ID_LENGTH = 512
_NUMBER_TYPES = frozenset({int, float})
_FLOAT_LIMIT = int(sys.float_info.max)


@dataclass(frozen=True)
class InputRow:
    """An input that met the stream contract. `values` follow the model's column order when `complete`."""

    entry_id: str
    input_id: str | int
    features: dict[str, Any]
    values: list[float] | None
    raw: bytes | str

    @property
    def raw_text(self) -> str:
        return _text(self.raw)

    @property
    def complete(self) -> bool:
        return self.values is not None


@dataclass(frozen=True)
class Rejected:
    """An input for the dead-letter stream: why, and the payload as it came."""

    entry_id: str
    input_id: str | int | None
    reason: str
    raw: str


def entry_ms(entry_id: str) -> int:
    """The millisecond part of a stream entry id: when Redis added the entry (XADD)."""
    return int(entry_id.split("-", 1)[0])


def _text(raw: bytes | str) -> str:
    return raw if isinstance(raw, str) else raw.decode("utf-8", errors="backslashreplace")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _short_error(err: BaseException, limit: int = 200) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[:limit] + "…"


def _columns_hint(columns: tuple[str, ...]) -> str:
    return f"'id' and the model's columns {columns[0]}…{columns[-1]}" if len(columns) > 2 else \
        f"'id' and the model's columns {list(columns)}"


def parse_entry(entry_id: str, fields: dict[bytes, bytes] | None, columns: tuple[str, ...],
                column_set: frozenset[str] | None = None) -> InputRow | Rejected:
    """One input entry (as redis-py returns it) → an InputRow, or a Rejected naming what was wrong."""
    column_set = column_set if column_set is not None else frozenset(columns)
    if not fields:
        return Rejected(entry_id, None, "the entry has no fields (deleted from the stream before it was scored?)",
                        "")
    raw = fields.get(DATA_FIELD)
    if raw is None:
        names = sorted(_text(k) for k in fields)
        return Rejected(entry_id, None, f"the entry has no 'data' field (fields: {names}); send XADD STREAM * "
                        f"data JSON", json.dumps({_text(k): _text(v) for k, v in fields.items()}))
    try:
        obj = json.loads(raw)
    except RecursionError:
        return Rejected(entry_id, None, "'data' is not JSON the consumer can read (nested too deeply)", _text(raw))
    except Exception as err:  # JSONDecodeError, UnicodeDecodeError, ValueError (int-string limit), MemoryError...
        return Rejected(entry_id, None, f"'data' is not JSON the consumer can read ({_short_error(err)})",
                        _text(raw))
    if not isinstance(obj, dict):
        return Rejected(entry_id, None, f"'data' must be a JSON object with {_columns_hint(columns)}, got a "
                        f"JSON {type(obj).__name__}", _text(raw))
    if "id" not in obj:
        return Rejected(entry_id, None, "no 'id': every input needs an 'id' (a string or an integer) to tie "
                        "its prediction to", _text(raw))
    input_id = obj.pop("id")
    if isinstance(input_id, bool) or not isinstance(input_id, str | int):
        return Rejected(entry_id, None, f"'id' must be a string or an integer, got {type(input_id).__name__} "
                        f"{_short(input_id)}", _text(raw))
    if isinstance(input_id, str) and not 0 < len(input_id) <= MAX_ID_LENGTH:
        return Rejected(entry_id, None, f"'id' must be a non-empty string of at most {MAX_ID_LENGTH} "
                        f"characters (got {len(input_id)})", _text(raw))
    if isinstance(input_id, str) and not _encodes(input_id):
        return Rejected(entry_id, None, f"'id' is not valid Unicode (a lone surrogate escape such as \\ud800 in "
                        f"{_short(input_id)}); send ids that encode as UTF-8", _text(raw))
    extra = [key for key in obj if key not in column_set]
    if extra:
        return Rejected(entry_id, input_id, f"extra columns {sorted(extra)[:5]}{'…' if len(extra) > 5 else ''}; "
                        f"send only {_columns_hint(columns)}", _text(raw))
    # type() rather than isinstance(): JSON true/false are bools, which are ints to Python. The set of
    # types is one C-level pass; the loop only runs to name the offending column.
    types = set(map(type, obj.values()))
    if not types <= _NUMBER_TYPES:
        key, value = next((k, v) for k, v in obj.items() if type(v) not in _NUMBER_TYPES)
        return Rejected(entry_id, input_id, f"wrong type: {key} is a JSON {_json_type(value)} "
                        f"({_short(value)}); feature values must be JSON numbers", _text(raw))
    if obj and int in types:  # float32 conversion raises OverflowError on an integer past the float range
        low, high = min(obj.values()), max(obj.values())
        if high > _FLOAT_LIMIT or low < -_FLOAT_LIMIT:
            key, value = next((k, v) for k, v in obj.items() if abs(v) > _FLOAT_LIMIT)
            return Rejected(entry_id, input_id, f"{key} is out of range (an integer of {len(str(abs(value)))} "
                            f"digits); feature values must be finite numbers", _text(raw))
    values = [obj[c] for c in columns] if len(obj) == len(columns) else None
    return InputRow(entry_id, input_id, obj, values, raw)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def prediction_payload(input_id: str | int, label: int, model_version: str, latency_ms: float) -> str:
    return json.dumps({"id": input_id, "prediction": int(label), "model_version": str(model_version),
                       "latency_ms": round(float(latency_ms), 3)})


def dead_letter_payload(rejected: Rejected) -> str:
    out: dict[str, Any] = {"reason": rejected.reason, "data": rejected.raw}
    if rejected.input_id is not None:
        out = {"id": rejected.input_id, **out}
    return json.dumps(out)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def marker_key(input_id: str | int) -> str:
    """An input id's marker name under the output's prefix: `s:` for a string id, `i:` for an integer id (so
    the string "7" and the integer 7 stay two inputs), then a digest of the id. Producers choose ids, never
    key bytes: an id cannot name another application's key, and every marker name is ASCII of one length."""
    if isinstance(input_id, int):
        return "i:" + hashlib.blake2b(str(input_id).encode(), digest_size=16).hexdigest()
    return "s:" + hashlib.blake2b(input_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
