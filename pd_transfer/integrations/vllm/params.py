"""The request convention between a router and the two vLLM instances (``kv_transfer_params``).

pd-transfer keeps NIXL's connector convention, so routers written for
``NixlConnector`` (vLLM's toy proxy and its kin) work unchanged:

1. the router sends the prompt to prefill with ``{"do_remote_decode": true}``
   and ``max_tokens=1``; it may name the room with ``"pd_transfer_room"``;
2. prefill's response carries the :func:`decode_params` below in
   ``kv_transfer_params``: the room id, prefill's bootstrap address, the
   number of pages sent and the prompt tokens they hold;
3. the router forwards them unchanged to decode (``do_remote_prefill`` is
   already true in them), which loads the KV from its sidecar.

Everything here is untrusted input from the router: :func:`parse_remote_prefill`
returns the reason a request cannot be loaded instead of raising, so the
connector can fail that request (and only that one) with the reason.

Pure; no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, TypeGuard

ROOM_KEY = "pd_transfer_room"
BOOTSTRAP_KEY = "pd_transfer_bootstrap_addr"
NUM_PAGES_KEY = "pd_transfer_num_pages"
NUM_TOKENS_KEY = "pd_transfer_num_tokens"
MAX_ROOM = 2**63 - 1


@dataclass(frozen=True)
class RemotePrefill:
    """What decode needs to load a request's KV: from prefill's ``kv_transfer_params``."""

    room: int
    bootstrap_addr: str
    num_pages: int | None
    num_tokens: int | None = None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def room_for(request_id: str, params: dict[str, Any] | None) -> int:
    """The router's ``pd_transfer_room`` when it gives a valid one, else one derived from the request id.

    Derived: the first 63 bits of BLAKE2b(request id), so the same request id
    always names the same room (vLLM request ids are unique per engine).
    """
    given = params.get(ROOM_KEY) if isinstance(params, dict) else None
    if _is_room(given):
        return given
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_ROOM


def decode_params(room: int, bootstrap_addr: str, num_pages: int, num_tokens: int) -> dict[str, Any]:
    """Prefill's ``kv_transfer_params`` for the router to forward to decode.

    ``num_pages``: prefill's blocks sent; ``num_tokens``: the prompt tokens
    their KV covers (all but the last), what decode checks its prompt against.
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        ROOM_KEY: room,
        BOOTSTRAP_KEY: bootstrap_addr,
        NUM_PAGES_KEY: num_pages,
        NUM_TOKENS_KEY: num_tokens,
    }


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefill | str:
    """The :class:`RemotePrefill` in decode's ``kv_transfer_params``, or why there is none."""
    room, bootstrap = params.get(ROOM_KEY), params.get(BOOTSTRAP_KEY)
    num_pages, num_tokens = params.get(NUM_PAGES_KEY), params.get(NUM_TOKENS_KEY)
    if not _is_room(room):
        return (
            f"kv_transfer_params.{ROOM_KEY} is {room!r}; expected the int in [0, 2**63) that "
            f"the prefill instance returned (forward prefill's kv_transfer_params unchanged)"
        )
    if not isinstance(bootstrap, str) or not bootstrap.startswith("tcp://"):
        return (
            f"kv_transfer_params.{BOOTSTRAP_KEY} is {bootstrap!r}; expected prefill's "
            f"bootstrap address 'tcp://host:port' (forward prefill's kv_transfer_params unchanged)"
        )
    if num_pages is not None and not _is_count(num_pages):
        return f"kv_transfer_params.{NUM_PAGES_KEY} is {num_pages!r}; expected a page count"
    if num_tokens is not None and not _is_count(num_tokens):
        return f"kv_transfer_params.{NUM_TOKENS_KEY} is {num_tokens!r}; expected a token count"
    return RemotePrefill(room, bootstrap, num_pages, num_tokens)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_room(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ROOM
