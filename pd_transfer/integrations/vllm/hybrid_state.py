"""Which of a request's blocks hold its Mamba/GDN state, and who computes its last prompt token.

vLLM gives a linear-attention (Mamba1, Mamba2, gated delta net) group one
block per request for its running state, plus, with speculative decoding,
``num_speculative_blocks`` scratch blocks after it (vLLM's
``mamba_cache_mode = "none"``). :func:`state_slots` picks the state block
out of each state group's block list: the last one before the scratch
blocks, as vLLM's own NixlConnector does (``clip_ssm_state_blocks``). A
model whose state layers vLLM splits into several groups (Qwen3-Next: three
GDN groups) has one state block per group, listed in group order (see
:mod:`.cache_groups` for why one list of slots carries them all).

The last prompt token belongs to decode. Decode loads the first
``prompt_len - 1`` tokens and computes the last one itself (its forward pass
samples the first output token from it). For attention that only means
prefill sends the pages of the first ``prompt_len - 1`` tokens. A Mamba
state cannot be cut back that way: the state after ``n`` tokens has every
token folded in, so if prefill computed all ``n`` and decode computed token
``n - 1`` again from that state, token ``n - 1`` would enter the state twice
and decode would continue from the wrong state (a repetition from the first
token is what users see). So a prefill instance whose model has a Mamba
group drops the last prompt token when the request arrives
(:func:`drop_last_prompt_token`, called from the connector's
``on_new_request``): prefill computes ``n - 1`` tokens, its state covers
exactly the tokens decode loads, and decode's state after its first step
equals a non-disaggregated run's. Prefill's own sampled token is discarded
(the router uses only prefill's ``kv_transfer_params``). A one-token prompt
is left whole: decode loads nothing and computes it.

Works on duck-typed vLLM requests and block lists; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: set in a prefill request's ``kv_transfer_params`` once its last prompt token was dropped
DROPPED_KEY = "_pd_transfer_dropped_last_token"


def drop_last_prompt_token(request: Any) -> bool:
    """Drop a remote-decode request's last prompt token on prefill (see the module docstring).

    Idempotent (a preempted request is not cut twice); True when the request
    is (now) one token short of its prompt.
    """
    params = request.kv_transfer_params
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return False
    if params.get(DROPPED_KEY):
        return True
    if request.prompt_token_ids is None or request.num_prompt_tokens <= 1:
        return False  # prompt embeddings, or nothing decode could load
    del request.prompt_token_ids[-1:]
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    params[DROPPED_KEY] = True
    return True


def full_prompt_len(request: Any) -> int:
    """The prompt's length as the router sent it (a prefill request may be one token short)."""
    params = request.kv_transfer_params
    dropped = isinstance(params, dict) and bool(params.get(DROPPED_KEY))
    return len(request.prompt_token_ids or ()) + int(dropped)


def state_slots(per_group: Sequence[Sequence[int]], num_speculative_blocks: int) -> tuple[int, ...]:
    """The request's state block in each state group, in group order: the last block before
    the scratch blocks.

    ``[[7]]`` -> ``(7,)``; with 2 speculative blocks ``[[7, 8, 9], [3, 4, 5]]`` -> ``(7, 3)``;
    no groups, or a request without blocks yet (vLLM allocates every group's at once) -> ``()``.
    """
    if not per_group or not all(per_group):
        return ()
    return tuple(
        blocks[len(blocks) - 1 - min(num_speculative_blocks, len(blocks) - 1)] for blocks in per_group
    )
