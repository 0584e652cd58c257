"""Wrong field types and values are rejected with the field's path (msgspec-style)."""

import msgpack
import pytest
from protocol_samples import REJECTED, abort, failed_done, hello, progress, register, transfer_request

from pd_transfer.errors import ProtocolError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import decode, encode


def _reject(message, mutate) -> ProtocolError:
    raw = msgpack.unpackb(encode(message))
    mutate(raw)
    with pytest.raises(ProtocolError) as caught:
        decode(msgpack.packb(raw, use_bin_type=True))
    return caught.value


def _set(path, value):
    """A mutation that sets raw[path[0]][path[1]]... to ``value``."""

    def mutate(raw):
        for key in path[:-1]:
            raw = raw[key]
        raw[path[-1]] = value

    return mutate


def _delete(*path):
    def mutate(raw):
        for key in path[:-1]:
            raw = raw[key]
        del raw[path[-1]]

    return mutate


REGISTER = register(Role.PREFILL)

CASES = [
    (
        REGISTER,
        _set(["geometry", "views", 2, "strides_nbytes"], "8192,512"),
        "at $.register.geometry.views[2].strides_nbytes: expected list of int, got str",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 2, "strides_nbytes", 1], 1.5),
        "at $.register.geometry.views[2].strides_nbytes[1]: expected int, got float",
    ),
    (REGISTER, _set(["geometry", "tp_size"], True), "at $.register.geometry.tp_size: expected int, got bool"),
    (
        REGISTER,
        _set(["geometry", "tp_size"], 0),
        "at $.register.geometry.tp_size: expected int in [1, 4096], got 0",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 0, "layout"], "diagonal"),
        "at $.register.geometry.views[0].layout: expected one of 'nhd', 'hnd', 'layer_first', "
        "'page_first', 'page_first_direct', 'page_head', 'slot', 'row', got 'diagonal'",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 0, "axes", 1, "role"], 3),
        "at $.register.geometry.views[0].axes[1].role: expected AxisRole str, got int",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 0, "dtype"], "bfloat17"),
        "at $.register.geometry.views[0].dtype: expected one of bfloat16, float16, float32, "
        "float64, float8_e4m3fn, float8_e5m2, int16, int32, int64, int8, uint8, got 'bfloat17'",
    ),
    (
        REGISTER,
        _set(["geometry", "regions", 0, "nbytes"], 2**49),
        "at $.register.geometry.regions[0].nbytes: expected int in [1, 281474976710656], got 562949953421312",
    ),
    (
        REGISTER,
        _delete("geometry", "views", 1, "region"),
        "at $.register.geometry.views[1].region: missing required field",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 0, "shard", "ranges"], [[0, 8], [0, 8]]),
        "at $.register.geometry.views[0].shard.ranges: expected one range per group (1), got 2",
    ),
    (
        REGISTER,
        _set(["geometry", "views", 0, "shard", "ranges", 0], [0, 8, 9]),
        "at $.register.geometry.views[0].shard.ranges[0]: expected [int, int], got list of 3",
    ),
    (REGISTER, _set(["geometry"], None), "at $.register.geometry: expected map, got nil"),
    (
        hello(Role.DECODE),
        _set(["role"], "router"),
        "at $.hello.role: expected one of 'prefill', 'decode', got 'router'",
    ),
    (
        hello(Role.DECODE),
        _set(["agent_id"], ""),
        "at $.hello.agent_id: expected str of 1 to 256 characters, got 0",
    ),
    (
        hello(Role.DECODE),
        _set(["capabilities", "transports"], ["shm", 7]),
        "at $.hello.capabilities.transports[1]: expected str, got int",
    ),
    (
        transfer_request(),
        _set(["room"], -1),
        "at $.transfer_request.room: expected int in [0, 18446744073709551615], got -1",
    ),
    (transfer_request(), _set(["room"], "7"), "at $.transfer_request.room: expected int, got str"),
    (
        transfer_request(),
        _set(["dst", 0, "indices"], b"\x00" * 12),
        "at $.transfer_request.dst[0].indices: expected packed int64 bytes, got 12 bytes "
        "(not a multiple of 8)",
    ),
    (
        transfer_request(),
        _set(["dst", 0, "indices"], (5).to_bytes(8, "little") + (-3).to_bytes(8, "little", signed=True)),
        "at $.transfer_request.dst[0].indices[1]: expected an index in [0, 1099511627776], got -3",
    ),
    (
        transfer_request(),
        _set(["dst", 0, "indices"], [1, "2"]),
        "at $.transfer_request.dst[0].indices[1]: expected int, got str",
    ),
    (
        transfer_request(),
        _set(["dst", 0, "indices"], {"0": 1}),
        "at $.transfer_request.dst[0].indices: expected list of int or packed int64 bytes, got map",
    ),
    (
        transfer_request(),
        _set(["dst", 1, "pool"], "kv"),
        "at $.transfer_request.dst: pools repeat: ['kv', 'kv']",
    ),
    (
        transfer_request(),
        _set(["dst"], []),
        "at $.transfer_request.dst: a transfer request names at least one pool",
    ),
    (
        transfer_request(),
        _set(["doorbell"], [1, 2]),
        "at $.transfer_request.doorbell: expected [int, int, int], got list of 2",
    ),
    (
        transfer_request(),
        _set(["doorbell", 1], 2**32),
        "at $.transfer_request.doorbell[1]: expected int in [1, 4294967295], got 4294967296",
    ),
    (
        transfer_request(),
        _set(["doorbell", 1], 0),
        "at $.transfer_request.doorbell[1]: expected int in [1, 4294967295], got 0",
    ),
    (
        progress(),
        _set(["done_nbytes"], 9000),
        "at $.progress.done_nbytes: 9000 bytes done exceeds the total of 8192",
    ),
    (
        failed_done(),
        _set(["reason"], None),
        "at $.done.reason: a failed Done must carry a reason code and text",
    ),
    (
        failed_done(),
        _set(["reason_text"], ""),
        "at $.done.reason: a failed Done must carry a reason code and text",
    ),
    (failed_done(), _set(["status"], "success"), "at $.done.reason: a successful Done carries no reason"),
    (
        abort(),
        _set(["reason_text"], ""),
        "at $.abort.reason_text: expected str of 1 to 4096 characters, got 0",
    ),
    (
        abort(),
        _set(["reason"], ["aborted"]),
        "at $.abort.reason: expected a reason code str of at most 64 characters, got list",
    ),
    (
        REJECTED,
        _set(["mismatches"], []),
        "at $.verdict.mismatches: a rejected verdict lists every mismatch and no plan",
    ),
    (REJECTED, _set(["accepted"], 1), "at $.verdict.accepted: expected bool, got int"),
]


@pytest.mark.parametrize("message, mutate, text", CASES, ids=[c[2][3:60] for c in CASES])
def test_wrong_field_is_rejected_with_its_path(message, mutate, text):
    error = _reject(message, mutate)
    assert str(error) == text
    assert error.code in (Reason.BAD_FIELD, Reason.LIMIT_EXCEEDED)
    assert error.path == text[3:].split(":")[0]


def test_view_construction_error_keeps_its_code_and_names_the_view():
    error = _reject(REGISTER, _set(["geometry", "views", 2, "strides_nbytes"], [1, 2]))
    assert error.code is Reason.BAD_VIEW
    assert error.path == "$.register.geometry.views[2]"
    assert str(error) == (
        "at $.register.geometry.views[2]: kv.layer[1].k: shape (2, 16, 8, 128), strides (1, 2) "
        "and axes ['page', 'token', 'head', 'head_dim'] differ in length"
    )


def test_view_outside_its_region_is_rejected_by_the_rank_check():
    error = _reject(REGISTER, _set(["geometry", "views", 0, "offset_nbytes"], 2**30))
    assert error.code is Reason.VIEW_OUT_OF_REGION
    assert error.path == "$.register.geometry"
    assert "kv.layer[0].k: reaches byte" in str(error)


def test_shard_range_of_another_rank_is_rejected_by_the_rank_check():
    prefill = REGISTER.geometry
    assert prefill.views[0].shard is not None
    error = _reject(REGISTER, _set(["geometry", "views", 0, "shard", "ranges", 0], [0, 4]))
    assert error.code is Reason.BAD_VIEW  # shard covers 4 heads, the axis holds 8
    assert error.path == "$.register.geometry.views[0]"
