"""Worker API requests are read with the wire field kinds: each refusal names its field."""

import pytest

from pd_transfer.errors import Reason
from pd_transfer.protocol.worker_api import MAX_INSTANCE_LEN, WorkerApiError, WorkerOp, decode_request, encode


def _refused(**request) -> WorkerApiError:
    with pytest.raises(WorkerApiError) as caught:
        decode_request(encode({"op": "send", "id": 3, "room": 1, "last": True} | request))
    assert caught.value.request_id == 3
    return caught.value


def test_a_send_gets_its_defaults_and_keeps_its_lists():
    pages = list(range(1000))
    op, request = decode_request(encode({"op": "send", "id": 1, "room": 5, "last": False, "pages": pages}))
    assert op is WorkerOp.SEND and request["pages"] == pages and isinstance(request["pages"], list)
    assert (request["swa_pages"], request["pp_size"], request["stream"], request["decode"]) == (
        [],
        1,
        False,
        "",
    )
    assert request["aux_row"] is None


@pytest.mark.parametrize(
    "field, value, text",
    [
        ("room", -1, "at $.room: expected int in [0, 18446744073709551615], got -1"),
        ("last", 1, "at $.last: expected bool, got int"),
        (
            "pages",
            [0, 2**62],
            "at $.pages[1]: expected int in [0, 4611686018427387903], got 4611686018427387904",
        ),
        ("pp_size", 0, "at $.pp_size: expected int in [1, 1024], got 0"),
        ("stream", "yes", "at $.stream: expected bool, got str"),
        (
            "decode",
            "d" * (MAX_INSTANCE_LEN + 1),
            f"at $.decode: expected str of 0 to {MAX_INSTANCE_LEN} characters",
        ),
        ("aux_row", -1, "at $.aux_row: expected int in [0, 4611686018427387903], got -1"),
    ],
)
def test_each_bad_field_is_named(field, value, text):
    error = _refused(**{field: value})
    assert str(error).startswith(text) and error.code is Reason.BAD_FIELD


def test_a_wait_past_a_day_is_refused():
    with pytest.raises(WorkerApiError, match=r"at \$\.timeout_s: expected seconds in \[0, 86400\]"):
        decode_request(encode({"op": "wait", "id": 1, "room": 1, "timeout_s": 86401}))
