"""Rooms that end before decode claims them end on both sides at once, with a reason, through vLLM.

vLLM 0.33's real ``Scheduler`` on each side, the connector's workers and
real sidecars (``vllm_traffic.Side``). Every sidecar timeout is set far
beyond each case's deadline, so a case that passes ended because
pd-transfer knew, never because a timeout gave the room up:

- decode gives a room up before claiming it (prefill's token count does not
  match decode's prompt; a request aborted while it still queued on
  decode): decode's sidecar tells prefill's, whose room fails with decode's
  reason, and prefill's blocks return;
- the prefill sidecar is killed after prefill's answer and before decode
  claims the room: decode's claim fails with ``peer_lost`` in seconds, and
  prefill's worker, whose sidecar is gone, returns its blocks.

Each case ends with every block free on both schedulers.
"""

from __future__ import annotations

import logging

import pytest

# a specific module: the directory tests/integrations/vllm/ itself imports as a namespace "vllm"
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import request  # noqa: E402
from vllm_instances import run_until  # noqa: E402
from vllm_traffic import Side, check_loaded_kv, run_pd  # noqa: E402

from pd_transfer.integrations.vllm import params as kvparams  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402

NUM_BLOCKS = 64
BLOCK = 16
# far beyond each case's deadline: a room ended by one of these would fail the test
SLOW_TIMEOUTS = {"bootstrap_timeout_s": 900.0, "waiting_timeout_s": 900.0, "transfer_timeout_s": 900.0}
DEADLINE_S = 90.0  # generous on a busy host; 10 times less than any sidecar timeout


def prompt(n: int, seed: int) -> list[int]:
    return [3 + seed] + [3 + (seed * 13 + i * 7) % 250 for i in range(1, n)]


@pytest.fixture
def pair(instances, model_dir):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    prefill = Side(
        instances, model_dir, "kv_producer", 1, bootstrap, BLOCK, NUM_BLOCKS, sidecar=SLOW_TIMEOUTS
    )
    decode = Side(
        instances,
        model_dir,
        "kv_consumer",
        1,
        bootstrap,
        BLOCK,
        NUM_BLOCKS,
        sidecar=SLOW_TIMEOUTS,
        policy="fail",
    )
    # one request through the pair first: both sidecars know each other, as in a serving deployment
    run_pd(prefill, decode, [prompt(40, 0)], timeout_s=DEADLINE_S)
    return prefill, decode


def prefilled(prefill: Side, tokens: list[int]):
    """A request prefilled for a remote decode: (its prefill request, the params prefill returned)."""
    req = request(
        len(tokens),
        kv_transfer_params={"do_remote_decode": True},
        max_tokens=1,
        block_size=BLOCK,
        prompt=tokens,
    )
    prefill.sched.add_request(req)

    def answered() -> bool:
        prefill.step()
        return any(o.request_id == req.request_id and o.finished for o in prefill.outputs)

    run_until(answered, DEADLINE_S, "prefill's answer", prefill.instance.logs)
    (out,) = [o for o in prefill.outputs if o.request_id == req.request_id and o.finished]
    assert prefill.num_free_blocks() < prefill.free_at_start  # held for decode
    return req, dict(out.kv_transfer_params)


def decode_request(tokens: list[int], params: dict):
    return request(len(tokens), kv_transfer_params=params, max_tokens=2, block_size=BLOCK, prompt=tokens)


def run_both(prefill: Side, decode: Side, what: str, done) -> None:
    def step() -> bool:
        prefill.step()
        decode.step(on_first_run=check_loaded_kv)
        return done()

    run_until(step, DEADLINE_S, what, lambda: prefill.instance.logs() + decode.instance.logs())


def prefill_failure(prefill: Side, req_id: str) -> str:
    return prefill.instance.connectors[0]._worker.failures.get(req_id, "")


def assert_all_free(*sides: Side) -> None:
    for side in sides:
        assert side.num_free_blocks() == side.free_at_start, side.instance.role


def test_a_room_decode_refuses_before_its_claim_fails_on_prefill_at_once(pair, caplog):
    prefill, decode = pair
    caplog.set_level(logging.ERROR, logger="pd_transfer.integrations.vllm")
    tokens = prompt(40, 1)
    first, params = prefilled(prefill, tokens)
    params[kvparams.NUM_TOKENS_KEY] = 12  # the router sent prefill another prompt
    second = decode_request(tokens, params)
    decode.sched.add_request(second)
    run_both(
        prefill,
        decode,
        "the refused room to end on both sides",
        lambda: decode.idle() and prefill.idle(),
    )
    assert second.status == RequestStatus.FINISHED_ERROR
    assert second.request_id not in decode.first_runs
    decode_log = [r.getMessage() for r in caplog.records if second.request_id in r.getMessage()]
    assert any("12 prompt tokens" in m for m in decode_log), decode_log
    why = prefill_failure(prefill, first.request_id)
    assert "aborted" in why and "12 prompt tokens" in why, why  # decode's reason, on prefill
    assert_all_free(prefill, decode)


def test_a_request_aborted_while_queued_on_decode_ends_its_prefill_room(pair):
    prefill, decode = pair
    tokens = prompt(57, 2)
    first, params = prefilled(prefill, tokens)
    second = decode_request(tokens, params)
    decode.sched.add_request(second)
    decode.sched.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)  # before any step
    run_both(prefill, decode, "the abandoned room to end on prefill", prefill.idle)
    assert second.request_id not in decode.first_runs
    why = prefill_failure(prefill, first.request_id)
    assert "aborted" in why and "never claim" in why and "finished_aborted" in why, why
    assert_all_free(prefill, decode)


def test_a_prefill_sidecar_killed_before_the_claim_fails_it_in_seconds(pair, caplog):
    prefill, decode = pair
    caplog.set_level(logging.ERROR, logger="pd_transfer.integrations.vllm")
    tokens = prompt(50, 3)
    first, params = prefilled(prefill, tokens)
    prefill.instance.sidecars[0].kill()
    second = decode_request(tokens, params)
    decode.sched.add_request(second)
    run_both(prefill, decode, "decode's claim of a dead prefill's room to fail", decode.idle)
    assert second.status == RequestStatus.FINISHED_ERROR
    assert second.request_id not in decode.first_runs
    decode_log = [r.getMessage() for r in caplog.records if second.request_id in r.getMessage()]
    assert any("peer_lost" in m for m in decode_log), decode_log
    run_both(prefill, decode, "prefill to return the dead room's blocks", prefill.idle)
    assert prefill_failure(prefill, first.request_id)
    assert_all_free(prefill, decode)
