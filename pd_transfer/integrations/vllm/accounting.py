"""Which prompt tokens a room moves, counted the same way on prefill and decode.

Prefill computes the KV of all ``n`` prompt tokens. vLLM's decode loads the
first ``n - 1`` of them and computes the last one itself (it needs that
token's logits to sample the first output token), so a room moves exactly
the KV of the first ``n - 1`` tokens:

- prefill sends the blocks holding them: ``ceil((n - 1) / B_prefill)``;
- decode allocates ``ceil(n / B_decode)`` blocks for the prompt and expects
  the first ``ceil((n - 1) / B_decode)`` of them. For ``n = k * B + 1`` the
  last block holds only the last token, which decode computes: it is not
  part of the room.

Both counts follow from the one token count, so they agree whatever the two
block sizes are (the sidecars convert pages of different sizes token by
token). Prefill states the count in ``kv_transfer_params``
(:data:`~pd_transfer.integrations.vllm.params.NUM_TOKENS_KEY`); decode
checks it against its own prompt, which catches a router that sent the two
instances different prompts.

Pure; no vLLM, no torch.
"""

from __future__ import annotations


def tokens_loaded(num_prompt_tokens: int) -> int:
    """The prompt tokens whose KV a room moves: all but the last."""
    return max(num_prompt_tokens - 1, 0)


def pages_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens holding the first ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def room_blocks(block_ids: list[int], num_prompt_tokens: int, block_size: int) -> list[int]:
    """The request's blocks that a room fills: those holding the first ``n - 1`` prompt tokens."""
    return list(block_ids)[: pages_for(tokens_loaded(num_prompt_tokens), block_size)]


def token_count_error(sent_tokens: int | None, num_prompt_tokens: int, room: int) -> str:
    """Why prefill's stated token count does not fit decode's prompt ("" when it does, or is not stated)."""
    if sent_tokens is None or sent_tokens == tokens_loaded(num_prompt_tokens):
        return ""
    return (
        f"prefill sent the KV of {sent_tokens} prompt tokens for room {room}; decode's prompt has "
        f"{num_prompt_tokens} tokens and loads {tokens_loaded(num_prompt_tokens)}: the router must send "
        f"both instances the same prompt"
    )
