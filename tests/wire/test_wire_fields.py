"""The field layer: each kind checks type, range and size, and names the field path."""

import enum
from dataclasses import dataclass

import pytest

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.wire.fields import (
    Bool,
    EnumOf,
    Field,
    Float,
    Int,
    ListOf,
    Optional,
    ReasonCode,
    Record,
    Str,
    TupleOf,
    clip_text,
    read_field,
)
from pd_transfer.wire.packed import Blob, Bytes


@dataclass(frozen=True)
class Region:
    id: str
    nbytes: int

    def __post_init__(self):
        if self.id == "taken":
            raise PdTransferError("region id is reserved", code=Reason.REGION_INVALID)


@dataclass(frozen=True)
class Plan:
    name: str
    regions: tuple
    note: str = ""


class Color(enum.Enum):
    RED = "red"


REGION = Record(Region, (Field("id", Str(max_len=8, min_len=1)), Field("nbytes", Int(lo=1, hi=1000))))
PLAN = Record(
    Plan,
    (Field("name", Str(max_len=4)), Field("regions", ListOf(REGION, 3)), Field("note", Str(), default="")),
)


def _refused(kind, raw, path="$.x") -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        kind.decode(raw, path)
    return caught.value


def test_a_nested_record_error_names_the_full_path_msgspec_style():
    raw = {
        "name": "p",
        "regions": [{"id": "a", "nbytes": 1}, {"id": "b", "nbytes": 2}, {"id": "c", "nbytes": "9"}],
    }
    error = _refused(PLAN, raw, "$")
    assert error.path == "$.regions[2].nbytes"
    assert str(error) == "at $.regions[2].nbytes: expected int, got str"
    assert error.code is Reason.BAD_FIELD


def test_a_record_decodes_into_its_class_with_defaults_and_ignores_unknown_keys():
    raw = {"name": "p", "regions": [{"id": "a", "nbytes": 5, "later": 1}], "newer": True}
    assert PLAN.decode(raw, "$") == Plan("p", (Region("a", 5),), "")
    assert PLAN.decode(PLAN.encode(Plan("q", (Region("b", 7),), "n")), "$") == Plan(
        "q", (Region("b", 7),), "n"
    )


def test_a_missing_field_is_named():
    assert str(_refused(PLAN, {"regions": []}, "$")) == "at $.name: missing required field"
    assert read_field({}, Field("note", Str(), default="-"), "$") == "-"


def test_an_error_raised_by_the_class_lands_at_the_record_path_with_its_code():
    error = _refused(PLAN, {"name": "p", "regions": [{"id": "taken", "nbytes": 1}]}, "$")
    assert error.path == "$.regions[0]" and error.code is Reason.REGION_INVALID


def test_int_bounds_are_inclusive_and_bool_is_not_an_int():
    kind = Int(lo=-1, hi=10)
    assert kind.decode(-1, "$.x") == -1 and kind.decode(10, "$.x") == 10
    assert str(_refused(kind, 11)) == "at $.x: expected int in [-1, 10], got 11"
    assert str(_refused(kind, -2)) == "at $.x: expected int in [-1, 10], got -2"
    assert str(_refused(kind, True)) == "at $.x: expected int, got bool"
    assert str(_refused(kind, 1.0)) == "at $.x: expected int, got float"


def test_str_length_cap_is_exact():
    kind = Str(max_len=5, min_len=1)
    assert kind.decode("abcde", "$.x") == "abcde"
    assert str(_refused(kind, "abcdef")) == "at $.x: expected str of 1 to 5 characters, got 6"
    assert str(_refused(kind, "")) == "at $.x: expected str of 1 to 5 characters, got 0"
    assert str(_refused(kind, b"abc")) == "at $.x: expected str, got bytes"


def test_list_count_cap_is_exact_and_limit_exceeded():
    kind = ListOf(Int(), 3)
    assert kind.decode([1, 2, 3], "$.x") == (1, 2, 3)
    error = _refused(kind, [1, 2, 3, 4])
    assert str(error) == "at $.x: expected at most 3 items, got 4" and error.code is Reason.LIMIT_EXCEEDED
    assert _refused(kind, [1, "2"]).path == "$.x[1]"


def test_bytes_cap_and_row_size():
    kind = Bytes(max_len=48, multiple_of=24)
    assert kind.decode(bytes(48), "$.x") == bytes(48)
    error = _refused(kind, bytes(72))
    assert str(error) == "at $.x: expected at most 48 bytes, got 72" and error.code is Reason.LIMIT_EXCEEDED
    assert str(_refused(kind, bytes(23))) == "at $.x: expected a multiple of 24 bytes, got 23"
    assert str(_refused(kind, "abc")) == "at $.x: expected bytes, got str"


def test_blob_is_exactly_its_size():
    assert Blob(4).decode(b"abcd", "$.x") == b"abcd"
    assert str(_refused(Blob(4), b"abc")) == "at $.x: expected 4 bytes, got 3"
    assert str(_refused(Blob(4), 4)) == "at $.x: expected 4 bytes, got int"


def test_enum_reason_optional_bool_float_tuple():
    assert EnumOf(Color).decode("red", "$.x") is Color.RED
    assert str(_refused(EnumOf(Color), "blue")) == "at $.x: expected one of 'red', got 'blue'"
    assert ReasonCode().decode("aborted", "$.x") is Reason.ABORTED
    assert ReasonCode().decode("from_the_future", "$.x") is Reason.UNRECOGNIZED_REASON
    assert _refused(ReasonCode(), "x" * 65).path == "$.x"
    assert Optional(Int()).decode(None, "$.x") is None
    assert str(_refused(Bool(), 1)) == "at $.x: expected bool, got int"
    assert str(_refused(Float(), float("nan"))) == "at $.x: expected a finite float >= 0.0, got nan"
    assert str(_refused(TupleOf((Int(), Str())), [1])) == "at $.x: expected [int, str], got list of 1"


def test_clip_text_keeps_the_limit_and_says_how_much_was_cut():
    assert clip_text("abc", 3) == "abc"
    clipped = clip_text("x" * 5000, 100)
    assert len(clipped) <= 100 and clipped.startswith("x" * 60) and "more characters" in clipped


def test_a_long_int_list_is_checked_in_one_pass_and_a_bad_item_still_named():
    kind = ListOf(Int(hi=10), 100_000)
    assert kind.decode(list(range(11)) * 9000, "$.pages") == tuple(range(11)) * 9000
    assert (
        str(_refused(kind, [1] * 500 + [11], "$.pages")) == "at $.pages[500]: expected int in [0, 10], got 11"
    )
    assert str(_refused(kind, [1, True], "$.pages")) == "at $.pages[1]: expected int, got bool"
