"""The stream contract: what an input entry must be, and what goes out for it."""

from __future__ import annotations

import json

import pytest

from nightshift.stream.records import (
    InputRow,
    Rejected,
    dead_letter_payload,
    entry_ms,
    marker_key,
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
