"""The connector's worker side: register the KV cache, send and expect rooms, report what finished.

One instance per vLLM worker process (one TP rank), talking to that rank's
sidecar through the blocking :class:`~pd_transfer.client.Client`. Each step
vLLM calls, in order: :meth:`WorkerSide.start_step` (the scheduler's
:class:`StepSpecs`), then :meth:`finished` and :meth:`load_errors`.

- prefill: a streamed :class:`SendSpec` (the step that completes the
  prompt) calls ``send(stream=True)`` before the forward pass; as vLLM saves
  each layer (:meth:`WorkerSide.save_layer`) its blocks are staged (CPU) and
  the layer announced with ``layer_ready``, and :meth:`WorkerSide.end_step`
  announces the layers the pass did not save (Mamba/GDN state, a layer
  without a save hook). A SendSpec that is not streamed stages every layer
  and sends at once. The request is reported in ``finished_sending`` once
  the room is terminal (sent, or failed: the reason is logged) and vLLM has
  told this worker the request finished;
- decode: a :class:`RecvSpec` calls ``expect``; on Success the pages are
  unstaged into vLLM's blocks and the request reported in
  ``finished_recving``. A failed or refused room is reported finished AND its
  blocks returned by :meth:`load_errors` in the same pass, so vLLM never
  decodes from KV that did not arrive;
- an :class:`AbandonSpec` (decode: a room the request gave up before its
  claim) tells the sidecar, which tells the prefill instance;
- an :class:`AbortSpec` aborts the room; on decode the request is reported
  finished (its blocks freed) only once the sidecar answers drained or the
  room is terminal, so no late write lands in a reused block; on prefill (a
  streamed request that ended without its token) the room ends at once and
  its blocks are reported sent.

Imports torch, the client and this package's pure modules; never vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pd_transfer.client import Client, ClientError
from pd_transfer.client.status import RoomState
from pd_transfer.integrations.vllm.memory import KvMemory
from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec, StepSpecs
from pd_transfer.integrations.vllm.staging import Blocks, DirectPages, StagedPages
from pd_transfer.layout.views import Pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


class WorkerSide:
    """See the module docstring. ``client`` is this rank's connection to its sidecar."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.pages: StagedPages | DirectPages | None = None
        self._sending: dict[str, SendSpec] = {}
        self._streaming: dict[str, set[int]] = {}  # req id -> layers still to announce this step
        self._layer_ids: dict[str, int] = {}  # vLLM layer name -> layer id
        self._state_layers: set[str] = set()  # the registered Mamba/GDN layers
        self._receiving: dict[str, RecvSpec] = {}
        self._draining: dict[str, int] = {}  # aborted req id -> room
        self._finished_reqs: set[str] = set()  # vLLM's finished_req_ids, seen so far
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # failed receives not yet reported
        self.failures: dict[str, str] = {}  # req id -> why its transfer failed (kept for logs)

    def register(self, memory: KvMemory, owner_id: str, *, timeout_s: float | None = None) -> None:
        on_gpu = next(iter(memory.storages.values())).is_cuda
        self.pages = DirectPages(memory) if on_gpu else StagedPages(memory, owner_id)
        self._layer_ids = {layer.name: layer.layer_id for layer in memory.layers}
        self._state_layers = {layer.name for layer in memory.layers if layer.pool is Pool.MAMBA}
        self.client.register(memory.geometry, self.pages.handles, timeout_s=timeout_s)

    # -- per step ------------------------------------------------------------------
    def start_step(self, step: StepSpecs) -> None:
        for send in step.sends:
            self._send(send)
        for recv in step.recvs:
            self._expect(recv)
        for abort in step.aborts:
            self._abort(abort.req_id, abort.room)
        for abandon in step.abandons:
            self._abandon(abandon.req_id, abandon.room, abandon.bootstrap_addr, abandon.reason)

    def save_layer(self, layer_name: str) -> None:
        """The forward pass wrote ``layer_name``: hand it to the sidecar for every streamed room.

        A state layer waits for :meth:`end_step`: its view also carries the
        layers of the other state groups at its position (:mod:`.cache_groups`),
        which the pass may compute later.
        """
        layer_id = self._layer_ids.get(layer_name)
        if layer_id is None or layer_name in self._state_layers:
            return
        for req_id, pending in list(self._streaming.items()):
            if layer_id in pending:
                pending.discard(layer_id)
                self._announce(req_id, layer_id)

    def end_step(self) -> None:
        """After the forward pass: announce every layer of this step's streamed rooms not yet saved."""
        streaming, self._streaming = self._streaming, {}
        for req_id, pending in streaming.items():
            for layer_id in sorted(pending):
                if not self._announce(req_id, layer_id):
                    break

    def finished(self, finished_req_ids: set[str]) -> TransferResults:
        """What finished since the last call (see the module docstring)."""
        self._finished_reqs |= set(finished_req_ids)
        sending = {
            req_id
            for req_id, spec in self._sending.items()
            if req_id in self._finished_reqs and self._terminal(req_id, spec.room)
        }
        for req_id in sending:
            del self._sending[req_id]
            self._finished_reqs.discard(req_id)
        recving, failed = set(), self._failed_now
        self._failed_now = set()
        for req_id, spec in list(self._receiving.items()):
            state = self._poll(req_id, spec.room)
            if state is not None and not state.is_terminal:
                continue
            del self._receiving[req_id]
            if state is not None and state.succeeded:
                local_swa = max(0, spec.num_local_blocks - spec.swa_first)
                self._pages.unstage(
                    {
                        Pool.KV: spec.block_ids[spec.num_local_blocks :],
                        Pool.SWA: spec.swa_pages[local_swa:],
                        Pool.MAMBA: spec.state_slots,
                    }
                )
            else:  # failed, or the sidecar could not say: never decode from these blocks
                self._fail(spec, f"room {spec.room}: {self.failures.get(req_id, 'no status')}")
                failed.add(req_id)
            recving.add(req_id)
        for req_id, room in list(self._draining.items()):
            if self._terminal(req_id, room):
                del self._draining[req_id]
                recving.add(req_id)
        recving |= failed
        return TransferResults(sending, recving, failed)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
        self.client.close()

    # -- plumbing ------------------------------------------------------------------
    @property
    def _pages(self) -> StagedPages | DirectPages:
        if self.pages is None:
            raise RuntimeError("a transfer before the connector registered its KV caches")
        return self.pages

    def _send(self, spec: SendSpec) -> None:
        self._sending[spec.req_id] = spec
        try:
            if not spec.stream:
                self._pages.stage(_blocks(spec))
            self.client.send(
                spec.room,
                list(spec.block_ids),
                state_slots=list(spec.state_slots),
                swa_pages=list(spec.swa_pages),
                last_chunk=True,
                stream=spec.stream,
            )
        except ClientError as err:
            self._send_failed(spec, err)
            return
        if spec.stream:
            self._streaming[spec.req_id] = set(self._layer_ids.values())

    def _announce(self, req_id: str, layer_id: int) -> bool:
        """Stage one layer of a streamed room and tell the sidecar it is written; False on failure."""
        spec = self._sending.get(req_id)
        if spec is None or req_id in self.failures:
            return False
        try:
            self._pages.stage(_blocks(spec), layer_id=layer_id)
            self.client.layer_ready(spec.room, layer_id)
        except ClientError as err:
            self._streaming.pop(req_id, None)
            self._send_failed(spec, err)
            return False
        return True

    def _send_failed(self, spec: SendSpec, err: ClientError) -> None:
        self.failures[spec.req_id] = str(err)
        log.error(
            "request %s: send of room %d failed, its blocks are released: %s", spec.req_id, spec.room, err
        )

    def _expect(self, spec: RecvSpec) -> None:
        if spec.error:
            self._fail(spec, spec.error)
            self._failed_now.add(spec.req_id)
            if spec.bootstrap_addr:  # the room is named: prefill need not wait for a claim
                self._abandon(spec.req_id, spec.room, spec.bootstrap_addr, spec.error)
            return
        try:
            self.client.expect(
                spec.room,
                spec.bootstrap_addr,
                list(spec.block_ids),
                state_slots=list(spec.state_slots),
                swa_pages=list(spec.swa_pages),
                held_pages=min(spec.num_local_blocks, len(spec.block_ids)),
            )
        except ClientError as err:
            self._fail(spec, f"room {spec.room}: expect refused: {err}")
            self._failed_now.add(spec.req_id)
            return
        self._receiving[spec.req_id] = spec

    def _abort(self, req_id: str, room: int) -> None:
        if req_id in self._sending:
            self._abort_send(req_id, room)
            return
        spec = self._receiving.pop(req_id, None)
        if spec is None:
            return  # finished (or failed) before the abort arrived: already reported
        try:
            drained = self.client.abort(room)
        except ClientError as err:
            log.warning(
                "request %s: abort of room %d failed (%s); waiting for the room to end", req_id, room, err
            )
            drained = False
        if drained:
            self._failed_now.discard(req_id)
            self._draining[req_id] = -1  # reported at the next pass
        else:
            self._draining[req_id] = room

    def _abandon(self, req_id: str, room: int, bootstrap_addr: str, reason: str) -> None:
        """Decode: this room will never be expected; the sidecar tells its prefill instance."""
        try:
            self.client.abandon(room, bootstrap_addr, reason)
        except ClientError as err:  # prefill's room then ends at its own wait for a claim
            log.warning("request %s: room %d could not be abandoned: %s", req_id, room, err)

    def _abort_send(self, req_id: str, room: int) -> None:
        """Prefill: the request ended without its token; end its room now (a claim fails at once)."""
        self._streaming.pop(req_id, None)
        try:
            self.client.abort(room)
        except ClientError as err:
            log.warning(
                "request %s: abort of room %d failed (%s); waiting for the room to end", req_id, room, err
            )
            return
        self.failures[req_id] = f"room {room} aborted: the request ended without its one token"

    def _fail(self, spec: RecvSpec, reason: str) -> None:
        self.failures[spec.req_id] = reason
        self._load_errors |= set(spec.block_ids) | set(spec.state_slots) | set(spec.swa_pages)
        log.error(
            "request %s: KV load failed, %d blocks reported to vLLM: %s",
            spec.req_id,
            len(spec.block_ids),
            reason,
        )

    def _terminal(self, req_id: str, room: int) -> bool:
        if room < 0:
            return True
        if req_id in self.failures and req_id in self._sending:
            return True  # the send itself was refused: nothing in flight
        state = self._poll(req_id, room)
        return state is None or state.is_terminal

    def _poll(self, req_id: str, room: int) -> RoomState | None:
        """The room's state, or None when the sidecar cannot tell (logged; treated as ended)."""
        try:
            state = self.client.poll(room)
        except ClientError as err:
            self.failures[req_id] = str(err)
            log.error("request %s: poll of room %d failed: %s", req_id, room, err)
            return None
        if state.failed and req_id not in self.failures:
            self.failures[req_id] = state.describe()
            if req_id in self._sending:  # a failed receive is logged by _fail
                log.error(
                    "request %s: room %d failed, its blocks are released: %s", req_id, room, state.describe()
                )
        return state


def _blocks(spec: SendSpec | RecvSpec) -> Blocks:
    return {Pool.KV: spec.block_ids, Pool.SWA: spec.swa_pages, Pool.MAMBA: spec.state_slots}
