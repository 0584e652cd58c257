"""The connector's scheduler side: which requests load or send KV, and when their blocks are free.

Prefill (``do_remote_decode``): the step that computes the rest of a
request's prompt carries a streamed :class:`SendSpec` (:meth:`SchedulerSide.scheduled`),
so the workers hand the sidecar each layer as the forward pass writes it.
When the request finishes capped at its one token,
:meth:`SchedulerSide.request_finished` keeps its blocks (delay free) and
returns the parameters decode needs (room id, prefill's bootstrap address,
page count); a request that was not streamed (its last prefill step was not
seen) is sent then, from the finished blocks. The blocks return to vLLM when
every worker reports the room finished (sent or failed). A streamed request
that finishes otherwise (stopped, aborted) still holds its blocks until the
workers abort the room at their sidecars (no decode will claim it) and it ended.

Decode (``do_remote_prefill``): :meth:`get_num_new_matched_tokens` claims the
prompt as loadable asynchronously; :meth:`update_state_after_alloc` turns the
allocated blocks into a :class:`RecvSpec`; vLLM parks the request in
``WAITING_FOR_REMOTE_KVS`` until the workers report the load finished, or
failed (the blocks then come back through ``get_block_ids_with_load_errors``
and vLLM's ``kv_load_failure_policy`` decides). A request aborted while its
KV is arriving keeps its blocks until the workers report the room drained.
A request that ends before it claimed its room (aborted while it queued), or
whose parameters do not fit its prompt, has its room abandoned: the workers
tell their sidecars, which tell the prefill instance, so prefill's blocks
return at once instead of at its wait for a claim.

Pages sent = the blocks holding the prompt's first ``prompt_len - 1`` tokens:
vLLM's decode loads all but the last prompt token and computes that one
itself (a 49-token prompt in 16-token blocks: 48 tokens, 3 pages), and
expects the same tokens into its own blocks (of its own block size), never
the block holding only the last token (:mod:`.accounting`).

A model with a sliding-window group also moves the window's pages: the
blocks from the one holding the first token decode's last prompt token
attends to (``prompt_len - sliding_window``) to the last page sent. Both
instances compute the same positions; blocks before them are vLLM's null
block on decode.

A model with Mamba/GDN groups also moves the request's state block of
every state group, in group order (:func:`.hybrid_state.state_slots`);
its prefill requests are one token short of the prompt (the connector
drops the last one when they arrive, see :mod:`.hybrid_state`), so the pages and the window are counted from
the prompt's full length (:func:`.hybrid_state.full_prompt_len`).

Works on duck-typed vLLM requests (``request_id``, ``prompt_token_ids``,
``kv_transfer_params``); no vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_transfer.integrations.vllm import accounting
from pd_transfer.integrations.vllm import params as kvparams
from pd_transfer.integrations.vllm.hybrid_state import full_prompt_len, state_slots
from pd_transfer.integrations.vllm.specs import AbandonSpec, AbortSpec, RecvSpec, SendSpec, StepSpecs

log = logging.getLogger(__name__)


def pages_to_send(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks holding the first ``num_prompt_tokens - 1`` tokens (what decode loads)."""
    return accounting.pages_for(accounting.tokens_loaded(num_prompt_tokens), block_size)


def first_window_page(num_prompt_tokens: int, block_size: int, window: int) -> int:
    """The first block of the sliding window decode's last prompt token attends to.

    vLLM's decode allocates null blocks before it (its sliding-window
    manager skips ``computed - window + 1`` tokens of the ``prompt - 1`` it loads).
    """
    return max(0, num_prompt_tokens - window) // block_size


@dataclass
class _Prefilling:
    """Prefill: a remote-decode request whose prompt is not computed yet, and its blocks so far."""

    room: int
    prompt_len: int  # the prompt as the router sent it
    computed_len: int  # the tokens prefill computes (one less for a hybrid model)
    blocks: list[int] = field(default_factory=list)
    swa_blocks: list[int] = field(default_factory=list)
    state_blocks: list[list[int]] = field(default_factory=list)  # per state group, in group order

    def add(self, blocks, swa_blocks, state_blocks, replace: bool) -> None:
        """A step's new blocks of each group (all of them when ``replace``: a resumed request)."""
        if replace:
            self.blocks, self.swa_blocks, self.state_blocks = [], [], []
        self.blocks += blocks or []
        self.swa_blocks += swa_blocks or []
        for i, new in enumerate(state_blocks or ()):
            if i == len(self.state_blocks):
                self.state_blocks.append([])
            self.state_blocks[i] += new


class SchedulerSide:
    """Per-request transfer state of one vLLM instance's scheduler. See the module docstring."""

    def __init__(
        self,
        *,
        block_size: int,
        bootstrap_addr: str,
        sliding_window: int | None = None,
        state_scratch_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.bootstrap_addr = bootstrap_addr
        self.sliding_window = sliding_window  # a sliding-window group's window (tokens), if any
        self.state_scratch_blocks = state_scratch_blocks  # each state group's speculative blocks
        self._local_tokens: dict[str, int] = {}  # decode: prefix-cache hit at the last lookup
        self._step = StepSpecs()
        self._loading: dict[str, int] = {}  # decode: req id -> room, with the workers
        self._sending: dict[str, int] = {}  # prefill: req id -> room, blocks held
        self._prefilling: dict[str, _Prefilling] = {}  # prefill: remote-decode requests not yet streamed
        self._streamed: dict[str, tuple[int, int]] = {}  # req id -> room, pages: streamed, not finished

    # -- decode --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        prompt_len = len(request.prompt_token_ids or ())
        if kvparams.wants_remote_decode(params) and request.request_id not in self._streamed:
            self._prefilling[request.request_id] = _Prefilling(
                kvparams.room_for(request.request_id, params),
                full_prompt_len(request),
                len(request.prompt_token_ids or ()),
            )
        if not kvparams.wants_remote_prefill(params) or accounting.tokens_loaded(prompt_len) == 0:
            return 0, False  # a 1-token prompt: no room, decode computes it
        count = prompt_len - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(
        self,
        request: Any,
        block_ids: list[int],
        num_external_tokens: int,
        swa_block_ids: Sequence[int] = (),
        state_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Decode: the request's blocks (``state_block_ids``: each state group's, in group order)."""
        params = request.kv_transfer_params
        if num_external_tokens <= 0 or not kvparams.wants_remote_prefill(params):
            return
        req_id = request.request_id
        local_tokens = self._local_tokens.pop(req_id, 0)
        prompt_len = len(request.prompt_token_ids or ())
        parsed = kvparams.parse_remote_prefill(params)
        if isinstance(parsed, str):
            error, room = parsed, 0
        else:
            room = parsed.room
            error = accounting.token_count_error(parsed.num_tokens, prompt_len, room)
        # loaded once: a preempted request recomputes instead of loading again
        params["do_remote_prefill"] = False
        first, window = self._window(prompt_len, swa_block_ids)
        spec = RecvSpec(
            req_id,
            room,
            "" if isinstance(parsed, str) else parsed.bootstrap_addr,
            tuple(accounting.room_blocks(block_ids, prompt_len, self.block_size)),
            local_tokens // self.block_size,
            error,
            swa_pages=window,
            swa_first=first,
            state_slots=state_slots(state_block_ids, self.state_scratch_blocks),
        )
        if error:
            log.error("request %s cannot load its KV: %s", req_id, error)
        self._step.recvs.append(spec)
        self._loading[req_id] = room

    # -- prefill -------------------------------------------------------------------
    def scheduled(
        self,
        req_id: str,
        block_ids: list[int] | None,
        replace: bool,
        num_computed: int,
        num_scheduled: int,
        swa_block_ids: list[int] | None = None,
        state_block_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """One scheduled request of this step: its new blocks (all of them if ``replace``) and tokens.

        ``state_block_ids``: each state group's new blocks, in group order.
        A remote-decode request whose prompt this step completes is streamed.
        """
        entry = self._prefilling.get(req_id)
        if entry is None:
            return
        entry.add(block_ids, swa_block_ids, state_block_ids, replace)
        if num_computed + num_scheduled < entry.computed_len:
            return
        del self._prefilling[req_id]
        num_pages = pages_to_send(entry.prompt_len, self.block_size)
        if num_pages == 0 or len(entry.blocks) < num_pages:
            return
        _, window = self._window(entry.prompt_len, entry.swa_blocks)
        self._step.sends.append(
            SendSpec(
                req_id,
                entry.room,
                tuple(entry.blocks[:num_pages]),
                state_slots=state_slots(entry.state_blocks, self.state_scratch_blocks),
                swa_pages=window,
                stream=True,
            )
        )
        self._streamed[req_id] = (entry.room, num_pages)

    # -- both ------------------------------------------------------------------------
    def build_step(self) -> StepSpecs:
        step, self._step = self._step, StepSpecs()
        return step

    def request_finished(
        self,
        request: Any,
        block_ids: list[int],
        length_capped: bool,
        swa_block_ids: Sequence[int] = (),
        state_block_ids: Sequence[Sequence[int]] = (),
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._local_tokens.pop(req_id, None)
        self._prefilling.pop(req_id, None)
        if req_id in self._streamed:  # its blocks are being read: held until the room ends
            room, num_pages = self._streamed.pop(req_id)
            self._sending[req_id] = room
            if kvparams.wants_remote_decode(request.kv_transfer_params) and length_capped:
                return True, self._decode_params(request, room, num_pages)
            self._abort_streamed(req_id, room)
            return True, None
        if req_id in self._loading:
            # decode: a write may still land in these blocks until the room is drained
            self._step.aborts.append(AbortSpec(req_id, self._loading[req_id]))
            return True, None
        params = request.kv_transfer_params
        if kvparams.wants_remote_prefill(params):
            self._abandon(request)
            return False, None
        if not kvparams.wants_remote_decode(params) or not length_capped:
            return False, None
        prompt_len = full_prompt_len(request)
        num_pages = pages_to_send(prompt_len, self.block_size)
        if num_pages == 0 or len(block_ids) < num_pages:
            return False, None
        room = kvparams.room_for(req_id, params)
        _, window = self._window(prompt_len, swa_block_ids)
        slots = state_slots(state_block_ids, self.state_scratch_blocks)
        self._step.sends.append(
            SendSpec(req_id, room, tuple(block_ids[:num_pages]), state_slots=slots, swa_pages=window)
        )
        self._sending[req_id] = room
        return True, self._decode_params(request, room, num_pages)

    def _decode_params(self, request: Any, room: int, num_pages: int) -> dict[str, Any]:
        # the whole prompt's: a hybrid prefill computed one token less (hybrid_state)
        tokens = accounting.tokens_loaded(full_prompt_len(request))
        return kvparams.decode_params(room, self.bootstrap_addr, num_pages, tokens)

    def _abandon(self, request: Any) -> None:
        """Decode: the request ended before it claimed its room (aborted while it queued, or
        its whole prompt was in the prefix cache): the prefill instance is told, and frees
        the room's blocks now rather than at its wait for a claim."""
        parsed = kvparams.parse_remote_prefill(request.kv_transfer_params)
        if isinstance(parsed, str):
            return  # no room to name: prefill's waits for its claim
        status = getattr(getattr(request, "status", None), "name", "finished").lower()
        why = f"request {request.request_id} ended on decode ({status}) before its claim"
        log.info("room %d: %s; prefill is told", parsed.room, why)
        self._step.abandons.append(AbandonSpec(request.request_id, parsed.room, parsed.bootstrap_addr, why))

    def _abort_streamed(self, req_id: str, room: int) -> None:
        """A streamed request ended without its one token: no decode will claim the room.

        Its workers abort it at their sidecars now (a decode that claims it
        anyway fails at once), so the blocks return as soon as the room ended,
        not after the sidecar's wait for an unclaimed room.
        """
        log.warning("request %s finished without its one token; room %d is aborted", req_id, room)
        self._step.aborts.append(AbortSpec(req_id, room))

    def update_connector_output(self, finished_sending, finished_recving) -> None:
        for req_id in finished_sending or ():
            self._sending.pop(req_id, None)
        for req_id in finished_recving or ():
            self._loading.pop(req_id, None)

    def _window(self, prompt_len: int, swa_block_ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """(first position, blocks) of the window's pages among a request's sliding-window blocks."""
        if self.sliding_window is None:
            return 0, ()
        first = first_window_page(prompt_len, self.block_size, self.sliding_window)
        return first, tuple(list(swa_block_ids)[first : pages_to_send(prompt_len, self.block_size)])
