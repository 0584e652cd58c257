"""vLLM hybrid KV caches for the connector tests: vLLM's own allocation of overlaid groups, and an oracle.

``gdn_hybrid`` (full-attention layers 1, 3; gated delta net layers 0, 2) and
``gpt_oss_like`` (full-attention layer 0, sliding-window layer 1) build a
rank's ``KVCacheConfig`` and the tensors vLLM's ``allocate_kv_cache`` makes
of it; ``gdn_groups`` has vLLM itself group and place a hybrid's layers
(several GDN groups). The oracle writes through plain torch views of a copy of the backing
buffer. Imported only by test modules that already skipped without vLLM.
"""

from __future__ import annotations

import math

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_harness import BLOCK_SIZE, vllm_config
from vllm_instances import HEAD_SIZE, NUM_BLOCKS, TOTAL_HEADS, transfer

K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL = 2, 4, 4, 4, 4
KEY_DIM, VALUE_DIM = K_HEADS * K_DIM, V_HEADS * V_DIM
CONV_GROUPS = (KEY_DIM, KEY_DIM, VALUE_DIM)  # q | k | v
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
GDN = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
SWA_FULL, SWA_WINDOW = ["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]
STATE_DTYPES = (torch.float16, torch.float32)


def _overlaid(groups: list[tuple[list[str], object]], page: int) -> tuple[KVCacheConfig, dict]:
    """vLLM's allocation of groups overlaid on one buffer, layer-outermost, one page per block."""
    tensors = [
        KVCacheTensor(
            size=page * NUM_BLOCKS * 2, layers=names, layer_stride=page * NUM_BLOCKS, block_stride=page
        )
        for names, _ in groups
    ]
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    torch.manual_seed(len(caches))
    next(iter(caches.values())).untyped_storage().copy_(  # stale bytes everywhere: nothing is zero by luck
        torch.randint(-128, 127, (page * NUM_BLOCKS * 2,), dtype=torch.int8).untyped_storage()
    )
    return config, caches


def _gdn_specs(tp_size: int, block_size: int, mamba_block_size: int | None) -> tuple:
    """(full-attention spec, GDN spec padded to its page) of one rank."""
    conv, temporal = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_size, K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL
    )
    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=TOTAL_HEADS // tp_size, head_size=HEAD_SIZE, dtype=torch.float16
    )
    gdn = MambaSpec(
        shapes=(conv, temporal),
        dtypes=STATE_DTYPES,
        block_size=mamba_block_size or block_size,
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    return attn, gdn


def gdn_hybrid(tp_size: int, rank: int, *, block_size: int = BLOCK_SIZE, mamba_block_size: int | None = None):
    """``mamba_block_size``: the GDN group's block size; vLLM sets it to ``max_model_len``
    without prefix caching (``mamba_cache_mode = "none"``: one state block per request)."""
    attn, gdn = _gdn_specs(tp_size, block_size, mamba_block_size)
    return _overlaid([(ATTN, attn), (GDN, gdn)], attn.page_size_bytes)


def gdn_groups(
    model_dir,
    gdn: list[str],
    attn: list[str],
    *,
    block_size: int,
    mamba_block_size: int,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
):
    """``build(tp_size, rank)`` of a GDN hybrid whose KV-cache groups vLLM makes and places itself.

    vLLM's ``get_kv_cache_groups`` splits the layers (6 GDN + 2 attention:
    three GDN groups of 2 and an attention group; 3 GDN + 2 attention: GDN
    groups of 2 and 1), ``get_kv_cache_config_from_groups`` overlays them
    (``layout``: layer-outermost ``LBHNC`` or block-outermost ``BLHNC``;
    ``NUM_BLOCKS`` blocks) and ``allocate_kv_cache`` makes the tensors, with
    stale random bytes everywhere.
    """

    def build(tp_size: int, rank: int):
        config = vllm_config(
            model_dir, kv_role="kv_consumer", tp_size=tp_size, rank=rank, block_size=block_size
        )
        config.scheduler_config.disable_hybrid_kv_cache_manager = False  # the harness's Llama turns it off
        config.cache_config.kv_cache_layout = layout.name
        config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        attn_spec, gdn_spec = _gdn_specs(tp_size, block_size, mamba_block_size)
        names = sorted(gdn + attn, key=lambda n: int(n.split(".")[2]))
        groups = get_kv_cache_groups(config, {n: gdn_spec if n in gdn else attn_spec for n in names})
        kv_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
        caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        torch.manual_seed(tp_size * 10 + rank)
        storage = next(iter(caches.values())).untyped_storage()
        storage.copy_(torch.randint(-128, 127, (storage.nbytes(),), dtype=torch.int8).untyped_storage())
        return kv_config, caches

    return build


def gpt_oss_like(tp_size: int, rank: int):
    heads = TOTAL_HEADS // tp_size
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16
    )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=2 * BLOCK_SIZE,
    )
    return _overlaid([(SWA_FULL, full), (SWA_WINDOW, window)], full.page_size_bytes)


# -- the oracle: plain torch on a copy of the buffer ------------------------------------------
def twin(caches: dict, flat: torch.Tensor) -> dict:
    """Every layer tensor of ``caches`` re-pointed at ``flat`` (a copy of their backing buffer)."""
    return {
        name: torch.as_strided(flat.view(t.dtype), t.shape, t.stride(), t.storage_offset())
        for name, t in caches.items()
    }


def flat_copy(caches: dict) -> torch.Tensor:
    storage = next(iter(caches.values())).untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage).clone()


def gdn_states(page_view: torch.Tensor, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, temporal) of every block of a GDN layer, unpacked as vLLM's MambaBase does."""
    conv, temporal = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_size, K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL
    )
    pages = page_view.squeeze(1).squeeze(1)
    out, offset = [], 0
    for shape, dtype in zip((conv, temporal), STATE_DTYPES):
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(pages[:, offset : offset + n].view(dtype).view(-1, *shape))
        offset += n
    return out[0], out[1]


def local_channels(tp_size: int, rank: int) -> torch.Tensor:
    """Global conv channel ids a rank holds: each of q, k, v split on its own."""
    out, start = [], 0
    for group in CONV_GROUPS:
        per = group // tp_size
        out.append(torch.arange(start + rank * per, start + (rank + 1) * per))
        start += group
    return torch.cat(out)


def put_kv(layer: torch.Tensor, kv: torch.Tensor, blocks: list[int], heads: slice) -> None:
    """kv: [k|v, block, token, head, dim] over all heads -> vLLM's [block, head, token, 2 * dim]."""
    for i, b in enumerate(blocks):
        layer[b, :, :, :HEAD_SIZE] = kv[0, i][:, heads].permute(1, 0, 2)
        layer[b, :, :, HEAD_SIZE:] = kv[1, i][:, heads].permute(1, 0, 2)


def heads_of(tp_size: int, rank: int, total: int) -> slice:
    per = total // tp_size
    return slice(rank * per, (rank + 1) * per)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{where}: {bad.shape[0]} bytes differ, first at byte {bad[0].item()}"


def transfer_exactly(prefill, decode, send, recv, expected: list[torch.Tensor]) -> None:
    """Move ``send`` into ``recv`` through the connectors; each decode rank's whole buffer
    must then equal ``expected`` (the oracle's), byte for byte."""
    results, errors = transfer(prefill, decode, send, recv)
    assert all(not r.failed_recving for r in results) and all(not e for e in errors), [
        c._worker.failures for c in decode.connectors
    ]
    for rank, caches in enumerate(decode.caches):
        assert_same_bytes(flat_copy(caches), expected[rank], f"decode tp{rank}/{decode.tp_size}")
