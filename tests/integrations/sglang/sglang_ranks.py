"""SGLang ranks for the tests: SGLang's own pools and kv_args fill-ins, and the
pd-transfer backend classes built over them as SGLang's scheduler builds them.

Each :class:`SglangRank` is one scheduler rank: a pool of SGLang's classes on
CPU, its ``MetadataBuffers``, the ``kv_args`` SGLang's own helpers fill in,
and the backend's manager registered with a real sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    build_kv_layer_ids,
    get_kv_transfer_buf_infos,
    setup_state_kv_args,
)

from pd_transfer.integrations.sglang.conn import ENGINE_MEMORY, PdTransferKVManager
from pd_transfer.integrations.sglang.memory import share_engine_memory
from pd_transfer.integrations.sglang.registration import EngineFacts

NUM_AUX_ROWS = 8


@dataclass
class SglangRank:
    role: str
    tp_rank: int
    pool: Any
    metadata: Any
    kv_args: Any
    mamba_pool: Any = None
    manager: Any = None
    memory: Any = None
    extra: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        if self.memory is not None:
            self.memory.close()


def metadata_buffers() -> MetadataBuffers:
    return MetadataBuffers(
        size=NUM_AUX_ROWS,
        hidden_size=16,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=4,
        max_top_logprobs_num=4,
    )


def fill_kv_args(rank: SglangRank, *, page_size: int, num_layers: int, total_kv_heads: int | None) -> Any:
    """``kv_args`` as SGLang's ``_init_kv_manager`` fills them, with its own helpers."""
    pool = rank.pool
    kv_args = KVArgs()
    kv_args.engine_rank = rank.tp_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.gpu_id = 0
    kv_args.kv_cache_dtype_str = "auto"
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0, num_hidden_layers=num_layers
    )
    if total_kv_heads is not None:
        kv_args.kv_head_num = pool.head_num
        kv_args.total_kv_head_num = total_kv_heads
    kv_args.page_size = page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = rank.metadata.get_buf_infos()
    req_to_token_pool = SimpleNamespace(mamba_pool=rank.mamba_pool) if rank.mamba_pool is not None else None
    setup_state_kv_args(kv_args, pool, None, num_layers, req_to_token_pool=req_to_token_pool)
    return kv_args


def build_rank(
    role: str,
    tp_rank: int,
    pool: Any,
    *,
    page_size: int,
    num_layers: int,
    facts: EngineFacts,
    owner: str,
    mamba_pool: Any = None,
    host_kv_pool: Any = None,
    host_mamba_pool: Any = None,
) -> SglangRank:
    """Pools into shared memory, kv_args by SGLang's helpers, then the manager (registers).

    ``host_kv_pool`` / ``host_mamba_pool`` (decode): SGLang's host pools, registered as the
    KV / Mamba state destination.
    """
    rank = SglangRank(role, tp_rank, pool, metadata_buffers(), None, mamba_pool)
    rank.memory = share_engine_memory(
        owner,
        kv_pool=pool,
        metadata_buffers=rank.metadata,
        mamba_pool=mamba_pool,
        host_kv_pool=host_kv_pool,
        host_mamba_pool=host_mamba_pool,
    )
    rank.kv_args = fill_kv_args(
        rank, page_size=page_size, num_layers=num_layers, total_kv_heads=facts.total_kv_heads
    )
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    token = ENGINE_MEMORY.set((rank.memory, facts))
    try:
        rank.manager = PdTransferKVManager(
            rank.kv_args, mode, SimpleNamespace(), facts.total_kv_heads is None
        )
    finally:
        ENGINE_MEMORY.reset(token)
    return rank
