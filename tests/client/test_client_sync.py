"""The blocking client: what it puts on the wire, and what it makes of replies."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pd_transfer.client import (
    BadReply,
    Client,
    ClientClosed,
    Refused,
    ReplyTimeout,
    RoomState,
    RoomStatus,
)
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import WorkerShape, build_rank
from pd_transfer.layout.views import Layout
from pd_transfer.protocol import worker_api
from pd_transfer.protocol.geometry_codec import geometry_from_data
from pd_transfer.protocol.worker_api import WorkerOp

MODEL = model_from_table(
    {
        "name": "tiny",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 4, "head_dim": 8},
    },
    "<tiny>",
)


def _geometry():
    return build_rank(
        MODEL,
        WorkerShape(
            role=Role.DECODE,
            tp_size=2,
            tp_rank=1,
            page_size=4,
            kv_layout=Layout.NHD,
            num_pages=8,
            num_aux_rows=2,
        ),
    )


@pytest.fixture
def client(sidecar):
    with Client(sidecar.endpoint, "decode-tp1", timeout_s=2.0) as c:
        yield c


def test_register_sends_the_codec_geometry_handles_and_worker_id(sidecar, client):
    geometry = _geometry()
    handles = {r.id: f"/pdt-decode-tp1-{r.id}" for r in geometry.regions}
    client.register(geometry, handles)
    ((op, message),) = sidecar.requests
    assert op is WorkerOp.REGISTER
    assert geometry_from_data(message["geometry"]) == geometry
    assert message["handles"] == handles
    assert message["worker_id"] == "decode-tp1"


def test_register_refuses_handles_that_miss_a_region_before_sending(sidecar, client):
    geometry = _geometry()
    with pytest.raises(ValueError, match=r"missing \['aux'\], unknown \['extra'\]"):
        client.register(
            geometry, {**{r.id: "seg" for r in geometry.regions if r.id != "aux"}, "extra": "seg"}
        )
    assert sidecar.requests == []


def test_send_carries_pages_state_aux_and_last_flag(sidecar, client):
    client.send(7, np.array([5, 3, 9]), last_chunk=False)
    client.send(7, [1], state_slots=(2,), aux_row=0, swa_pages=range(3))
    first, second = (m for _, m in sidecar.requests)
    assert (first["room"], first["pages"], first["last"], first["aux_row"]) == (7, [5, 3, 9], False, None)
    assert (
        second["pages"],
        second["state_slots"],
        second["aux_row"],
        second["swa_pages"],
        second["last"],
    ) == ([1], [2], 0, [0, 1, 2], True)


def test_expect_carries_the_bootstrap_address_and_destination(sidecar, client):
    client.expect(9, "tcp://127.0.0.1:7000", [4, 2], state_slots=[1], aux_row=3, swa_pages=[6])
    ((op, message),) = sidecar.requests
    assert op is WorkerOp.EXPECT
    assert (
        message["room"],
        message["bootstrap"],
        message["pages"],
        message["state_slots"],
        message["aux_row"],
        message["swa_pages"],
    ) == (9, "tcp://127.0.0.1:7000", [4, 2], [1], 3, [6])


def test_layer_ready_names_room_and_layer(sidecar, client):
    client.layer_ready(3, 17)
    assert sidecar.requests[0][1]["layer_id"] == 17


def test_send_marks_a_streamed_chunk_and_defaults_to_not_streamed(sidecar, client):
    client.send(4, [1], stream=True)
    client.send(5, [2])
    assert [message["stream"] for _, message in sidecar.requests] == [True, False]


def test_a_stream_flag_that_is_not_a_bool_is_refused_naming_the_field():
    request = {"op": "send", "id": 1, "room": 2, "last": True, "stream": 1}
    with pytest.raises(worker_api.WorkerApiError, match=r"\$\.stream: expected bool"):
        worker_api.decode_request(worker_api.encode(request))


def test_negative_page_is_refused_before_sending(sidecar, client):
    with pytest.raises(ValueError, match="pages: index -1 is negative"):
        client.send(1, [0, -1])
    with pytest.raises(TypeError, match="pages: expected integer indices"):
        client.send(1, [0.5])
    assert sidecar.requests == []


@pytest.mark.parametrize(
    "pages",
    [[0, 2**63], np.array([2**63], np.uint64), list(range(100)) + [2**63]],
    ids=["short list", "uint64 array", "long list"],
)
def test_a_page_beyond_int64_is_refused_not_wrapped(sidecar, client, pages):
    # numpy once turned uint64 2**63 into int64 -2**63 on the way to the wire
    with pytest.raises(ValueError, match=r"pages: index 9223372036854775808 is beyond any pool"):
        client.send(1, pages)
    assert sidecar.requests == []


def test_the_client_refuses_an_index_past_the_sidecars_cap_and_sends_the_cap(sidecar, client):
    with pytest.raises(ValueError, match=rf"index {2**62} is beyond any pool \(at most {2**62 - 1}\)"):
        client.send(1, np.array([0, 2**62], np.int64))
    with pytest.raises(
        ValueError, match=rf"aux_row: expected an int in \[0, {2**62 - 1}\] or None, got {2**62}"
    ):
        client.send(1, [0], aux_row=2**62)
    assert sidecar.requests == []
    client.send(1, [2**62 - 1])
    ((_, message),) = sidecar.requests
    assert message["pages"] == [2**62 - 1]


@pytest.mark.parametrize(
    "pages", [[3, 1], (3, 1), range(3, 0, -2), np.array([3, 1]), [np.int64(3), 1], list(range(200))[3:0:-2]]
)
def test_pages_of_any_integer_kind_reach_the_sidecar_as_plain_ints(sidecar, client, pages):
    client.send(1, pages)
    ((_, message),) = sidecar.requests
    assert message["pages"] == [3, 1] and all(type(p) is int for p in message["pages"])


@pytest.mark.parametrize("pages", [[True], [1, 2.0], [None]])
def test_pages_that_are_not_integers_are_refused(sidecar, client, pages):
    with pytest.raises(TypeError, match="pages: expected integer indices"):
        client.send(1, pages)
    assert sidecar.requests == []


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -0.5, 1e9])
def test_a_wait_timeout_that_is_no_duration_is_refused_before_sending(sidecar, client, timeout_s):
    with pytest.raises(ValueError, match=r"timeout_s: expected seconds in \[0, 86400\]"):
        client.wait(1, timeout_s)
    assert sidecar.requests == []


def test_poll_returns_the_status_and_a_failure_reason(sidecar, client):
    sidecar.script = lambda op, m: {
        "ok": True,
        "status": "failed",
        "code": "peer_lost",
        "reason": "prefill peer prefill[pp0,tp1] lost",
    }
    state = client.poll(4)
    assert state == RoomState(
        RoomStatus.FAILED, Reason.PEER_LOST, "prefill peer prefill[pp0,tp1] lost", "peer_lost"
    )
    assert state.is_terminal and state.failed


def test_poll_keeps_a_failure_code_this_version_does_not_know(sidecar, client):
    sidecar.script = lambda op, m: {"ok": True, "status": "failed", "code": "brand_new", "reason": "x"}
    state = client.poll(4)
    assert (state.code, state.code_text, state.describe()) == (None, "brand_new", "failed [brand_new]: x")


def test_unknown_status_is_a_bad_reply(sidecar, client):
    sidecar.script = lambda op, m: {"ok": True, "status": "sleeping"}
    with pytest.raises(BadReply, match="at \\$.status: unknown status 'sleeping'"):
        client.poll(1)


def test_refusal_raises_with_the_sidecars_code_and_reason(sidecar, client):
    sidecar.script = lambda op, m: {
        "ok": False,
        "code": "duplicate_room",
        "reason": "room 5 is already expected",
    }
    with pytest.raises(Refused) as caught:
        client.expect(5, "tcp://127.0.0.1:1", [0])
    assert caught.value.code is Reason.DUPLICATE_ROOM
    assert caught.value.reason == "room 5 is already expected"
    assert str(caught.value) == "expect refused by the sidecar [duplicate_room]: room 5 is already expected"


def test_wait_passes_its_timeout_and_outlasts_the_reply_timeout(sidecar):
    sidecar.delays[WorkerOp.WAIT] = 0.4
    with Client(sidecar.endpoint, "w", timeout_s=0.2) as client:
        state = client.wait(3, timeout_s=0.5)
    assert state.succeeded
    assert sidecar.requests[0][1]["timeout_s"] == 0.5


def test_abort_returns_drained(sidecar, client):
    sidecar.script = lambda op, m: {"ok": True, "drained": False}
    assert client.abort(2) is False


def test_no_reply_times_out_without_spinning(sidecar):
    sidecar.script = lambda op, m: None
    with Client(sidecar.endpoint, "w", timeout_s=0.5) as client:
        cpu_before, wall_before = time.thread_time(), time.monotonic()
        with pytest.raises(ReplyTimeout, match=r"poll: no reply from the sidecar at ipc://.* within 0.5 s"):
            client.poll(1)
        cpu_s, wall_s = time.thread_time() - cpu_before, time.monotonic() - wall_before
    assert wall_s >= 0.5
    assert cpu_s < 0.05, f"the client burnt {cpu_s:.3f} s of CPU waiting {wall_s:.3f} s"


def test_a_late_reply_is_not_taken_for_the_next_calls(sidecar):
    sidecar.delays[WorkerOp.POLL] = 0.5
    with Client(sidecar.endpoint, "w", timeout_s=0.2) as client:
        with pytest.raises(ReplyTimeout):
            client.poll(1)
        time.sleep(0.4)  # the poll reply ("success") is now queued at the client
        sidecar.script = lambda op, m: {"ok": True, "drained": False}
        assert client.abort(1) is False


def test_replies_without_an_id_are_ignored(sidecar, client):
    sidecar.raw_replies = [b"\xc1", worker_api.encode({"ok": True})]
    assert client.abort(1) is True


def test_calls_on_a_closed_client_raise(sidecar):
    client = Client(sidecar.endpoint, "w")
    client.close()
    client.close()
    with pytest.raises(ClientClosed, match="poll: the client is closed"):
        client.poll(1)


def test_a_reply_without_ok_is_a_bad_reply(sidecar, client):
    sidecar.script = lambda op, m: {"status": "success"}
    with pytest.raises(BadReply, match="poll: malformed reply from the sidecar: at \\$.ok: expected bool"):
        client.poll(1)


def test_a_refusal_without_reason_is_a_bad_reply(sidecar, client):
    sidecar.script = lambda op, m: {"ok": False}
    with pytest.raises(BadReply, match="must carry string 'code' and 'reason'"):
        client.abort(1)


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_call_to_a_socket_that_does_not_exist_says_the_socket_is_missing(tmp_path, scheme):
    path = tmp_path / "no-sidecar.sock"
    with Client(f"{scheme}://{path}", "w", timeout_s=0.3) as client:
        with pytest.raises(ReplyTimeout) as err:
            client.poll(1)
    assert f"no socket exists at {path}" in str(err.value)
    assert "worker_endpoint" in err.value.hint
