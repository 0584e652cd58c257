"""Linear-attention hybrids through SGLang's ``HybridLinearKVPool`` + ``MambaPool``
and real sidecars: a NemotronH-style Mamba2 model, prefill TP 1 -> decode TP 2,
and a Qwen3-Next-style GDN model, TP 2 -> 4.

SGLang declares no conv groups for Mamba2 models, but a Mamba2 conv state's
channels are ``[x (d_inner) | B (n_groups*state) | C (n_groups*state)]``, each
sharded on its own across TP. The backend supplies the groups from SGLang's
``Mamba2CacheParams``; the oracle lays out the logical state independently
and checks every decode slot, and the test shows that a contiguous slice of
prefill's channels (what a backend without the groups moves) differs. For
GDN, SGLang declares the groups itself: ``[q (key_dim) | k (key_dim) | v
(value_dim)]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
from sglang_deployment import Deployment, run_room
from sglang_ranks import build_rank

from pd_transfer.integrations.sglang.plugin import mamba2_conv_groups
from pd_transfer.integrations.sglang.registration import EngineFacts

KV_HEADS, HEAD_DIM, PAGE_SIZE, POOL_TOKENS = 2, 8, 4, 32
ATTN_LAYERS, MAMBA_LAYERS = [0, 2], [1, 3]
D_INNER, N_GROUPS, STATE, M_HEADS, M_HEAD_DIM, KERNEL = 16, 4, 4, 4, 4, 4
CONV_DIM = D_INNER + 2 * N_GROUPS * STATE


KEY_DIM = N_GROUPS * STATE
GROUPS = {"mamba2": (D_INNER, KEY_DIM, KEY_DIM), "gdn": (KEY_DIM, KEY_DIM, D_INNER)}


def cache_params(tp_size: int, model: str) -> Mamba2CacheParams:
    # GDN's conv state is cat(q, k, v) and SGLang declares its groups; Mamba2's is x|B|C, undeclared
    declared = list(GROUPS["gdn"]) if model == "gdn" else None
    shape = Mamba2StateShape.create(
        tp_world_size=tp_size,
        intermediate_size=D_INNER,
        n_groups=N_GROUPS,
        num_heads=M_HEADS,
        head_dim=M_HEAD_DIM,
        state_size=STATE,
        conv_kernel=KERNEL,
        conv_shard_groups=declared,
    )
    return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)


def hybrid_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch, tag: str, model: str):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    params = cache_params(tp_size, model)
    mamba = MambaPool(
        size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=MAMBA_LAYERS, device="cpu"
    )
    pool = HybridLinearKVPool(
        size=POOL_TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
        head_num=max(1, KV_HEADS // tp_size),
        head_dim=HEAD_DIM,
        full_attention_layer_ids=ATTN_LAYERS,
        device="cpu",
        mamba_pool=mamba,
    )
    facts = EngineFacts(
        attn_tp_size=tp_size,
        total_kv_heads=KV_HEADS,
        mamba2_conv_groups=mamba2_conv_groups(params, tp_size, (N_GROUPS,)),
        model="tiny-nemotron-h",
    )
    return build_rank(
        role,
        tp_rank,
        pool,
        page_size=PAGE_SIZE,
        num_layers=4,
        facts=facts,
        owner=f"{tag}-{role}{tp_rank}",
        mamba_pool=mamba,
    )


def local_channels(tp_rank: int, tp_size: int, model: str) -> np.ndarray:
    """Global conv channel ids rank ``tp_rank`` holds: each group split on its own."""
    out, start = [], 0
    for group in GROUPS[model]:
        per = group // tp_size
        out.append(np.arange(start + tp_rank * per, start + (tp_rank + 1) * per))
        start += group
    return np.concatenate(out)


@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp"), [("mamba2", 1, 2), ("gdn", 2, 4)])
def test_conv_groups_land_per_group_across_tp(tmp_path, monkeypatch, model, prefill_tp, decode_tp):
    deployment = Deployment(tmp_path, prefill_tp, decode_tp)
    prefill = decode = []
    try:
        prefill = [
            hybrid_rank("prefill", r, prefill_tp, deployment, monkeypatch, model, model)
            for r in range(prefill_tp)
        ]
        decode = [
            hybrid_rank("decode", r, decode_tp, deployment, monkeypatch, model, model)
            for r in range(decode_tp)
        ]
        rng = np.random.default_rng(7)
        conv = {
            layer: rng.standard_normal((CONV_DIM, KERNEL - 1)).astype(np.float32) for layer in MAMBA_LAYERS
        }
        temporal = {
            layer: rng.standard_normal((M_HEADS, M_HEAD_DIM, STATE)).astype(np.float32)
            for layer in MAMBA_LAYERS
        }
        src_slot, dst_slot = 1, 2
        for rank in prefill:
            cache = rank.mamba_pool.mamba_cache
            channels = local_channels(rank.tp_rank, prefill_tp, model)
            heads = slice(rank.tp_rank * M_HEADS // prefill_tp, (rank.tp_rank + 1) * M_HEADS // prefill_tp)
            for i, layer in enumerate(MAMBA_LAYERS):
                cache.conv[0][i, src_slot] = torch.from_numpy(conv[layer][channels]).to(cache.conv[0].dtype)
                cache.temporal[i, src_slot] = torch.from_numpy(temporal[layer][heads]).to(
                    cache.temporal.dtype
                )
        pages = [1, 3]
        p_states, d_states, _, receivers = run_room(
            prefill,
            decode,
            deployment,
            77,
            pages,
            [2, 5],
            src_aux=0,
            dst_aux=1,
            src_state=[np.array([src_slot])],
            dst_state=[np.array([dst_slot])],
        )
        assert d_states == [KVPoll.Success] * decode_tp, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * prefill_tp
        full_conv = {
            layer: torch.from_numpy(conv[layer]).to(torch.bfloat16).float().numpy() for layer in MAMBA_LAYERS
        }
        for rank in decode:
            got = rank.mamba_pool.mamba_cache
            channels = local_channels(rank.tp_rank, decode_tp, model)
            heads = slice(rank.tp_rank * M_HEADS // decode_tp, (rank.tp_rank + 1) * M_HEADS // decode_tp)
            for i, layer in enumerate(MAMBA_LAYERS):
                want = torch.from_numpy(conv[layer]).to(got.conv[0].dtype).float().numpy()[channels]
                landed = got.conv[0][i, dst_slot].float().numpy()
                np.testing.assert_array_equal(landed, want, err_msg=f"conv layer {layer} rank {rank.tp_rank}")
                # what slicing the concatenated channels as one range would have moved
                part = CONV_DIM // decode_tp
                contiguous = full_conv[layer][rank.tp_rank * part : (rank.tp_rank + 1) * part]
                assert not np.array_equal(landed, contiguous), "a contiguous slice would have matched"
                np.testing.assert_array_equal(
                    got.temporal[i, dst_slot].float().numpy(),
                    torch.from_numpy(temporal[layer]).to(got.temporal.dtype).float().numpy()[heads],
                )
                assert not got.conv[0][i, src_slot].any(), "a slot the room did not name was written"
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
