"""The connector's scheduler side inside vLLM 0.33's real Scheduler (loaded by module path)."""

from __future__ import annotations

import pytest

# a specific module: the directory tests/integrations/vllm/ itself imports as a namespace "vllm"
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import (  # noqa: E402
    block_ids,
    num_free_blocks,
    request,
    runner_output,
    scheduler,
    vllm_config,
)

from pd_transfer.errors import ConfigError  # noqa: E402
from pd_transfer.integrations.vllm.connector import PdTransferConnector  # noqa: E402
from pd_transfer.integrations.vllm.params import (  # noqa: E402
    BOOTSTRAP_KEY,
    NUM_PAGES_KEY,
    NUM_TOKENS_KEY,
    ROOM_KEY,
)

BOOTSTRAP = "tcp://127.0.0.1:7311"


def _step(sched, reqs, **report):
    out = sched.schedule()
    engine_outputs = sched.update_from_output(out, runner_output(reqs, **report))
    return out, [o for outs in engine_outputs.values() for o in outs.outputs]


def _decode_params(room=42, num_pages=3):
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        ROOM_KEY: room,
        BOOTSTRAP_KEY: BOOTSTRAP,
        NUM_PAGES_KEY: num_pages,
    }


def test_scheduler_loads_the_connector_by_module_path_with_hma(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer"))
    assert isinstance(sched.connector, PdTransferConnector)
    # SupportsHMA: vLLM keeps its hybrid KV-cache manager on for hybrid models
    assert KVConnectorFactory.supports_hma_config(sched.vllm_config.kv_transfer_config)


def test_prefill_holds_blocks_until_the_send_finished_and_returns_room_and_bootstrap(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_producer", extra={"bootstrap_addr": BOOTSTRAP}))
    free_before = num_free_blocks(sched)
    req = request(40, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    out, outputs = _step(sched, [req])
    assert out.num_scheduled_tokens[req.request_id] == 40
    held = block_ids(sched, req.request_id)
    assert len(held) == 3  # 40 tokens in 16-token blocks
    # the step that computes the prompt streams it: the workers hand over each layer as it is written
    (send,) = out.kv_connector_metadata.step.sends
    assert (send.req_id, list(send.block_ids), send.stream) == (req.request_id, held, True)
    (finished,) = outputs
    params = finished.kv_transfer_params
    assert params["do_remote_prefill"] is True and params[BOOTSTRAP_KEY] == BOOTSTRAP
    assert params[NUM_PAGES_KEY] == 3 and isinstance(params[ROOM_KEY], int)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert num_free_blocks(sched) == free_before - 3  # delay free: still held

    assert send.room == params[ROOM_KEY]
    out, _ = _step(sched, [])
    assert not out.kv_connector_metadata.step.sends  # sent once
    assert num_free_blocks(sched) == free_before - 3

    _step(sched, [], finished_sending={req.request_id})
    assert num_free_blocks(sched) == free_before
    assert req.request_id not in sched.requests


def test_prefill_sends_the_pages_decode_loads_not_the_last_token_alone(model_dir):
    # 49 tokens: decode loads 48 (3 blocks) and computes the 49th itself
    sched = scheduler(vllm_config(model_dir, kv_role="kv_producer", extra={"bootstrap_addr": BOOTSTRAP}))
    req = request(49, kv_transfer_params={"do_remote_decode": True, ROOM_KEY: 1234}, max_tokens=1)
    sched.add_request(req)
    out, (finished,) = _step(sched, [req])
    assert finished.kv_transfer_params[NUM_PAGES_KEY] == 3
    assert finished.kv_transfer_params[ROOM_KEY] == 1234  # the router's room is kept
    (send,) = out.kv_connector_metadata.step.sends
    assert (len(send.block_ids), send.room) == (3, 1234)


def test_decode_parks_the_request_until_the_load_finished_then_computes_one_token(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer"))
    req = request(40, kv_transfer_params=_decode_params())
    sched.add_request(req)
    out, _ = _step(sched, [])
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.request_id not in out.num_scheduled_tokens
    (recv,) = out.kv_connector_metadata.step.recvs
    assert (recv.room, recv.bootstrap_addr, recv.error) == (42, BOOTSTRAP, "")
    assert list(recv.block_ids) == block_ids(sched, req.request_id) and len(recv.block_ids) == 3

    out, _ = _step(sched, [])  # still loading: nothing runs
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    _step(sched, [], finished_recving={req.request_id})
    out, _ = _step(sched, [req])
    assert out.num_scheduled_tokens == {req.request_id: 1}  # 39 loaded, the last one computed
    assert req.num_computed_tokens == 40 and req.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_is_handled_by_vllms_policy_never_decoded(model_dir, policy):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer", policy=policy))
    req = request(40, kv_transfer_params=_decode_params())
    sched.add_request(req)
    _step(sched, [])
    blocks = set(block_ids(sched, req.request_id))
    # the worker's failure report: finished AND its blocks invalid, in the same pass
    _, outputs = _step(sched, [], finished_recving={req.request_id}, invalid_block_ids=blocks)
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        assert [o.finish_reason for o in outputs if o.request_id == req.request_id]
        assert req.request_id not in sched.requests or req.is_finished()
    else:
        out, _ = _step(sched, [req])
        assert out.num_scheduled_tokens[req.request_id] == 40  # recomputed from scratch


def test_decode_with_bad_params_fails_that_request_through_the_worker(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer"))
    req = request(
        40, kv_transfer_params={"do_remote_prefill": True, ROOM_KEY: "not-a-room", BOOTSTRAP_KEY: BOOTSTRAP}
    )
    sched.add_request(req)
    out, _ = _step(sched, [])
    (recv,) = out.kv_connector_metadata.step.recvs
    assert ROOM_KEY in recv.error and "'not-a-room'" in recv.error


def test_decode_refuses_kv_of_a_different_prompt_length_than_its_own(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer"))
    req = request(40, kv_transfer_params={**_decode_params(), NUM_TOKENS_KEY: 44})
    sched.add_request(req)
    out, _ = _step(sched, [])
    (recv,) = out.kv_connector_metadata.step.recvs
    assert "KV of 44 prompt tokens" in recv.error and "has 40 tokens and loads 39" in recv.error


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(16, 16), (32, 32), (16, 32), (32, 16)])
def test_every_prompt_length_moves_the_pages_of_all_but_its_last_token(
    model_dir, prefill_block, decode_block
):
    """Prefill's pages and decode's expected blocks both hold the first n - 1 tokens; the
    block holding only token n (n = k * B + 1) is decode's to compute, never part of the room."""
    prefill = scheduler(
        vllm_config(
            model_dir, kv_role="kv_producer", extra={"bootstrap_addr": BOOTSTRAP}, block_size=prefill_block
        )
    )
    decode_config = vllm_config(model_dir, kv_role="kv_consumer", block_size=decode_block)
    decode = scheduler(decode_config)
    for n in range(1, 4 * max(prefill_block, decode_block) + 2):
        first = request(
            n, kv_transfer_params={"do_remote_decode": True}, max_tokens=1, block_size=prefill_block
        )
        prefill.add_request(first)
        out, (finished,) = _step(prefill, [first])
        if n == 1:  # nothing to move: decode computes the one token itself
            assert finished.kv_transfer_params is None and not out.kv_connector_metadata.step.sends
            continue
        (send,) = out.kv_connector_metadata.step.sends
        params = finished.kv_transfer_params
        assert len(send.block_ids) == params[NUM_PAGES_KEY] == -(-(n - 1) // prefill_block), n
        assert params[NUM_TOKENS_KEY] == n - 1
        _step(prefill, [], finished_sending={first.request_id})

        second = request(
            n, kv_transfer_params=dict(params), block_size=decode_block, prompt=first.prompt_token_ids
        )
        decode.add_request(second)
        out, _ = _step(decode, [])
        (recv,) = out.kv_connector_metadata.step.recvs
        assert recv.error == "", (n, recv.error)
        held = block_ids(decode, second.request_id)
        assert list(recv.block_ids) == held[: -(-(n - 1) // decode_block)], n
        _step(decode, [], finished_recving={second.request_id})
        out, _ = _step(decode, [second])
        assert out.num_scheduled_tokens == {second.request_id: 1}, n  # n - 1 loaded, the last computed
        assert second.num_computed_tokens == n
        decode.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)


def test_a_streamed_prefill_request_that_ends_without_its_token_aborts_its_room(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_producer", extra={"bootstrap_addr": BOOTSTRAP}))
    free_before = num_free_blocks(sched)
    # 300 tokens in 256-token chunks: the first step does not complete the prompt
    req = request(300, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    sched.add_request(req)
    _step(sched, [req], partial={req.request_id})
    out = sched.schedule()
    (send,) = out.kv_connector_metadata.step.sends  # the step that completes the prompt streams it
    # the client went away while that step ran
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, runner_output([]))
    out, _ = _step(sched, [])
    (abort,) = out.kv_connector_metadata.step.aborts  # no decode will claim it: ended now
    assert (abort.req_id, abort.room) == (req.request_id, send.room)
    assert num_free_blocks(sched) < free_before  # held until the workers report the room ended
    _step(sched, [], finished_sending={req.request_id})
    assert num_free_blocks(sched) == free_before


def test_an_abort_during_the_load_keeps_the_blocks_until_the_room_drained(model_dir):
    sched = scheduler(vllm_config(model_dir, kv_role="kv_consumer"))
    free_before = num_free_blocks(sched)
    req = request(40, kv_transfer_params=_decode_params())
    sched.add_request(req)
    _step(sched, [])
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = _step(sched, [])
    (abort,) = out.kv_connector_metadata.step.aborts
    assert (abort.req_id, abort.room) == (req.request_id, 42)
    assert num_free_blocks(sched) == free_before - 3  # a late write could still land
    _step(sched, [], finished_recving={req.request_id})  # the worker saw the drain
    assert num_free_blocks(sched) == free_before


def test_a_prefill_instance_without_bootstrap_address_is_refused_with_the_fix(model_dir):
    with pytest.raises(ConfigError, match="bootstrap_addr"):
        scheduler(vllm_config(model_dir, kv_role="kv_producer"))


def test_kv_both_is_refused_with_the_reason(model_dir):
    with pytest.raises(ConfigError, match="kv_producer.*kv_consumer"):
        scheduler(vllm_config(model_dir, kv_role="kv_both"))
