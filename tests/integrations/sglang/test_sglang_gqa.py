"""Llama-style GQA KV through SGLang's interface and real sidecars, across TP sizes.

Prefill and decode are SGLang ``MHATokenToKVPool`` pools on CPU; every rank's
manager is built by SGLang's real ``PrefillBootstrapQueue`` /
``DecodePreallocQueue`` through the plugin's ``_init_kv_manager`` hook, which
moves the pools into shared memory, lets SGLang fill ``kv_args`` and reads
``engine_facts`` from the model's ``ModelConfig`` (:mod:`sglang_process`),
and every request runs through ``PdTransferKVSender`` /
``PdTransferKVReceiver`` as SGLang's scheduler calls them. The oracle is the
logical KV of the request, ``[layer, token, global head, dim]``: each rank
holds the heads its TP position gives it, and after the room every
destination page must hold exactly the logical bytes of its tokens and heads,
every other page still zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, llama_dir, queue_rank
from sglang_ranks import metadata_buffers

NUM_LAYERS, TOTAL_KV_HEADS, HEAD_DIM, PAGE_SIZE = 3, 8, 16, 4
POOL_TOKENS = 64


def mha_pool(tp_size: int) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=TOTAL_KV_HEADS // tp_size,
        head_dim=HEAD_DIM,
        layer_num=NUM_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def ranks(role: str, tp_size: int, deployment: Deployment, monkeypatch, model_dir: str):
    load_plugins()
    out = []
    for tp_rank in range(tp_size):
        monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
        out.append(
            queue_rank(
                role,
                Topology(tp_size),
                tp_rank,
                model_dir,
                pool=mha_pool(tp_size),
                metadata=metadata_buffers(),
            )
        )
    return out


def logical_kv(num_tokens: int, seed: int) -> np.ndarray:
    """``[k|v, layer, token, global head, dim]`` of one request, as raw bfloat16 bits."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 2**15, size=(2, NUM_LAYERS, num_tokens, TOTAL_KV_HEADS, HEAD_DIM), dtype=np.int16)


def heads_of(tp_rank: int, tp_size: int) -> slice:
    per = TOTAL_KV_HEADS // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


def write_prefill(rank, tp_size: int, kv: np.ndarray, pages: list[int]) -> None:
    heads = heads_of(rank.tp_rank, tp_size)
    for which, buffers in enumerate((rank.pool.k_buffer, rank.pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            bits = buf.view(torch.int16)
            for i, page in enumerate(pages):
                tokens = kv[which, layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE, heads]
                bits[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = torch.from_numpy(tokens)


def check_decode(rank, tp_size: int, kv: np.ndarray, pages: list[int]) -> None:
    heads = heads_of(rank.tp_rank, tp_size)
    for which, buffers in enumerate((rank.pool.k_buffer, rank.pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            got = buf.view(torch.int16).numpy().reshape(-1, PAGE_SIZE, TOTAL_KV_HEADS // tp_size, HEAD_DIM)
            for i, page in enumerate(pages):
                want = kv[which, layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE, heads]
                np.testing.assert_array_equal(
                    got[page], want, err_msg=f"{'kv'[which]} layer {layer} page {page}"
                )
            others = [p for p in range(got.shape[0]) if p not in pages]
            assert not got[others].any(), f"{'kv'[which]} layer {layer}: bytes outside the request's pages"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 4), (4, 2)])
def test_gqa_kv_lands_byte_exact_across_tp(tmp_path, monkeypatch, prefill_tp, decode_tp):
    deployment = Deployment(tmp_path, prefill_tp, decode_tp)
    model_dir = llama_dir(tmp_path, "tiny-gqa", layers=NUM_LAYERS, kv_heads=TOTAL_KV_HEADS, head_dim=HEAD_DIM)
    prefill = decode = []
    try:
        prefill = ranks("prefill", prefill_tp, deployment, monkeypatch, model_dir)
        decode = ranks("decode", decode_tp, deployment, monkeypatch, model_dir)
        src_pages, dst_pages = [3, 1, 7, 5, 2], [9, 4, 11, 6, 13]
        kv = logical_kv(len(src_pages) * PAGE_SIZE, seed=prefill_tp * 10 + decode_tp)
        for rank in prefill:
            write_prefill(rank, prefill_tp, kv, src_pages)
            rank.metadata.output_ids[2] = torch.arange(16, dtype=torch.int32) + 100
            rank.metadata.bootstrap_room[2, 0] = 4242
        p_states, d_states, _, receivers = run_room(
            prefill, decode, deployment, 4242, src_pages, dst_pages, src_aux=2, dst_aux=5, chunk_pages=2
        )
        assert d_states == [KVPoll.Success] * decode_tp, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * prefill_tp
        for rank in decode:
            check_decode(rank, decode_tp, kv, dst_pages)
            assert rank.metadata.output_ids[5].tolist() == list(range(100, 116))
            assert int(rank.metadata.bootstrap_room[5, 0]) == 4242
            assert not rank.metadata.output_ids[2].any()
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
