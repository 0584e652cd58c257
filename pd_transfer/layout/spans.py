"""Token spans: page lists of a token-paged pool placed on the request's token axis.

When prefill and decode run different page sizes (prefill 16 tokens a page,
decode 64), a page on one side is not a page on the other, so a request for
a KV or SWA pool cannot pair pages position by position. A
:class:`TokenSpan` says where each side's page list sits among the
request's tokens: the first page of ``src_pages`` holds request tokens
``[src_first_token, src_first_token + src_page_size)``, the next page the
following ``src_page_size`` tokens, and so on; likewise on decode. What a
span owes is every token both lists hold: the intersection of the two
token ranges, copied token for token.

Worked example: 40 tokens, prefill pages of 16 ``[7, 2, 9]`` (48 slots),
decode pages of 64 ``[5]`` (64 slots): tokens 0-47 are owed; prefill page 7
lands in decode page 5 at slots 0-15, page 2 at 16-31, page 9 at 32-47.
Slots past the request's last token are as meaningless on both sides as the
tail of a partial page is when the page sizes are equal.

A plain ``(src pages, dst pages)`` pair for such a pool is the span with
both first tokens 0 (a room sent in one chunk). Chunked sends and SWA
window pages (the request's last pages, a different count on each side)
place their lists with the first tokens.

Pure data; imports numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class TokenSpan:
    """Pages on both sides of one token-paged pool, placed on the request's token axis."""

    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_first_token: int = 0
    dst_first_token: int = 0

    def token_ranges(self, src_page_size: int, dst_page_size: int) -> tuple[range, range]:
        """The request tokens each side's pages hold."""
        src_end = self.src_first_token + len(self.src_pages) * src_page_size
        dst_end = self.dst_first_token + len(self.dst_pages) * dst_page_size
        return range(self.src_first_token, src_end), range(self.dst_first_token, dst_end)


def request_lengths_agree(
    num_src_pages: int, num_dst_pages: int, src_page_size: int, dst_page_size: int
) -> bool:
    """True when some token count fills exactly these many pages on both sides.

    ``n`` tokens take ``ceil(n / page_size)`` pages; 40 tokens take 3 pages of
    16 and 1 page of 64, so (3, 1) agree, while (3, 2) do not (two pages of
    64 need at least 65 tokens, three of 16 hold at most 48).
    """
    if num_src_pages == 0 or num_dst_pages == 0:
        return num_src_pages == num_dst_pages
    low = max((num_src_pages - 1) * src_page_size, (num_dst_pages - 1) * dst_page_size)
    high = min(num_src_pages * src_page_size, num_dst_pages * dst_page_size)
    return low < high
