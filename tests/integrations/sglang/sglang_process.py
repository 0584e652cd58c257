"""SGLang scheduler ranks as SGLang builds them, on CPU.

Each rank publishes SGLang's server args (``override_server_args``, SGLang's
own way to publish a config in a test process) and its place in the
parallel layout (``get_parallel().override`` with the ranks
``compute_dp_attention_world_info`` gives), then constructs SGLang's real
``PrefillBootstrapQueue`` or ``DecodePreallocQueue``: their constructors call
SGLang's own ``_init_kv_manager``, wrapped by the plugin's hook that
``load_plugins()`` registers, which fills ``kv_args``, reads
``engine_facts`` from the scheduler's ``ModelConfig`` (a real one, from a
local ``config.json``) and builds pd-transfer's manager through SGLang's
``get_kv_class``. A decode rank's ``DecodePreallocQueue`` gets SGLang's real
``DecodeTransferQueue``. What stays a stand-in is what needs a running
scheduler: the scheduler object (its model config, pools, allocator, output
streamer) and the radix tree (:class:`TreeStandIn`, which records the KV rows
SGLang's ``release_kv_cache`` frees).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend
from sglang.srt.layers.dp_attention import compute_dp_attention_world_info
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_ranks import NUM_AUX_ROWS


def llama_dir(root: Path, name: str, *, layers: int, kv_heads: int, head_dim: int, heads: int = 8) -> str:
    """A local model directory holding a Llama ``config.json`` (no weights: only its config is read)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "head_dim": head_dim,
        "intermediate_size": 64,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@dataclass
class Topology:
    """One server's parallel layout: ``tp_size`` ranks in ``attn_dp_size`` attention-DP groups."""

    tp_size: int
    attn_dp_size: int = 1

    def ranks(self, tp_rank: int) -> dict[str, int]:
        attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size = compute_dp_attention_world_info(
            tp_rank, self.tp_size, self.attn_dp_size, 1
        )
        return dict(
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            attn_tp_rank=attn_tp_rank,
            attn_tp_size=attn_tp_size,
            attn_dp_rank=attn_dp_rank,
            attn_dp_size=attn_dp_size,
            attn_cp_rank=0,
            attn_cp_size=1,
            pp_rank=0,
            pp_size=1,
            dp_rank=0,
            dp_size=1,
        )


@contextlib.contextmanager
def sglang_rank(mode: str, topology: Topology, tp_rank: int, **server_fields: Any):
    """SGLang's published server args and this rank's parallel state, for the ``with`` block."""
    override = get_context().override_server_args(
        disaggregation_mode=mode,
        disaggregation_transfer_backend="pd_transfer",
        tp_size=topology.tp_size,
        attn_dp_size=topology.attn_dp_size,
        **server_fields,
    )
    server_args = override.install()
    try:
        with get_parallel().override(
            attn_tp_group=SimpleNamespace(cpu_group=None), **topology.ranks(tp_rank)
        ):
            yield server_args
    finally:
        override.restore()


class TreeStandIn:
    """The radix tree's part of SGLang's ``release_kv_cache``: it records each freed KV row."""

    disable = False
    supports_mamba = staticmethod(lambda: False)

    def __init__(self, allocator: Any) -> None:
        self.token_to_kv_pool_allocator = allocator
        self.freed: list[tuple[Any, list]] = []  # (the request's kv record, token ranges)
        self.req_to_token_pool = SimpleNamespace(free=lambda req: None)  # its row: the allocator's part

    def claim_kv_row(self, req: Any) -> bool:
        return False

    def free_kv_row(self, kv: Any, ranges: list) -> None:
        self.freed.append((kv, list(ranges)))

    def unlock(self, lock: Any) -> None:
        pass

    def on_release(self, req: Any, checkpointed: bool) -> None:
        pass


def scheduler(server_args: Any, model_config: Any, pool: Any, page_size: int) -> SimpleNamespace:
    """What SGLang's queues read from their scheduler."""
    allocator = SimpleNamespace(page_size=page_size, get_kvcache=lambda: pool)
    return SimpleNamespace(
        server_args=server_args,
        model_config=model_config,
        rust_server=None,
        random_seed=0,
        enable_hisparse=False,
        enable_decode_hicache=False,
        kv_shard_widening=1,
        token_to_kv_pool_allocator=allocator,
        spec_algorithm=SpeculativeAlgorithm.from_string(server_args.speculative_algorithm),
        tp_worker=SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=SimpleNamespace(
                kv_cache_dtype_str="auto", effective_logical_max_total_num_tokens=1024
            ),
        ),
        # what the queues' methods reach while serving
        attn_tp_cpu_group=None,  # a one-rank gloo group where the test sets one up
        attn_cp_cpu_group=None,
        processed_tokens_counter=0,
        output_streamer=MagicMock(),
        batch_result_processor=MagicMock(),  # reasoning-token accounting of the first token
        handle_bootstrap_failure=MagicMock(),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        disagg_decode_prealloc_queue=None,
    )


def prefill_queue(
    stand_in: SimpleNamespace, pool: Any, metadata: Any, draft_pool: Any = None, bootstrap_port: int = 0
):
    """SGLang's ``PrefillBootstrapQueue`` (its constructor builds the KV manager)."""
    return PrefillBootstrapQueue(
        token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft_pool,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(NUM_AUX_ROWS),
        metadata_buffers=metadata,
        gpu_id=0,
        bootstrap_port=bootstrap_port,
        max_total_num_tokens=1024,
        scheduler=stand_in,
        scheduler_stage_metrics=None,
        transfer_backend=TransferBackend("pd_transfer"),
    )


def decode_queue(stand_in: SimpleNamespace, metadata: Any, draft_pool: Any = None):
    """SGLang's ``DecodePreallocQueue`` (its constructor builds the KV manager) over its real
    ``DecodeTransferQueue``; the radix tree is a :class:`TreeStandIn`."""
    allocator = ReqToMetadataIdxAllocator(NUM_AUX_ROWS)
    tree = TreeStandIn(stand_in.token_to_kv_pool_allocator)
    transfer = DecodeTransferQueue(allocator, metadata, stand_in, tree)
    queue = DecodePreallocQueue(
        req_to_token_pool=ReqToTokenPool(NUM_AUX_ROWS, 256, "cpu", False),
        token_to_kv_pool_allocator=stand_in.token_to_kv_pool_allocator,
        draft_token_to_kv_pool=draft_pool,
        req_to_metadata_buffer_idx_allocator=allocator,
        metadata_buffers=metadata,
        scheduler=stand_in,
        transfer_queue=transfer,
        tree_cache=tree,
        gpu_id=0,
        bootstrap_port=0,
        max_total_num_tokens=1024,
        num_reserved_decode_tokens=0,
        transfer_backend=TransferBackend("pd_transfer"),
    )
    stand_in.disagg_decode_prealloc_queue = queue
    return queue


@dataclass
class QueueRank:
    """One scheduler rank built by SGLang's queue: its pools, metadata buffers and manager."""

    role: str
    tp_rank: int
    pool: Any
    metadata: Any
    queue: Any
    draft_pool: Any = None

    @property
    def manager(self) -> Any:
        return self.queue.kv_manager

    def close(self) -> None:
        self.manager.close()
        self.manager.memory.close()


@contextlib.contextmanager
def host_destination(**host_pools: Any):
    """Decode's KV (``host_kv_pool``) or Mamba state (``host_mamba_pool``) destination: SGLang's
    host (HiCache) pools, handed to ``share_engine_memory`` when the plugin's hook calls it.

    ``share_engine_memory`` is the one entry point for a host destination: SGLang's own
    per-request host receive (``--disaggregation-decode-host-receive-threshold``) is refused
    at start, so the hook itself never registers one.
    """
    from pd_transfer.integrations.sglang import memory

    share = memory.share_engine_memory
    memory.share_engine_memory = lambda owner, **pools: share(owner, **pools, **host_pools)
    try:
        yield
    finally:
        memory.share_engine_memory = share


def queue_rank(
    role: str,
    topology: Topology,
    tp_rank: int,
    model_dir: str,
    *,
    pool: Any,
    metadata: Any,
    draft_pool: Any = None,
    bootstrap_port: int = 0,
    **server_fields: Any,
) -> QueueRank:
    """SGLang's queue for ``role`` built over ``pool`` (the endpoint comes from the environment)."""
    with sglang_rank(role, topology, tp_rank, model_path=model_dir, **server_fields) as server_args:
        stand_in = scheduler(server_args, ModelConfig(model_dir), pool, pool.page_size)
        if role == "prefill":
            queue = prefill_queue(stand_in, pool, metadata, draft_pool, bootstrap_port)
        else:
            queue = decode_queue(stand_in, metadata, draft_pool)
    return QueueRank(role, tp_rank, pool, metadata, queue, draft_pool)
