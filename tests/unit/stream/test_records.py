"""The stream contract: what an input entry must be, and what goes out for it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from nightshift.stream.records import (
    InputRow,
    Rejected,
    dead_letter_payload,
    entry_ms,
    marker_key,
    parse_entries,
    parse_entry,
    prediction_payload,
)

COLUMNS = ("a", "b", "c")


def _entry(obj: object) -> dict[bytes, bytes]:
    return {b"data": json.dumps(obj).encode()}


def test_a_good_input_keeps_its_id_and_values_in_column_order() -> None:
    row = parse_entry("5-0", _entry({"c": 3, "id": "x1", "a": 1.5, "b": 2}), COLUMNS)
    assert isinstance(row, InputRow)
    assert (row.input_id, row.values, row.complete) == ("x1", [1.5, 2, 3], True)


def test_missing_columns_pass_incomplete_so_the_models_validation_names_them() -> None:
    row = parse_entry("5-0", _entry({"id": 7, "a": 1}), COLUMNS)
    assert isinstance(row, InputRow)
    assert row.input_id == 7 and not row.complete and row.features == {"a": 1}


@pytest.mark.parametrize(("fields", "reason", "input_id"), [
    ({b"data": b"{not json"}, "'data' is not JSON", None),
    ({b"data": b"[1, 2]"}, "must be a JSON object", None),
    ({b"payload": b"{}"}, "no 'data' field (fields: ['payload'])", None),
    ({}, "no fields", None),
    (_entry({"a": 1, "b": 2, "c": 3}), "no 'id'", None),
    (_entry({"id": 1.5, "a": 1, "b": 2, "c": 3}), "'id' must be a string or an integer, got float", None),
    (_entry({"id": True, "a": 1, "b": 2, "c": 3}), "'id' must be a string or an integer, got bool", None),
    (_entry({"id": "", "a": 1, "b": 2, "c": 3}), "non-empty string", None),
    (_entry({"id": "k", "a": 1, "b": 2, "c": 3, "zz": 0}), "extra columns ['zz']", "k"),
    (_entry({"id": "k", "a": "1", "b": 2, "c": 3}), "wrong type: a is a JSON string ('1')", "k"),
    (_entry({"id": "k", "a": None, "b": 2, "c": 3}), "wrong type: a is a JSON null", "k"),
    (_entry({"id": "k", "a": True, "b": 2, "c": 3}), "wrong type: a is a JSON boolean", "k"),
    (_entry({"id": "k", "a": [1], "b": 2, "c": 3}), "wrong type: a is a JSON array", "k"),
])
def test_contract_breaches_are_rejected_with_a_reason(fields: dict[bytes, bytes], reason: str,
                                                      input_id: object) -> None:
    rejected = parse_entry("9-1", fields, COLUMNS)
    assert isinstance(rejected, Rejected)
    assert reason in rejected.reason
    assert rejected.input_id == input_id
    assert rejected.entry_id == "9-1"


def test_nan_is_left_to_the_models_validation() -> None:
    # Python's json reads NaN; "must be finite" is the served model's check, not a second copy here.
    row = parse_entry("1-0", {b"data": b'{"id": 1, "a": NaN, "b": 1, "c": Infinity}'}, COLUMNS)
    assert isinstance(row, InputRow) and row.complete


def test_a_dead_letter_carries_the_original_payload_byte_for_byte() -> None:
    raw = b'{"id": "q",  "a": "x", "b": 1, "c": 2}'
    rejected = parse_entry("1-0", {b"data": raw}, COLUMNS)
    assert isinstance(rejected, Rejected)
    out = json.loads(dead_letter_payload(rejected))
    assert out["data"] == raw.decode() and out["id"] == "q" and "wrong type" in out["reason"]
    no_id = json.loads(dead_letter_payload(Rejected("1-0", None, "r", "\\xff")))
    assert "id" not in no_id


def test_invalid_utf8_is_kept_escaped_not_lost() -> None:
    rejected = parse_entry("1-0", {b"data": b"\xff\xfe"}, COLUMNS)
    assert isinstance(rejected, Rejected)
    assert rejected.raw == "\\xff\\xfe"


def test_prediction_payload_and_entry_time() -> None:
    out = json.loads(prediction_payload("x", 3, "7", 12.34567))
    assert out == {"id": "x", "prediction": 3, "model_version": "7", "latency_ms": 12.346}
    assert entry_ms("1700000000123-4") == 1700000000123


@pytest.mark.parametrize(("answer", "written"), [
    (np.int64(3), 3),  # a class index the model gave as numpy
    ("malignant", "malignant"),  # a tabular model's class values as they were: before, int() raised
    (2.5, 2.5),  # a float class value
    (True, True),
    (151.734375, 151.734375),  # a regression's value: before, cut to 151
    (np.float64(-0.25), -0.25),
])
def test_the_prediction_is_written_as_the_model_answered_it(answer: Any, written: Any) -> None:
    out = json.loads(prediction_payload(7, answer, "2", 1.0))
    assert out["prediction"] == written and type(out["prediction"]) is type(written)


def test_string_and_integer_ids_are_different_inputs() -> None:
    assert marker_key("7") != marker_key(7)


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"id": 1, "a": ' + b"9" * 5000 + b', "b": 1, "c": 2}', "Exceeds the limit"),  # int-string limit
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError in the decoder
    (b'{"id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_inputs_that_break_the_json_decoder_are_rejected_not_raised(raw: bytes, reason: str) -> None:
    """Issue 21 item 1: a ValueError or RecursionError from json.loads escaped and killed every consumer."""
    rejected = parse_entry("3-0", {b"data": raw}, COLUMNS)
    assert isinstance(rejected, Rejected)
    assert reason in rejected.reason and rejected.entry_id == "3-0"
    assert len(rejected.reason) < 400


def test_a_huge_integer_below_the_decoder_limit_is_a_wrong_value_not_a_crash() -> None:
    rejected = parse_entry("3-0", {b"data": b'{"id": "k", "a": ' + b"9" * 4000 + b', "b": 1, "c": 2}'}, COLUMNS)
    assert isinstance(rejected, Rejected)
    assert "a is out of range" in rejected.reason and rejected.input_id == "k"


def test_a_float_past_range_next_to_an_integer_is_passed_on_as_infinite_not_called_an_integer() -> None:
    """1e400 is a float (json reads it as inf, for the served model's finiteness check to name); with an
    integer in the same row it was called "an integer of 3 digits" (the digits of "inf")."""
    row = parse_entry("3-0", {b"data": b'{"id": 1, "a": -1e400, "b": 1, "c": 2}'}, COLUMNS)
    assert isinstance(row, InputRow) and row.values == [float("-inf"), 1, 2]


# --- issue 21 item 6: the batch parser is parse_entry, faster -------------------------------------------

_ODD_PAYLOADS = [
    b'{"id": 1, "a": 1.5, "b": 2.0, "c": 3.0}', b'{"id": "x", "a": 1, "b": 2, "c": 3}',
    b'{"c": 3.0, "b": 2.0, "a": 1.0, "id": 9}', b'{"id": 1, "a": NaN, "b": 1.0, "c": Infinity}',
    b'{"id": 1, "a": 1e400, "b": 1.0, "c": 1.0}', b'{"id": 1, "a": -1e400, "b": 1, "c": 2}',
    # just past float range as an integer (rounds to the largest float), and the largest float itself
    b'{"id": 1, "a": ' + str(2**1024 - 2**971 + 1).encode() + b', "b": 1, "c": 2}',
    b'{"id": 1, "a": -1.7976931348623157e308, "b": 1, "c": 2}',
    b'{"id": 1, "a": ' + b"9" * 400 + b', "b": 1, "c": 2}',
    b'{"id": 1, "a": ' + b"9" * 30 + b', "b": 1, "c": 2}', b'{"id": ' + b"9" * 30 + b', "a": 1, "b": 1, "c": 2}',
    b'{"id": "\\ud800", "a": 1, "b": 1, "c": 2}', b'{"id": true, "a": 1, "b": 1, "c": 2}',
    b'{"id": "", "a": 1, "b": 1, "c": 2}', b'{"id": "' + b"k" * 513 + b'", "a": 1, "b": 1, "c": 2}',
    b'{"id": 1, "a": true, "b": 1, "c": 2}', b'{"id": 1, "a": "1", "b": 1, "c": 2}',
    b'{"id": 1, "a": null, "b": 1, "c": 2}', b'{"id": 1, "a": 1, "b": 1}', b'{"id": 1, "a": 1, "b": 1, "c": 2, "d": 0}',
    b'{"a": 1, "b": 1, "c": 2}', b"[1, 2, 3]", b"{not json", b"\xff\xfe", b"[" * 5000 + b"]" * 5000,
    b'{"id": 1, "a": 1, "b": 1, "c": 2, "a": "dup"}', b'{"id": 2.0, "a": 1, "b": 1, "c": 2}', b"",
]


def _outcome(item: InputRow | Rejected) -> tuple[object, ...]:
    if isinstance(item, Rejected):
        return ("rejected", item.entry_id, item.input_id, item.reason, item.raw)
    values = None if item.values is None else [float(v) for v in item.values]
    return ("row", item.entry_id, item.input_id, type(item.input_id), values, item.raw_text)


def test_the_batch_parser_gives_every_input_the_outcome_parse_entry_gives_it() -> None:
    """Mixed in batches, in every order and next to good rows, each odd payload gets what parse_entry gives
    it alone (the fast path only takes inputs it can prove good), and the batch keeps its order."""
    import random

    entries = [(f"{i}-0", {b"data": raw}) for i, raw in enumerate(_ODD_PAYLOADS)]
    entries += [(f"{100 + i}-0", fields) for i, fields in
                enumerate([{}, {b"payload": b"{}"}, {b"data": b"{}", b"extra": b"1"}])]
    expected = {entry_id: _outcome(parse_entry(entry_id, fields, COLUMNS)) for entry_id, fields in entries}
    rng = random.Random(7)
    for _ in range(20):
        batch = rng.sample(entries, rng.randint(1, len(entries)))
        got = parse_entries(batch, COLUMNS)
        assert [item.entry_id for item in got] == [entry_id for entry_id, _ in batch]
        for item in got:
            assert _outcome(item) == expected[item.entry_id], item.entry_id


def _payloads_for(columns: tuple[str, ...]) -> list[bytes]:
    """Good and odd inputs for a model with these columns (in model, reversed and sorted key order)."""
    def dump(pairs: list[tuple[str, object]]) -> bytes:
        return ("{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in pairs) + "}").encode(
            "utf-8", "surrogatepass")

    good = [(c, f"{i}.5") for i, c in enumerate(columns)]
    return [dump([("id", "7"), *good]), dump([("id", '"k"'), *good[::-1]]), dump([("id", "8"), *sorted(good)]),
            dump([("id", "9"), *[(c, str(i)) for i, c in enumerate(columns)]]), dump([("id", "1"), *good[1:]]),
            dump([("id", "1"), *good, ("zz extra", "1")]), dump([("id", "1"), *good[:-1], (columns[-1], "true")]),
            dump([("id", "1"), *good[:-1], (columns[-1], str(2**1024 - 2**971 + 1))]),
            dump([("id", "1"), *good, (columns[0], '"dup"')]), dump([("id", "1.0"), *good]), dump(good)]


@pytest.mark.parametrize("columns", [
    tuple(f"pixel_{i}" for i in range(64)),  # msgspec's path
    tuple(f"x_{i}" for i in range(65)),  # past MSGSPEC_MAX_COLUMNS: orjson's path
    ('a"b', "c\\d", "tab\tin", "ok"),  # names msgspec cannot rename to
    ("a", "b", "a"),  # a repeated column: no fast path
    ("\u00e9t\u00e9", "\u65e5"),  # non-ASCII
    ("lone \ud800", "b"),
])
def test_any_model_columns_give_every_input_the_outcome_parse_entry_gives_it(columns: tuple[str, ...]) -> None:
    """Hostile review of the msgspec path: a column name with a quote, a backslash or a control character, or a
    repeated one, made parse_entries raise on every batch (the consumer stopped); keys out of the model's
    order must not change an outcome."""
    entries = [(f"{i}-0", {b"data": raw}) for i, raw in enumerate(_payloads_for(columns))]
    got = parse_entries(entries, columns)
    assert [_outcome(item) for item in got] == [_outcome(parse_entry(e, f, columns)) for e, f in entries]
    plain = len(set(columns)) == len(columns) and all(c.isprintable() and c.isascii() for c in columns)
    assert sum(isinstance(item, InputRow) and item.complete for item in got) >= (4 if plain else 0)


def _binary(input_id: bytes, values: list[float], shape: bytes = b"3", **extra: bytes) -> dict[bytes, bytes]:
    import numpy as np

    return {b"id": input_id, b"shape": shape, b"data": np.asarray(values, dtype="<f4").tobytes(),
            **{k.encode(): v for k, v in extra.items()}}


def test_a_binary_entry_is_an_input_in_the_models_column_order() -> None:
    (row, text_id, long_int) = parse_entries([("1-0", _binary(b"42", [1.5, 2, 3])),
                                              ("2-0", _binary(b"x-7", [0, 0, 1], shape=b"1,3")),
                                              ("3-0", _binary(b"12345678901234567890", [0, 0, 0]))], COLUMNS)
    assert isinstance(row, InputRow) and row.complete and row.input_id == 42
    assert [float(v) for v in row.values] == [1.5, 2.0, 3.0]  # type: ignore[union-attr]
    assert marker_key(row.input_id) == marker_key(42)  # the same input as JSON's {"id": 42, ...}
    assert isinstance(text_id, InputRow) and text_id.input_id == "x-7"
    assert isinstance(long_int, InputRow) and long_int.input_id == 12345678901234567890


@pytest.mark.parametrize(("fields", "reason"), [
    (_binary(b"1", [1, 2]), "holds 8 bytes; shape 3 of little-endian float32 is 12 bytes"),
    (_binary(b"1", [1, 2, 3], shape=b"2,3"), "shape '2,3'"),
    (_binary(b"1", [1, 2, 3], shape=b"\xff"), "shape"),
    (_binary(b"1", [1, 2, 3], label=b"4"), "exactly the fields id, shape and data"),
    (_binary(b"", [1, 2, 3]), "'id' must be a non-empty string"),
    (_binary("é".encode() * 513, [1, 2, 3]), "at most 512 characters (got 513)"),
    (_binary(b"\xff\xfe", [1, 2, 3]), "'id' is not UTF-8"),
])
def test_a_bad_binary_entry_is_rejected_with_its_bytes_kept(fields: dict[bytes, bytes], reason: str) -> None:
    (rejected,) = parse_entries([("5-0", fields)], COLUMNS)
    assert isinstance(rejected, Rejected) and reason in rejected.reason
    kept = json.loads(dead_letter_payload(rejected))["data"]
    assert "data_base64" in json.loads(kept)


def test_binary_and_json_ids_name_the_same_input_at_any_length() -> None:
    """A decimal binary id is JSON's integer id, also past 64 bits (a 19-digit id was a string, so the same
    input sent both ways was scored twice); ids are limited in characters, as JSON's are."""
    for digits in ("1000000000000000000", "18446744073709551616", "-0"):
        (row,) = parse_entries([("1-0", _binary(digits.encode(), [0, 0, 0]))], COLUMNS)
        (twin,) = parse_entries([("2-0", {b"data": f'{{"id": {digits}, "a": 0, "b": 0, "c": 0}}'.encode()})], COLUMNS)
        assert isinstance(row, InputRow) and isinstance(twin, InputRow)
        assert row.input_id == twin.input_id and marker_key(row.input_id) == marker_key(twin.input_id)
    (accented,) = parse_entries([("3-0", _binary("é".encode() * 300, [0, 0, 0]))], COLUMNS)
    assert isinstance(accented, InputRow) and accented.input_id == "é" * 300


def test_a_json_entry_with_a_shape_field_is_still_json() -> None:
    """Only an entry with `id` and `shape` fields is binary: extra fields beside a JSON `data` were ignored
    before binary entries existed, and still are."""
    (row,) = parse_entries([("1-0", {b"data": b'{"id": 5, "a": 1, "b": 2, "c": 3}', b"shape": b"3"})], COLUMNS)
    assert isinstance(row, InputRow) and row.input_id == 5 and row.complete


def test_an_integer_id_past_64_bits_gets_its_prediction_written() -> None:
    """orjson writes no integer past 64 bits: the prediction of such an id (accepted, as before) raised
    TypeError in the write, which killed the consumer on that batch until --max-deliveries."""
    (row,) = parse_entries([("1-0", {b"data": b'{"id": 18446744073709551616, "a": 1, "b": 2, "c": 3}'})], COLUMNS)
    assert isinstance(row, InputRow)
    assert json.loads(prediction_payload(row.input_id, 1, "3", 1.0))["id"] == 2**64
