"""Tiny model tables for the sim tests: every family, sized for milliseconds."""

from __future__ import annotations

from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout

TINY = {
    "gqa": {
        "name": "tiny-gqa",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 4, "head_dim": 8},
    },
    "gqa2": {
        "name": "tiny-gqa2",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 4},
    },
    "mla": {
        "name": "tiny-mla",
        "num_layers": 2,
        "layer_cycle": ["mla"],
        "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
    },
    "swa": {
        "name": "tiny-swa",
        "num_layers": 4,
        "layer_cycle": ["sliding_attention", "attention"],
        "attention": {"num_kv_heads": 4, "head_dim": 4},
        "sliding_attention": {"num_kv_heads": 4, "head_dim": 4, "window_tokens": 8},
    },
    "gdn": {
        "name": "tiny-gdn",
        "num_layers": 4,
        "layer_cycle": ["gdn", "gdn", "gdn", "attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 8},
        "gdn": {
            "num_key_heads": 4,
            "key_head_dim": 2,
            "num_value_heads": 8,
            "value_head_dim": 2,
            "conv_kernel": 4,
            "temporal_dtype": "float32",
        },
    },
}


def tiny(kind: str):
    return model_from_table(dict(TINY[kind]), f"<tiny {kind}>")


def instance(
    kind: str,
    role: Role,
    tp: int,
    *,
    layout: Layout = Layout.NHD,
    page_size: int = 4,
    num_pages: int = 12,
    **extra,
) -> list[RankGeometry]:
    return build_instance(
        tiny(kind),
        role,
        tp,
        page_size=page_size,
        kv_layout=layout,
        num_pages=num_pages,
        num_slots=3,
        num_aux_rows=3,
        **extra,
    )
