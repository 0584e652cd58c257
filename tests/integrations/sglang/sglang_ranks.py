"""SGLang ranks without a sidecar, for the registration-level tests: a pool of
SGLang's classes on CPU, its ``MetadataBuffers`` and the ``kv_args`` SGLang's
own helpers fill in (``get_kv_transfer_buf_infos``, ``build_kv_layer_ids``,
``setup_state_kv_args``), handed to ``describe_rank`` directly. Transfer tests
build their ranks through SGLang's queues and the plugin's hook instead
(:mod:`sglang_process`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    build_kv_layer_ids,
    get_kv_transfer_buf_infos,
    setup_state_kv_args,
)

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
