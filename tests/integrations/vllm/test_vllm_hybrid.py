"""Hybrid models through the connector's worker side with real sidecars, byte-exact.

The KV caches are allocated by vLLM's own ``allocate_kv_cache`` from a
``KVCacheConfig`` of two groups overlaid on one backing buffer, as vLLM
builds it for a hybrid model (see vllm_hybrid_caches.py):

- a Qwen3-Next-style GDN hybrid (full-attention layers 1, 3; gated delta net
  layers 0, 2), prefill TP 2 -> decode TP 4. The GDN layers arrive as raw
  ``[blocks, 1, 1, bytes]`` int8 pages holding the conv state
  ``(taps, q | k | v channels)`` then the temporal state
  ``(v_heads, v_dim, k_dim)``, shapes from vLLM's own
  ``gated_delta_net_state_shape``;
- a gpt-oss-style model (full-attention layer 0, sliding-window layer 1),
  TP 1 -> 2.

The oracle is the request's logical state and KV over the whole model,
sliced per rank with plain torch indexing and written into a copy of
decode's backing buffer through vLLM's own view shapes; the whole buffer is
compared, so a byte written outside the request's blocks fails too.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheGroupSpec  # noqa: E402
from vllm_harness import BLOCK_SIZE  # noqa: E402
from vllm_hybrid_caches import (  # noqa: E402
    ATTN,
    CONV_GROUPS,
    GDN,
    K_DIM,
    K_HEADS,
    KERNEL,
    SWA_FULL,
    SWA_WINDOW,
    V_DIM,
    V_HEADS,
    assert_same_bytes,
    flat_copy,
    gdn_hybrid,
    gdn_states,
    gpt_oss_like,
    heads_of,
    local_channels,
    put_kv,
    twin,
)
from vllm_instances import HEAD_SIZE, TOTAL_HEADS, transfer  # noqa: E402

from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402


def _bootstrap():
    return f"tcp://127.0.0.1:{spare_port()}"


@pytest.fixture
def conv_layout(request, monkeypatch):
    """vLLM's conv state layout for this test: "SD" (taps, channels), its default, or "DS"."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    monkeypatch.undo()
    mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("conv_layout", ["SD", "DS"], indirect=True)
def test_gdn_hybrid_state_and_kv_land_byte_exact_from_tp2_to_tp4(instances, conv_layout):
    bootstrap = _bootstrap()
    prefill = instances("kv_producer", 2, bootstrap, build=gdn_hybrid)
    decode = instances("kv_consumer", 4, bootstrap, build=gdn_hybrid)
    gen = torch.Generator().manual_seed(24)
    src, dst, src_slot, dst_slot = [3, 7], [5, 0], 9, 2
    kv = {n: torch.randn(2, len(src), BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half() for n in ATTN}
    conv = {n: torch.randn(KERNEL - 1, sum(CONV_GROUPS), generator=gen).half() for n in GDN}
    temporal = {n: torch.randn(V_HEADS, V_DIM, K_DIM, generator=gen) for n in GDN}

    def write(caches: dict, tp_size: int, rank: int, blocks: list[int], slot: int) -> None:
        for n in ATTN:
            put_kv(caches[n], kv[n], blocks, heads_of(tp_size, rank, TOTAL_HEADS))
        for n in GDN:
            c, t = gdn_states(caches[n], tp_size)
            share = conv[n][:, local_channels(tp_size, rank)]  # (taps, channels)
            c[slot] = share if conv_layout == "SD" else share.T
            t[slot] = temporal[n][heads_of(tp_size, rank, V_HEADS)]

    for rank, caches in enumerate(prefill.caches):
        write(caches, 2, rank, src, src_slot)
    expected = []
    for rank, caches in enumerate(decode.caches):
        flat = flat_copy(caches)
        write(twin(caches, flat), 4, rank, dst, dst_slot)
        expected.append(flat)
    results, errors = transfer(
        prefill,
        decode,
        SendSpec("req-gdn", 81, tuple(src), state_slots=(src_slot,)),
        RecvSpec("req-gdn", 81, bootstrap, tuple(dst), state_slots=(dst_slot,)),
    )
    assert all(not r.failed_recving for r in results) and all(not e for e in errors), [
        c._worker.failures for c in decode.connectors
    ]
    for rank, caches in enumerate(decode.caches):
        assert_same_bytes(flat_copy(caches), expected[rank], f"decode tp{rank}/4")
    # the conv groups matter: a contiguous slice of the 32 channels would not be rank 1's q|k|v share
    c, _ = gdn_states(decode.caches[1][GDN[0]], 4)
    conv_view = next(v for v in decode.connectors[1]._worker.pages.memory.geometry.views if v.name == "conv")
    assert conv_view.shape[1:] == ((KERNEL - 1, 8) if conv_layout == "SD" else (8, KERNEL - 1))
    landed = c[dst_slot] if conv_layout == "SD" else c[dst_slot].T
    assert landed.shape == (KERNEL - 1, 8) and not torch.equal(landed, conv[GDN[0]][:, 8:16])


def test_sliding_window_pages_land_byte_exact_from_tp1_to_tp2(instances):
    bootstrap = _bootstrap()
    prefill = instances("kv_producer", 1, bootstrap, build=gpt_oss_like)
    decode = instances("kv_consumer", 2, bootstrap, build=gpt_oss_like)
    gen = torch.Generator().manual_seed(25)
    full_src, full_dst, win_src, win_dst = [1, 4, 6], [2, 8, 11], [7, 10], [3, 9]
    full = torch.randn(2, len(full_src), BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half()
    window = torch.randn(2, len(win_src), BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half()

    def write(caches: dict, tp_size: int, rank: int, full_blocks: list[int], win_blocks: list[int]) -> None:
        heads = heads_of(tp_size, rank, TOTAL_HEADS)
        put_kv(caches[SWA_FULL[0]], full, full_blocks, heads)
        put_kv(caches[SWA_WINDOW[0]], window, win_blocks, heads)

    write(prefill.caches[0], 1, 0, full_src, win_src)
    expected = []
    for rank, caches in enumerate(decode.caches):
        flat = flat_copy(caches)
        write(twin(caches, flat), 2, rank, full_dst, win_dst)
        expected.append(flat)
    results, errors = transfer(
        prefill,
        decode,
        SendSpec("req-swa", 82, tuple(full_src), swa_pages=tuple(win_src)),
        RecvSpec("req-swa", 82, bootstrap, tuple(full_dst), swa_pages=tuple(win_dst)),
    )
    assert all(not r.failed_recving for r in results) and all(not e for e in errors), [
        c._worker.failures for c in decode.connectors
    ]
    for rank, caches in enumerate(decode.caches):
        assert_same_bytes(flat_copy(caches), expected[rank], f"decode tp{rank}/2")


def test_mamba_align_mode_and_a_second_attention_or_window_group_are_refused_naming_them(model_dir):
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import vllm_config

    from pd_transfer.errors import ConfigError
    from pd_transfer.integrations.vllm.connector import PdTransferConnector

    config = vllm_config(model_dir, kv_role="kv_producer", extra={"bootstrap_addr": _bootstrap()})
    cache_config, _ = gdn_hybrid(1, 0)
    assert PdTransferConnector(config, KVConnectorRole.SCHEDULER, cache_config)._scheduler is not None
    groups = cache_config.kv_cache_groups
    attn, gdn = groups[0].kv_cache_spec, groups[1].kv_cache_spec
    groups[1] = KVCacheGroupSpec(groups[1].layer_names, dataclasses.replace(gdn, mamba_cache_mode="align"))
    with pytest.raises(ConfigError, match=r"group 1 \(MambaSpec: .*mamba_cache_mode='align'"):
        PdTransferConnector(config, KVConnectorRole.SCHEDULER, cache_config)
    groups[1] = KVCacheGroupSpec(groups[1].layer_names, gdn)
    # a second GDN group of the same spec is one more state slot per request (test_vllm_state_groups.py)
    groups.append(KVCacheGroupSpec(["model.layers.4.linear_attn"], gdn))
    connector = PdTransferConnector(config, KVConnectorRole.WORKER, cache_config)
    assert connector._groups.state_aliases == ((2, ("model.layers.4.linear_attn",)),)
    # ... of another spec, it is refused: the groups are moved through one group's layers
    groups[2] = KVCacheGroupSpec(["model.layers.4.linear_attn"], dataclasses.replace(gdn, block_size=64))
    with pytest.raises(
        ConfigError,
        match=r"group 2 \(MambaSpec: .*\) has another spec than state group 1 \(block_size 64 against 16\)",
    ):
        PdTransferConnector(config, KVConnectorRole.WORKER, cache_config)
    groups[2] = KVCacheGroupSpec(["model.layers.5.self_attn.attn"], attn)
    with pytest.raises(
        ConfigError,
        match=r"group 2 \(FullAttentionSpec: model.layers.5.self_attn.attn\) is a second full-attention or "
        r"MLA group \(group 0 is the first\)",
    ):
        PdTransferConnector(config, KVConnectorRole.WORKER, cache_config)
    swa_config, _ = gpt_oss_like(1, 0)
    window = swa_config.kv_cache_groups[1]
    swa_config.kv_cache_groups.append(
        KVCacheGroupSpec(["model.layers.2.self_attn.attn"], window.kv_cache_spec)
    )
    with pytest.raises(
        ConfigError, match=r"group 2 \(SlidingWindowSpec: .*\) is a second sliding-window group .*Gemma-style"
    ):
        PdTransferConnector(config, KVConnectorRole.SCHEDULER, swa_config)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_conv_groups_are_rebuilt_from_vllms_own_state_shapes(tp_size):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from pd_transfer.integrations.vllm.cache_groups import mamba_state_spec

    def spec(kind, shapes):
        return MambaSpec(
            shapes=shapes,
            dtypes=(torch.float16, torch.float32),
            block_size=BLOCK_SIZE,
            mamba_type=getattr(MambaAttentionBackendEnum, kind),
        )

    gdn = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_size, K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL
    )
    assert mamba_state_spec(spec("GDN_ATTN", gdn), tp_size).conv_groups == CONV_GROUPS  # q | k | v
    # Mamba2: x (d_inner 16) | B | C (n_groups 2 x state 4 each)
    mamba2 = MambaStateShapeCalculator.mamba2_state_shape(tp_size, 16, 2, 4, 4, 4, KERNEL)
    assert mamba_state_spec(spec("MAMBA2", mamba2), tp_size).conv_groups == (16, 8, 8)


def test_both_schedulers_send_the_sliding_window_pages_decode_attends_to(model_dir):
    """vLLM's real schedulers with a full-attention and a sliding-window group (window 32 tokens)."""
    from vllm.v1.request import RequestStatus
    from vllm_harness import request, runner_output, scheduler, vllm_config

    from pd_transfer.integrations.vllm.params import BOOTSTRAP_KEY, ROOM_KEY

    def step(sched, reqs):
        out = sched.schedule()
        outputs = sched.update_from_output(out, runner_output(reqs))
        return out, [o for outs in outputs.values() for o in outs.outputs]

    def hybrid_scheduler(role, extra):
        config, _ = gpt_oss_like(1, 0)
        config.num_blocks = 200
        sched = scheduler(vllm_config(model_dir, kv_role=role, extra=extra), 200, config)
        return sched

    prefill = hybrid_scheduler("kv_producer", {"bootstrap_addr": "tcp://127.0.0.1:7399"})
    first = request(100, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    prefill.add_request(first)
    out, outputs = step(prefill, [first])
    (send,) = out.kv_connector_metadata.step.sends
    full_ids, window_ids = (list(g) for g in prefill.kv_cache_manager.get_block_ids(first.request_id))
    # 99 tokens loaded in 7 pages; token 99 attends to tokens 68..99: pages 4, 5, 6 of the window group
    assert list(send.block_ids) == full_ids[:7] and list(send.swa_pages) == window_ids[4:7]
    (finished,) = [o for o in outputs if o.request_id == first.request_id]
    params = dict(finished.kv_transfer_params)
    assert params[BOOTSTRAP_KEY] == "tcp://127.0.0.1:7399"

    decode = hybrid_scheduler("kv_consumer", {})
    second = request(100, kv_transfer_params=params, max_tokens=4)
    second.prompt_token_ids[:] = first.prompt_token_ids
    decode.add_request(second)
    out, _ = step(decode, [])
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = out.kv_connector_metadata.step.recvs
    full_ids, window_ids = (list(g) for g in decode.kv_cache_manager.get_block_ids(second.request_id))
    null = decode.kv_cache_manager.block_pool.null_block.block_id
    assert window_ids[:4] == [null] * 4  # vLLM skips what the window cannot reach
    assert null not in window_ids[4:7]
    assert (list(recv.block_ids), list(recv.swa_pages), recv.swa_first) == (full_ids[:7], window_ids[4:7], 4)
    assert recv.room == params[ROOM_KEY] == send.room and len(recv.swa_pages) == len(send.swa_pages)
