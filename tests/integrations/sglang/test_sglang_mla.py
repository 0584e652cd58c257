"""A DeepSeek-style MLA latent, prefill TP 4 -> decode TP 2, through SGLang's
``MLATokenToKVPool`` and real sidecars.

Every rank holds the whole latent (kv_lora_rank + qk_rope_head_dim per token);
every decode rank must end with the request's latents on its pages, and
nothing anywhere else.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang_deployment import Deployment, run_room
from sglang_ranks import build_rank

from pd_transfer.integrations.sglang.registration import EngineFacts

LAYERS, LORA, ROPE, PAGE_SIZE, POOL_TOKENS = 2, 32, 8, 4, 48


def mla_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    pool = MLATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return build_rank(
        role,
        tp_rank,
        pool,
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        owner=f"mla-{role}{tp_rank}",
        facts=EngineFacts(attn_tp_size=tp_size, total_kv_heads=None, model="tiny-mla"),
    )


def test_mla_latents_land_on_every_decode_rank(tmp_path, monkeypatch):
    deployment = Deployment(tmp_path, 4, 2)
    prefill = decode = []
    try:
        prefill = [mla_rank("prefill", r, 4, deployment, monkeypatch) for r in range(4)]
        decode = [mla_rank("decode", r, 2, deployment, monkeypatch) for r in range(2)]
        src_pages, dst_pages = [2, 5, 1], [7, 3, 10]
        latent = np.random.default_rng(3).integers(
            1, 2**15, size=(LAYERS, len(src_pages) * PAGE_SIZE, LORA + ROPE), dtype=np.int16
        )
        for rank in prefill:
            for layer, buf in enumerate(rank.pool.kv_buffer):
                bits = buf.view(torch.int16)
                for i, page in enumerate(src_pages):
                    bits[page * PAGE_SIZE : (page + 1) * PAGE_SIZE, 0] = torch.from_numpy(
                        latent[layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
                    )
        p_states, d_states, _, receivers = run_room(
            prefill, decode, deployment, 31, src_pages, dst_pages, src_aux=1, dst_aux=2
        )
        assert d_states == [KVPoll.Success] * 2, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * 4
        for rank in decode:
            for layer, buf in enumerate(rank.pool.kv_buffer):
                got = buf.view(torch.int16).numpy().reshape(-1, PAGE_SIZE, LORA + ROPE)
                for i, page in enumerate(dst_pages):
                    np.testing.assert_array_equal(
                        got[page], latent[layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
                    )
                others = [p for p in range(got.shape[0]) if p not in dst_pages]
                assert not got[others].any()
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
