"""Speculative decoding's draft model through SGLang's own queues and real sidecars.

Both servers run a target model and an EAGLE-style draft: SGLang's
``MHATokenToKVPool`` for each (target: 3 layers, 8 KV heads of 16; draft: 1
layer, 4 KV heads of 32), and ``MetadataBuffers`` sized as SGLang sizes them
for EAGLE (the draft's recurrent hidden state, ``spec_hidden_size`` wide, in
the model's dtype). Each rank is built by SGLang's real
``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` through the plugin's
hook (:mod:`sglang_process`): SGLang's ``_init_kv_manager`` appends the
draft's buffers to ``kv_args`` (``num_draft_entries``) and the hook reads the
draft model's KV heads from its ``ModelConfig``.

The oracle is the request's logical KV of both models, ``[k|v, layer, token,
global head, dim]``, and its metadata row: every decode rank must hold, by
plain indexing of SGLang's buffers, exactly its heads of both models on its
pages, nothing anywhere else, and prefill's hidden state and top-k in its row.
A decode that runs no draft is refused by name instead of decoding with a
draft whose KV never arrived.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room, wait_for
from sglang_process import QueueRank, Topology, llama_dir, queue_rank
from sglang_ranks import NUM_AUX_ROWS

PAGE, POOL_TOKENS, HIDDEN = 4, 64, 48
TARGET = {"layers": 3, "kv_heads": 8, "head_dim": 16}
DRAFT = {"layers": 1, "kv_heads": 4, "head_dim": 32}


def pool(model: dict, tp_size: int) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=max(1, model["kv_heads"] // tp_size),
        head_dim=model["head_dim"],
        layer_num=model["layers"],
        device="cpu",
        enable_memory_saver=False,
    )


def build(role, tp_rank, tp_size, deployment, monkeypatch, dirs, *, with_draft=True) -> QueueRank:
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    spec = (
        {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": dirs["draft"]}
        if with_draft
        else {}
    )
    metadata = MetadataBuffers(
        size=NUM_AUX_ROWS,
        hidden_size=HIDDEN,
        hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=4,
        max_top_logprobs_num=4,
    )
    return queue_rank(
        role,
        Topology(tp_size),
        tp_rank,
        dirs["target"],
        pool=pool(TARGET, tp_size),
        metadata=metadata,
        draft_pool=pool(DRAFT, tp_size) if with_draft else None,
        **spec,
    )


def heads(pool: MHATokenToKVPool, tp_rank: int) -> slice:
    """The global KV heads rank ``tp_rank`` holds in ``pool`` (as many per rank as it has)."""
    return slice(tp_rank * pool.head_num, (tp_rank + 1) * pool.head_num)


def logical_kv(model: dict, num_tokens: int, rng) -> np.ndarray:
    """``[k|v, layer, token, global head, dim]`` of one request, as raw bfloat16 bits."""
    shape = (2, model["layers"], num_tokens, model["kv_heads"], model["head_dim"])
    return rng.integers(1, 2**15, size=shape, dtype=np.int16)


def write_prefill(rank: QueueRank, pool: MHATokenToKVPool, kv: np.ndarray, pages: list[int]) -> None:
    mine = heads(pool, rank.tp_rank)
    for which, buffers in enumerate((pool.k_buffer, pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            bits = buf.view(torch.int16)
            for i, page in enumerate(pages):
                bits[page * PAGE : (page + 1) * PAGE] = torch.from_numpy(
                    kv[which, layer, i * PAGE : (i + 1) * PAGE, mine]
                )


def check_decode(
    rank: QueueRank, pool: MHATokenToKVPool, name: str, kv: np.ndarray, pages: list[int]
) -> None:
    mine = heads(pool, rank.tp_rank)
    for which, buffers in enumerate((pool.k_buffer, pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            got = buf.view(torch.int16).numpy().reshape(-1, PAGE, pool.head_num, pool.head_dim)
            for i, page in enumerate(pages):
                want = kv[which, layer, i * PAGE : (i + 1) * PAGE, mine]
                np.testing.assert_array_equal(
                    got[page], want, err_msg=f"{name} {'kv'[which]}{layer} page {page}"
                )
            others = [p for p in range(got.shape[0]) if p not in pages]
            assert not got[others].any(), f"{name} {'kv'[which]}{layer}: bytes outside the request's pages"


@pytest.fixture
def model_dirs(tmp_path):
    load_plugins()
    return {
        "target": llama_dir(tmp_path, "target", **TARGET),
        "draft": llama_dir(tmp_path, "draft", **DRAFT),
    }


def test_eagle_draft_kv_and_hidden_state_land_byte_exact_across_tp(tmp_path, monkeypatch, model_dirs):
    deployment = Deployment(tmp_path, 2, 4)
    prefill = decode = []
    try:
        prefill = [build("prefill", r, 2, deployment, monkeypatch, model_dirs) for r in range(2)]
        decode = [build("decode", r, 4, deployment, monkeypatch, model_dirs) for r in range(4)]
        assert prefill[0].manager.kv_args.num_draft_entries == 2  # SGLang appended draft K and V
        rng = np.random.default_rng(41)
        src_pages, dst_pages = [3, 1, 7], [9, 4, 11]
        target_kv = logical_kv(TARGET, len(src_pages) * PAGE, rng)
        draft_kv = logical_kv(DRAFT, len(src_pages) * PAGE, rng)
        hidden = torch.from_numpy(rng.integers(1, 2**15, size=HIDDEN, dtype=np.int16)).view(torch.bfloat16)
        for rank in prefill:
            write_prefill(rank, rank.pool, target_kv, src_pages)
            write_prefill(rank, rank.draft_pool, draft_kv, src_pages)
            rank.metadata.output_ids[2, 0] = 977
            rank.metadata.output_hidden_states[2] = hidden
            rank.metadata.output_topk_p[2, :4] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
            rank.metadata.output_topk_index[2, :4] = torch.tensor([11, 22, 33, 44])
            rank.metadata.bootstrap_room[2, 0] = 515
        p_states, d_states, _, receivers = run_room(
            prefill, decode, deployment, 515, src_pages, dst_pages, src_aux=2, dst_aux=6, chunk_pages=2
        )
        assert d_states == [KVPoll.Success] * 4, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * 2
        for rank in decode:
            check_decode(rank, rank.pool, "target", target_kv, dst_pages)
            check_decode(rank, rank.draft_pool, "draft", draft_kv, dst_pages)
            row = rank.metadata
            assert torch.equal(row.output_hidden_states[6].view(torch.int16), hidden.view(torch.int16))
            assert row.output_topk_p[6, :4].tolist() == [0.5, 0.25, 0.125, 0.0625]
            assert row.output_topk_index[6, :4].tolist() == [11, 22, 33, 44]
            assert int(row.output_ids[6, 0]) == 977 and int(row.bootstrap_room[6, 0]) == 515
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()


def test_a_decode_without_the_draft_is_refused_by_name(tmp_path, monkeypatch, model_dirs):
    deployment = Deployment(tmp_path, 1, 1)
    ranks = []
    try:
        ranks.append(build("prefill", 0, 1, deployment, monkeypatch, model_dirs))
        ranks.append(build("decode", 0, 1, deployment, monkeypatch, model_dirs, with_draft=False))
        from pd_transfer.integrations.sglang.conn import PdTransferKVReceiver

        receiver = PdTransferKVReceiver(ranks[1].manager, deployment.sglang_bootstrap, 516)
        receiver.init(0)
        receiver.send_metadata([1, 2], 0, None)
        assert wait_for([receiver], KVPoll.Failed, 30) == [KVPoll.Failed]
        for name in ("draft_k", "draft_v"):
            assert f"kv.layer[0].{name}" in receiver.failure, receiver.failure
        assert "layer_missing" in receiver.failure, receiver.failure
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()
