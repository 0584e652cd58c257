"""Token mapping between different page sizes, in granules, vectorised.

With prefill pages of ``ps_src`` tokens and decode pages of ``ps_dst``, every
page boundary on either side is a multiple of ``g = gcd(ps_src, ps_dst)``
tokens from the request's first token, so the owed tokens (see
:class:`~pd_transfer.layout.spans.TokenSpan`) split into *granules* of ``g``
tokens, each inside one page on both sides. A granule is addressed on each
side by ``(page, sub)``: its page index and its position in the page in
units of ``g`` tokens. The planner lowers one block copy of ``g`` tokens per
granule and the lowering joins granules that continue each other on both
sides: prefill pages of 16 into decode pages of 64 in NHD give one run per
prefill page, not one per token.

Worked example: ``ps_src`` 16, ``ps_dst`` 64, ``g`` 16; request tokens 0-47
from prefill pages ``[7, 2, 9]`` into decode page ``[5]``: granules
(page, sub) ``(7,0)->(5,0)``, ``(2,0)->(5,1)``, ``(9,0)->(5,2)``.

Pure numpy; no Python loop per token or granule.
"""

from __future__ import annotations

import math

import numpy as np

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.spans import TokenSpan

Granules = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def granule_tokens(src_page_size: int, dst_page_size: int) -> int:
    return math.gcd(src_page_size, dst_page_size)


def granules(span: TokenSpan, src_page_size: int, dst_page_size: int, pool_name: str) -> Granules:
    """``(src_page, dst_page, src_sub, dst_sub)`` of every owed granule, in token order."""
    for side, first, page_size in (
        ("prefill", span.src_first_token, src_page_size),
        ("decode", span.dst_first_token, dst_page_size),
    ):
        if first < 0 or first % page_size:
            raise PlanError(
                f"{pool_name}: the {side} page list starts at request token {first}, which is not "
                f"a page boundary of its {page_size}-token pages",
                code=Reason.INDEX_NOT_PAGE_ALIGNED,
                hint="a page list starts at a multiple of its side's page size",
            )
    g = granule_tokens(src_page_size, dst_page_size)
    src_tokens, dst_tokens = span.token_ranges(src_page_size, dst_page_size)
    low, high = max(src_tokens.start, dst_tokens.start), min(src_tokens.stop, dst_tokens.stop)
    token = np.arange(low, max(low, high), g, dtype=np.int64)
    src_pos = token - span.src_first_token
    dst_pos = token - span.dst_first_token
    return (
        span.src_pages[src_pos // src_page_size],
        span.dst_pages[dst_pos // dst_page_size],
        (src_pos % src_page_size) // g,
        (dst_pos % dst_page_size) // g,
    )
