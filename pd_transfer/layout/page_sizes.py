"""Different page sizes on the two sides: when a tensor pair converts, and when not.

Prefill and decode often run different page (block) sizes: SGLang 1 on some
backends and 16-64 elsewhere, vLLM prefill blocks of 16 into decode blocks of
64 or 128. A token-paged tensor (full-attention KV, MLA latent, SWA window
pages) holds the same tokens whatever its page size, so the pair converts:
the planner maps request tokens instead of pages (:mod:`.token_map`).

A page-size difference is refused (``page_size_mismatch``) exactly where no
token mapping exists:

- the pool is not token-paged (Mamba state slots, aux rows: an item there is
  a request's slot or row, never a number of tokens), yet a token axis of a
  different extent was registered on it;
- the tensor registers no token axis (its pages are opaque bytes), so a page
  cannot be cut into tokens;
- a converted piece would be smaller than the stated minimum,
  :data:`MIN_PIECE`: one whole inner row (``head_dim`` or ``latent_dim``
  elements) of one token, contiguous on both sides. A side whose inner axis
  is strided would turn the conversion into a copy element by element.

Pure; no I/O.
"""

from __future__ import annotations

from pd_transfer.errors import Mismatch, Reason
from pd_transfer.layout.views import AxisRole, Pool, TensorView

TOKEN_PAGED_POOLS = (Pool.KV, Pool.SWA)
MIN_PIECE = "one inner row (head_dim or latent_dim elements) of one token"


def converted_pages(src: TensorView, dst: TensorView) -> tuple[int, int] | None:
    """``(prefill, decode)`` tokens per page of a token-paged pair whose page sizes differ."""
    if src.pool not in TOKEN_PAGED_POOLS:
        return None
    src_tokens, dst_tokens = src.extent(AxisRole.TOKEN), dst.extent(AxisRole.TOKEN)
    if src_tokens is None or dst_tokens is None or src_tokens == dst_tokens:
        return None
    return src_tokens, dst_tokens


def page_size_mismatches(
    src: TensorView, dst: TensorView, src_page_size: int, dst_page_size: int
) -> list[Mismatch]:
    """Why this pair's page sizes cannot be converted (empty when they can, or are equal)."""
    if {a.name for a in src.axes} != {a.name for a in dst.axes}:
        return []  # reported as axes_mismatch
    src_tokens, dst_tokens = src.extent(AxisRole.TOKEN), dst.extent(AxisRole.TOKEN)
    path = f"{src.path}.page_size"
    if src_tokens is None:
        if src.pool not in TOKEN_PAGED_POOLS or src_page_size == dst_page_size:
            return []
        return [
            Mismatch(
                path,
                Reason.PAGE_SIZE_MISMATCH,
                f"{src_page_size} tokens/page, no token axis",
                f"{dst_page_size} tokens/page, no token axis",
                "the tensor's pages are registered as opaque bytes, so a page cannot be "
                "cut into tokens: register its token axis (page, token, head, head_dim), "
                "or run prefill and decode with the same --page-size",
            )
        ]
    if src_tokens == dst_tokens:
        return []
    if src.pool not in TOKEN_PAGED_POOLS:
        return [
            Mismatch(
                path,
                Reason.PAGE_SIZE_MISMATCH,
                src_tokens,
                dst_tokens,
                f"{src.pool.value} items are per-request slots or rows, not pages of "
                "tokens: register the same token extent on both sides",
            )
        ]
    pieces = {side: _row_piece_nbytes(view) for side, view in (("prefill", src), ("decode", dst))}
    if all(nbytes == row for nbytes, row in pieces.values()):
        return []
    return [
        Mismatch(
            path,
            Reason.PAGE_SIZE_MISMATCH,
            f"{src_tokens} tokens/page, pieces of {pieces['prefill'][0]} B",
            f"{dst_tokens} tokens/page, pieces of {pieces['decode'][0]} B",
            f"converting page sizes moves pieces of at least {MIN_PIECE} "
            f"({pieces['prefill'][1]} B here), but a strided inner axis cuts them "
            "smaller: register the inner axis contiguously, or run prefill and decode "
            "with the same --page-size",
        )
    ]


def _row_piece_nbytes(view: TensorView) -> tuple[int, int]:
    """``(contiguous bytes of one inner row, bytes of the row)`` of one token of ``view``."""
    inner = [i for i, axis in enumerate(view.axes) if axis.role is AxisRole.INNER]
    if not inner:
        return view.itemsize, view.itemsize
    i = min(inner, key=lambda k: view.strides_nbytes[k])
    row = view.shape[i] * view.itemsize
    contiguous = view.shape[i] == 1 or view.strides_nbytes[i] == view.itemsize
    return (row if contiguous else view.itemsize), row
