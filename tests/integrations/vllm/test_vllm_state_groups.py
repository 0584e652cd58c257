"""A hybrid whose GDN layers vLLM splits into several KV-cache groups, each with its own state block per request.

Qwen3-Next's 36 GDN and 12 full-attention layers are one attention group and
three GDN groups of 12 layers. The layers here are grouped and placed by
vLLM 0.33 itself (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``,
``allocate_kv_cache``; see vllm_hybrid_caches.gdn_groups): 6 GDN + 2
attention layers make three GDN groups of 2, and 3 GDN + 2 attention layers
GDN groups of 2 and 1. vLLM's real ``Scheduler`` on each side picks the
request's blocks; the worker connectors move them over real sidecars; the
oracle writes each GDN layer's state through vLLM's own tensor of THAT layer
(not the one the connector registers) into a copy of decode's buffer, and
decode's whole buffer is compared byte for byte.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import hybrid_scheduler, request, step, vllm_config  # noqa: E402
from vllm_hybrid_caches import (  # noqa: E402
    CONV_GROUPS,
    K_DIM,
    KERNEL,
    V_DIM,
    V_HEADS,
    assert_same_bytes,
    flat_copy,
    gdn_groups,
    gdn_states,
    heads_of,
    local_channels,
    transfer_exactly,
    twin,
)
from vllm_instances import HEAD_SIZE, NUM_BLOCKS, TOTAL_HEADS, transfer  # noqa: E402

from pd_transfer.errors import ConfigError  # noqa: E402
from pd_transfer.integrations.vllm.connector import PdTransferConnector  # noqa: E402
from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402

MAX_MODEL_LEN = 4096  # the harness's; vLLM's GDN block size without prefix caching


def _layers(gdn: list[int], attn: list[int]) -> tuple[list[str], list[str]]:
    return [f"model.layers.{i}.linear_attn" for i in gdn], [f"model.layers.{i}.self_attn.attn" for i in attn]


EVEN = _layers([0, 1, 2, 4, 5, 6], [3, 7])  # Qwen3-Next's pattern: GDN groups [0, 4], [1, 5], [2, 6]
UNEVEN = _layers([0, 1, 2], [3, 4])  # GDN groups [0, 2], [1]: the second has no layer at position 1


def _build(model_dir, layers, block_size: int):
    """Layer-outermost for the even groups, block-outermost (every block holds a page of each
    position) for the uneven ones: vLLM overlays the groups from byte 0 in both."""
    layout = KVCacheLayout.LBHNC if layers is EVEN else KVCacheLayout.BLHNC
    return gdn_groups(
        model_dir, *layers, block_size=block_size, mamba_block_size=MAX_MODEL_LEN, layout=layout
    )


def _state_groups(kv_config) -> list[list[str]]:
    return [g.layer_names for g in kv_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]


def _scheduler(model_dir, role: str, extra: dict, tp_size: int, block_size: int, kv_config) -> Scheduler:
    config = vllm_config(model_dir, kv_role=role, extra=extra, tp_size=tp_size, block_size=block_size)
    return hybrid_scheduler(config, kv_config, NUM_BLOCKS)


def _blocks(sched, req_id: str, kv_config) -> tuple[list[int], list[list[int]]]:
    """(attention blocks, each GDN group's blocks in group order) of a request."""
    per_group = sched.kv_cache_manager.get_block_ids(req_id)
    attn, states = [], []
    for group, ids in zip(kv_config.kv_cache_groups, per_group):
        if isinstance(group.kv_cache_spec, MambaSpec):
            states.append(list(ids))
        else:
            attn = list(ids)
    return attn, states


def _schedulers_pick(model_dir, bootstrap, prompt_len, prefill, decode):
    """Both real schedulers through one request; checks each group's state block is in the room, in order."""
    (p_tp, p_build, p_bs), (d_tp, d_build, d_bs) = prefill, decode
    p_config, _ = p_build(p_tp, 0)
    d_config, _ = d_build(d_tp, 0)
    sched = _scheduler(model_dir, "kv_producer", {"bootstrap_addr": bootstrap}, p_tp, p_bs, p_config)
    first = request(prompt_len, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    prompt = list(first.prompt_token_ids)
    sched.add_request(first)
    out, outputs = step(sched, [first])
    assert first.num_prompt_tokens == prompt_len - 1  # decode computes the last prompt token
    (send,) = out.kv_connector_metadata.step.sends
    attn, states = _blocks(sched, first.request_id, p_config)
    assert len(states) >= 2 and all(len(s) == 1 for s in states)  # one state block per group ("none")
    assert list(send.state_slots) == [s[0] for s in states] and len(set(send.state_slots)) == len(states)
    assert list(send.block_ids) == attn[: -(-(prompt_len - 1) // p_bs)]
    (finished,) = [o for o in outputs if o.request_id == first.request_id]
    params = dict(finished.kv_transfer_params)

    sched = _scheduler(model_dir, "kv_consumer", {}, d_tp, d_bs, d_config)
    second = request(prompt_len, kv_transfer_params=params, max_tokens=4)
    second.prompt_token_ids[:] = prompt
    second._all_token_ids[:] = prompt
    sched.add_request(second)
    out, _ = step(sched, [])
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = out.kv_connector_metadata.step.recvs
    attn, states = _blocks(sched, second.request_id, d_config)
    assert list(recv.state_slots) == [s[0] for s in states] and recv.error == ""
    assert list(recv.block_ids) == attn[: -(-(prompt_len - 1) // d_bs)]
    assert sched.connector.get_loaded_kv_cache_group_ids(second) == tuple(
        range(len(d_config.kv_cache_groups))
    )
    step(sched, [], finished_recving={second.request_id})
    out, _ = step(sched, [second])
    assert out.num_scheduled_tokens == {second.request_id: 1}  # decode computes token n - 1 from the state
    return send, recv


def _request_data(seed: int, attn: list[str], groups: list[list[str]], num_tokens: int):
    """The request over the whole model: KV per attention layer and token, a state per GDN layer, and
    one per empty position of a shorter group (the bytes no layer uses there, moved all the same)."""
    gen = torch.Generator().manual_seed(seed)
    kv = {n: torch.randn(2, num_tokens, TOTAL_HEADS, HEAD_SIZE, generator=gen).half() for n in attn}
    width = max(len(g) for g in groups)
    keys = [n for g in groups for n in g] + [(g, j) for g in range(len(groups)) for j in range(width)]
    conv = {k: torch.randn(KERNEL - 1, sum(CONV_GROUPS), generator=gen).half() for k in keys}
    temporal = {k: torch.randn(V_HEADS, V_DIM, K_DIM, generator=gen) for k in keys}
    return kv, conv, temporal


def _fill(caches, tp, rank, blocks, slots, data, block_size, model):
    """The oracle's write: each GDN layer's state through vLLM's tensor of that very layer, at its
    group's slot; ``model``: (attention layers, GDN layers per group in group order)."""
    (kv, conv, temporal), (attn, groups) = data, model
    heads = heads_of(tp, rank, TOTAL_HEADS)
    for n in attn:
        for t in range(min(kv[n].shape[1], len(blocks) * block_size)):
            page, at = blocks[t // block_size], t % block_size
            caches[n][page, :, at, :HEAD_SIZE] = kv[n][0, t][heads]
            caches[n][page, :, at, HEAD_SIZE:] = kv[n][1, t][heads]
    longest = max(groups, key=len, default=[])
    for g, (names, slot) in enumerate(zip(groups, slots)):
        for j in range(len(longest)):
            # past a shorter group's last layer: the bytes at that position of its block
            name, key = (names[j], names[j]) if j < len(names) else (longest[j], (g, j))
            c, s = gdn_states(caches[name], tp)
            c[slot] = conv[key][:, local_channels(tp, rank)]  # "SD": (taps, channels)
            s[slot] = temporal[key][heads_of(tp, rank, V_HEADS)]


def _move_and_check(prefill, decode, send, recv, model, block_sizes, num_tokens):
    data = _request_data(len(send.block_ids) + 40, *model, num_tokens)
    for rank, caches in enumerate(prefill.caches):
        _fill(caches, prefill.tp_size, rank, send.block_ids, send.state_slots, data, block_sizes[0], model)
    expected = []
    for rank, caches in enumerate(decode.caches):
        flat = flat_copy(caches)
        view = twin(caches, flat)
        _fill(view, decode.tp_size, rank, recv.block_ids, recv.state_slots, data, block_sizes[1], model)
        expected.append(flat)
    transfer_exactly(prefill, decode, send, recv, expected)


@pytest.mark.parametrize(
    ("layers", "prompt_len", "prefill", "decode"),
    [
        pytest.param(EVEN, 33, (2, 16), (4, 16), id="3-groups-of-2-33-tokens-tp2-to-tp4"),
        pytest.param(EVEN, 32, (2, 16), (1, 32), id="3-groups-of-2-32-tokens-bs16-to-bs32-tp2-to-tp1"),
        pytest.param(
            UNEVEN,
            17,
            (1, 32),
            (2, 16),
            id="groups-of-2-and-1-block-outermost-17-tokens-bs32-to-bs16-tp1-to-tp2",
        ),
    ],
)
def test_each_gdn_groups_state_block_moves_with_the_kv_byte_exact(
    model_dir, instances, layers, prompt_len, prefill, decode
):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    (p_tp, p_bs), (d_tp, d_bs) = prefill, decode
    p_build, d_build = _build(model_dir, layers, p_bs), _build(model_dir, layers, d_bs)
    send, recv = _schedulers_pick(
        model_dir, bootstrap, prompt_len, (p_tp, p_build, p_bs), (d_tp, d_build, d_bs)
    )
    groups = _state_groups(p_build(1, 0)[0])
    assert groups == _state_groups(d_build(1, 0)[0]) and len(groups) == (3 if layers is EVEN else 2)
    p = instances("kv_producer", p_tp, bootstrap, build=p_build)
    d = instances("kv_consumer", d_tp, bootstrap, build=d_build)
    # every token slot of each side's pages (on CPU decode unstages whole blocks); the room moves
    # the first prompt_len - 1 tokens, and every slot of decode's pages is one of them here
    assert len(recv.block_ids) * d_bs <= len(send.block_ids) * p_bs
    num_tokens = len(send.block_ids) * p_bs
    _move_and_check(p, d, send, recv, (layers[1], groups), (p_bs, d_bs), num_tokens)


def test_a_saved_state_layer_waits_for_the_end_of_the_pass_which_writes_the_other_groups_later(
    model_dir, instances
):
    """A registered GDN view also carries the other groups' layers at its position, which the
    forward pass computes later (model layer 1 after layer 0): saving it must not ship them early."""
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    build = _build(model_dir, EVEN, 16)
    groups = _state_groups(build(1, 0)[0])
    model = (EVEN[1], groups)
    prefill = instances("kv_producer", 1, bootstrap, build=build)
    decode = instances("kv_consumer", 1, bootstrap, build=build)
    send = SendSpec("req-save", 84, (2, 5), state_slots=(7, 1, 9), stream=True)
    recv = RecvSpec("req-save", 84, bootstrap, (4, 10), state_slots=(3, 8, 6))
    before, after = _request_data(51, *model, 32), _request_data(52, *model, 32)
    _fill(prefill.caches[0], 1, 0, send.block_ids, send.state_slots, before, 16, model)

    def forward():  # every registered layer saved, then the state written as the pass goes on
        for name in [*EVEN[1], *groups[0]]:
            prefill.connectors[0].save_kv_layer(name, None, None)
        _fill(prefill.caches[0], 1, 0, send.block_ids, send.state_slots, after, 16, ([], groups))

    flat = flat_copy(decode.caches[0])
    view = twin(decode.caches[0], flat)
    _fill(view, 1, 0, recv.block_ids, recv.state_slots, before, 16, (EVEN[1], []))
    _fill(view, 1, 0, recv.block_ids, recv.state_slots, after, 16, ([], groups))
    results, errors = transfer(prefill, decode, send, recv, forward)
    assert not results[0].failed_recving and not errors[0], decode.connectors[0]._worker.failures
    assert_same_bytes(flat_copy(decode.caches[0]), flat, "decode tp0/1")


def test_a_state_group_whose_layers_are_not_the_first_groups_memory_is_refused_at_registration(model_dir):
    kv_config, caches = _build(model_dir, EVEN, 16)(1, 0)
    config = vllm_config(
        model_dir, kv_role="kv_consumer", extra={"worker_endpoint": "unix:///nonexistent.sock"}
    )
    connector = PdTransferConnector(config, KVConnectorRole.WORKER, kv_config)
    connector._groups.check_state_aliases(caches)  # vLLM's own overlay: layer i of every group, same bytes
    # group 1's first layer in a storage of its own (as if vLLM gave each group its own allocation)
    alone = dict(caches, **{"model.layers.1.linear_attn": caches["model.layers.1.linear_attn"].clone()})
    with pytest.raises(
        ConfigError,
        match=r"vLLM layer 'model.layers.1.linear_attn' \(KV-cache group 1, position 0\) is not the memory "
        r"of layer 'model.layers.0.linear_attn' \(KV-cache group 0, position 0\): it lies in another allocation",
    ):
        connector.register_kv_caches(alone)
    # same storage, another place: group 2's first layer laid out over group 0's second
    shifted = dict(caches, **{"model.layers.2.linear_attn": caches["model.layers.4.linear_attn"]})
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.2.linear_attn' \(KV-cache group 2, position 0\) is not the memory of layer "
        r"'model.layers.0.linear_attn' \(KV-cache group 0, position 0\): it starts \+\d+ bytes from",
    ):
        connector.register_kv_caches(shifted)
    assert connector._worker is None  # refused before any sidecar was asked


def test_each_groups_state_block_is_the_last_before_its_speculative_scratch_blocks():
    from pd_transfer.integrations.vllm.hybrid_state import state_slots

    assert state_slots([[7], [3], [11]], 0) == (7, 3, 11)  # group order, one block each
    assert state_slots([[7, 8, 9], [3, 4, 5]], 2) == (7, 3)  # vLLM's scratch blocks follow the state block
    assert state_slots([], 0) == () and state_slots([[], []], 0) == ()  # no blocks yet: nothing to move
