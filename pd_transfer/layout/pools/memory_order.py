"""The order in memory of each pool layout, and row-major strides from it.

Every KV layout is the same five logical dimensions (layer, page, token in
page, head, element of a head) stored in a different order. Writing the order
down once as data, outermost first, gives every stride and offset of every
builder from one function instead of one hand-written formula per layout:

    page_first   (S, L, H, D) with S = P*ps  ->  ("page", "token", "layer", "head", "dim")
    strides of ("page", "token", "layer", "head", "dim") with sizes (P, ps, L, H, D)
        = (ps*L*H*D, L*H*D, H*D, D, 1) elements

A token-major axis ``S`` of ``P*ps`` tokens is the same bytes as the two axes
``(P, ps)``, so every layout can be written with separate page and token axes.
The device layouts have no layer axis: each layer is its own buffer.

Pure data; imports only ``pd_transfer.layout.views``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pd_transfer.layout.views import Layout

LAYER = "layer"
PAGE = "page"
TOKEN = "token"
HEAD = "head"
DIM = "dim"

# outermost first; "dim" is head_dim for MHA/GQA and latent_dim for MLA
KV_ORDER: dict[Layout, tuple[str, ...]] = {
    Layout.NHD: (PAGE, TOKEN, HEAD, DIM),  # per layer [P*ps, H, D]
    Layout.HND: (PAGE, HEAD, TOKEN, DIM),  # per layer [P, H, ps, D]
    Layout.LAYER_FIRST: (LAYER, PAGE, TOKEN, HEAD, DIM),  # (L, S, H, D)
    Layout.PAGE_FIRST: (PAGE, TOKEN, LAYER, HEAD, DIM),  # (S, L, H, D)
    Layout.PAGE_FIRST_DIRECT: (PAGE, LAYER, TOKEN, HEAD, DIM),  # (P, L, ps, H, D)
    Layout.PAGE_HEAD: (PAGE, HEAD, TOKEN, LAYER, DIM),  # (P, H, ps, L, D)
}

DEVICE_KV_LAYOUTS = (Layout.NHD, Layout.HND)


def element_strides(order: tuple[str, ...], sizes: Mapping[str, int]) -> dict[str, int]:
    """Row-major strides, in elements, of a buffer whose dims are ``order``."""
    strides: dict[str, int] = {}
    stride = 1
    for name in reversed(order):
        strides[name] = stride
        stride *= sizes[name]
    return strides


def num_elements(order: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[name] for name in order)


def without(order: tuple[str, ...], name: str) -> tuple[str, ...]:
    """``order`` less one dimension (MLA has no head axis)."""
    return tuple(n for n in order if n != name)
