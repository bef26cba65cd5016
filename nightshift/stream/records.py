"""Stream entries in and out, as pure functions: parse an input, build a prediction or a dead letter.

What this module rejects is the stream's own contract. An entry is either one `data` field holding a JSON
object with an `id` and only the model's columns, each a JSON number; or, for producers that want to skip
JSON, three fields (an entry with `id` and `shape` fields is binary): `id` (the input's id: a decimal
integer is the integer id, anything else a string), `shape` (`N` or `1,N`, N the model's number of
columns) and `data` (N little-endian float32 values in the model's column order, 4·N bytes). Whether the
values suit the model
(missing columns, NaN, range) is the served model's validation (`TorchTableClassifier.validate`), which the
scorer applies; a row with missing columns is passed on incomplete so that that validation names them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson

DATA_FIELD = b"data"
SHAPE_FIELD = b"shape"
ID_FIELD = b"id"
_BINARY_FIELDS = frozenset({ID_FIELD, SHAPE_FIELD, DATA_FIELD})
_INT_ID = re.compile(r"-?(0|[1-9][0-9]*)")  # a decimal integer id: JSON's integer id of the same digits
MAX_ID_LENGTH = 512
_NUMBER_TYPES = frozenset({int, float})
_FLOAT_MAX = sys.float_info.max
_FLOAT_LIMIT = int(_FLOAT_MAX)  # the largest integer within float range
# What a model answers for one input: a class value (the demo's labels are ints) or a regression's value.
Prediction = int | float | str | bool


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~0.6 µs more per row to build (one per input)
class InputRow:
    """An input that met the stream contract. `values` follow the model's column order when `complete`;
    `features` (column -> value) is what came when a column is missing, for the served model's validation to
    name it; complete rows need only `values` and may leave it empty."""

    entry_id: str
    input_id: str | int
    features: dict[str, Any]
    values: list[float] | tuple[float, ...] | np.ndarray | None
    raw: bytes | str | dict[bytes, bytes]  # a binary entry's fields, turned into text only for a dead letter

    @property
    def raw_text(self) -> str:
        return _binary_raw(self.raw) if isinstance(self.raw, dict) else _text(self.raw)

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


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sort key (the order Redis gave the entries)."""
    ms, seq = entry_id.split("-", 1)
    return int(ms), int(seq)


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
    if int in types:  # float32 conversion raises OverflowError on an integer past the float range
        big = next(((k, v) for k, v in obj.items() if type(v) is int and abs(v) > _FLOAT_LIMIT), None)
        if big is not None:
            return Rejected(entry_id, input_id, f"{big[0]} is out of range (an integer of {len(str(abs(big[1])))} "
                            f"digits); feature values must be finite numbers", _text(raw))
    values = [obj[c] for c in columns] if len(obj) == len(columns) else None
    return InputRow(entry_id, input_id, obj, values, raw)


# msgspec finds a struct's fields by scanning on from where it expects the next one: keys in another order than
# the model's cost it about quadratically in the number of columns (64 columns, keys reversed: ~14 µs an input,
# 2x the orjson path; 256: ~130 µs, 5x). Past this width the orjson path, whose cost does not depend on order.
MSGSPEC_MAX_COLUMNS = 64


class _OffFastPath(Exception):
    """An input the fast path does not take: parse_entry decides it."""


@lru_cache(maxsize=8)
def _row_decoder(columns: tuple[str, ...]) -> Callable[[bytes], tuple[Any, ...]] | None:
    """A decoder for the JSON input every producer sends — an object of exactly `id` (an integer, or a string
    of 1 to MAX_ID_LENGTH characters) and the columns, each a JSON number within float range — straight to the
    tuple (id, values in column order...). It raises on anything else. None (no fast path) when a column is
    named `id` or two columns share a name. Up to MSGSPEC_MAX_COLUMNS columns whose names msgspec can take,
    msgspec decodes and type-checks an input in one C pass (a struct whose fields are renamed to the columns);
    otherwise orjson decodes it into a dict and the values are picked and checked."""
    if "id" in columns or not columns or len(set(columns)) != len(columns):
        return None
    if len(columns) <= MSGSPEC_MAX_COLUMNS:
        try:
            return _msgspec_decoder(columns)
        except Exception:  # a name msgspec refuses to rename to (a quote, a backslash, a control character...)
            pass
    return _orjson_decoder(columns)


def _msgspec_decoder(columns: tuple[str, ...]) -> Callable[[bytes], tuple[Any, ...]]:
    fields = [f"c{i}" for i in range(len(columns))]
    # Strictly inside float range: an integer just past it rounds to the largest float, which parse_entry
    # refuses as an integer past range; the slow path gives the largest float itself what parse_entry gives it.
    value = Annotated[float, msgspec.Meta(gt=-_FLOAT_MAX, lt=_FLOAT_MAX)]
    row = msgspec.defstruct("Row", [("id", int | Annotated[str, msgspec.Meta(min_length=1,
                                                                              max_length=MAX_ID_LENGTH)]),
                                    *((name, value) for name in fields)],
                            forbid_unknown_fields=True, rename=dict(zip(fields, columns, strict=True)))
    decode = msgspec.json.Decoder(row).decode
    astuple = msgspec.structs.astuple
    return lambda raw: astuple(decode(raw))


def _orjson_decoder(columns: tuple[str, ...]) -> Callable[[bytes], tuple[Any, ...]]:
    n_keys = len(columns) + 1
    pick = itemgetter(*columns) if len(columns) > 1 else (lambda obj: (obj[columns[0]],))

    def decode(raw: bytes) -> tuple[Any, ...]:
        obj = orjson.loads(raw)
        if type(obj) is not dict or len(obj) != n_keys:
            raise _OffFastPath
        input_id = obj["id"]
        if not (type(input_id) is int or (type(input_id) is str and 0 < len(input_id) <= MAX_ID_LENGTH)):
            raise _OffFastPath
        values = pick(obj)  # KeyError: a column missing
        # type(): JSON true/false are bools, which are ints to Python
        if not set(map(type, values)) <= _NUMBER_TYPES:
            raise _OffFastPath
        # orjson reads an integer past 64 bits as the float nearest it: one past float range as the largest
        # float, which parse_entry refuses as an integer past range
        if _FLOAT_MAX in values or -_FLOAT_MAX in values:
            raise _OffFastPath
        return (input_id, *values)

    return decode


def parse_entries(entries: Iterable[tuple[str, dict[bytes, bytes] | None]], columns: tuple[str, ...],
                  column_set: frozenset[str] | None = None) -> list[InputRow | Rejected]:
    """`parse_entry` for a batch, in input order, with one fast pass for the inputs every producer sends:
    JSON objects of exactly `id` and the columns, each a number (`_row_decoder`), and binary entries. Every
    input off that path (a decoding error, a missing or extra key, a value of another type, a number past
    float range) goes through `parse_entry`, which names what is wrong: the outcome of each input is what
    `parse_entry` gives it, only faster. (An integer value becomes the float it equals, as `parse_entry`'s
    int does in the float32 matrix.)

    The payloads are decoded one by one, not joined into one JSON array: joined, an invalid payload could
    complete its neighbour's into valid JSON."""
    decode = _row_decoder(columns)
    out: list[InputRow | Rejected | None] = []
    slow: list[int] = []
    entries = list(entries)
    for i, (entry_id, fields) in enumerate(entries):
        out.append(None)
        raw = fields.get(DATA_FIELD) if fields else None
        if raw is None or len(fields) != 1:  # type: ignore[arg-type]
            if fields is not None and SHAPE_FIELD in fields and ID_FIELD in fields:
                out[i] = parse_binary(entry_id, fields, columns)
            else:
                slow.append(i)
            continue
        if decode is None:
            slow.append(i)
            continue
        try:
            row = decode(raw)
        except Exception:  # a decoding error, a key or type off the path, MemoryError...: parse_entry names it
            slow.append(i)
            continue
        out[i] = InputRow(entry_id, row[0], {}, row[1:], raw)
    if slow:
        column_set = column_set if column_set is not None else frozenset(columns)
        for i in slow:
            entry_id, fields = entries[i]
            out[i] = parse_entry(entry_id, fields, columns, column_set)
    return out  # type: ignore[return-value]


def parse_binary(entry_id: str, fields: dict[bytes, bytes], columns: tuple[str, ...]) -> InputRow | Rejected:
    """A binary entry (`id`, `shape`, `data` as little-endian float32) → an InputRow, or a Rejected naming
    what was wrong. Whether the values suit the model (finite, in range) is the model's validation."""
    n = len(columns)
    names = set(fields)
    if names != _BINARY_FIELDS:
        return Rejected(entry_id, None, f"a binary entry has exactly the fields id, shape and data (got "
                        f"{sorted(_text(k) for k in names)}); send XADD STREAM * id ID shape {n} data BYTES",
                        _binary_raw(fields))
    try:
        text_id = fields[ID_FIELD].decode("utf-8")
    except UnicodeDecodeError:
        return Rejected(entry_id, None, "'id' is not UTF-8 text; send ids that encode as UTF-8", _binary_raw(fields))
    if not 0 < len(text_id) <= MAX_ID_LENGTH:
        return Rejected(entry_id, None, f"'id' must be a non-empty string of at most {MAX_ID_LENGTH} "
                        f"characters (got {len(text_id)})", _binary_raw(fields))
    input_id: str | int = int(text_id) if _INT_ID.fullmatch(text_id) else text_id
    shape = fields[SHAPE_FIELD].decode("ascii", errors="replace").replace(" ", "")
    if shape not in {str(n), f"1,{n}"}:
        return Rejected(entry_id, input_id, f"shape {_short(shape)}: one input of the model's {n} columns is "
                        f"shape {n} (or 1,{n}); send one input per entry", _binary_raw(fields))
    data = fields[DATA_FIELD]
    if len(data) != 4 * n:
        return Rejected(entry_id, input_id, f"'data' holds {len(data)} bytes; shape {n} of little-endian float32 "
                        f"is {4 * n} bytes", _binary_raw(fields))
    return InputRow(entry_id, input_id, {}, np.frombuffer(data, dtype="<f4"), fields)


def _binary_raw(fields: dict[bytes, bytes]) -> str:
    """A binary entry as JSON text, for its dead letter: text fields as they came, `data` in base64."""
    out: dict[str, str] = {}
    for key, value in fields.items():
        name = _text(key)
        if key == DATA_FIELD:
            out["data_base64"] = base64.b64encode(value).decode("ascii")
        else:
            out[name] = _text(value)
    return json.dumps(out)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def prediction_payload(input_id: str | int, prediction: Prediction | np.generic, model_version: str,
                       latency_ms: float) -> bytes:
    """An output entry's `data`: `prediction` is what the served model answers for the row, as JSON keeps it:
    the class (the demo's labels 0-9 as integers; a tabular model's class values as they were: a string, a
    number, a boolean), or for regression the value in the target's units (a float, never cut to an integer)."""
    if type(prediction) is not int:  # the digits' labels are ints already: nothing to convert on their path
        prediction = prediction.item() if isinstance(prediction, np.generic) else prediction
    out = {"id": input_id, "prediction": prediction, "model_version": str(model_version),
           "latency_ms": round(float(latency_ms), 3)}
    try:
        return orjson.dumps(out)
    except TypeError:  # an integer id past 64 bits, which orjson does not write (json does)
        return json.dumps(out).encode()


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
