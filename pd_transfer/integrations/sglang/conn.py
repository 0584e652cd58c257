"""SGLang's transfer-backend classes, on top of pd-transfer's client.

SGLang builds one :class:`PdTransferKVManager` per scheduler rank, one
:class:`PdTransferKVSender` per request on prefill and one
:class:`PdTransferKVReceiver` per request on decode (the interface of
``sglang.srt.disaggregation.base.conn``). Each call maps onto one client call
to this rank's sidecar; the sidecars resolve peers, agree on the verdict and
move the bytes:

    manager          register this rank's pools (once)
    sender.send      client.send per chunk; state slots, SWA pages and the aux row with the last
    receiver         send_metadata -> client.expect
    poll             client.poll, as KVPoll (monotonic; Failed is sticky)
    failure_exception  KVTransferError with pd-transfer's reason code and whole text
    abort            client.abort; is_abort_release_safe is True only once the sidecar drained

Calls run on the scheduler thread, one client per manager. Configuration
comes from the environment (:class:`~.settings.BackendSettings`).
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

from pd_transfer.client import Client, ClientError, Refused, RoomState, RoomStatus
from pd_transfer.errors import ConfigError, Reason
from pd_transfer.integrations.sglang.dp_routing import bootstrap_address
from pd_transfer.integrations.sglang.facts import EngineFacts
from pd_transfer.integrations.sglang.memory import EngineMemory
from pd_transfer.integrations.sglang.registration import describe_rank
from pd_transfer.integrations.sglang.settings import BackendSettings, deferred_release_enabled
from pd_transfer.layout.geometry import Role

log = logging.getLogger(__name__)

# Set around SGLang's _init_kv_manager by the plugin's hook (or by a caller that
# builds the manager itself): the pool tensors and model facts kv_args lacks.
ENGINE_MEMORY: contextvars.ContextVar[tuple[EngineMemory, EngineFacts] | None] = contextvars.ContextVar(
    "pd_transfer_sglang_engine_memory", default=None
)

# a receiver whose doorbell is still open asks its sidecar this often all the same
# (a sidecar that died closes no slot); in between, a poll is a memory read
ASK_EVERY_S = 0.05

_POLL = {
    RoomStatus.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RoomStatus.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    RoomStatus.TRANSFERRING: KVPoll.Transferring,
    RoomStatus.SUCCESS: KVPoll.Success,
    RoomStatus.FAILED: KVPoll.Failed,
}


class PdTransferKVManager(BaseKVManager):
    """One scheduler rank's registration with its sidecar, and the client its rooms share."""

    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        context = ENGINE_MEMORY.get()
        if context is None:
            raise ConfigError(
                "pd_transfer's SGLang backend was built without its pool tensors",
                hint="install pd-transfer[sglang] so SGLang loads its plugin "
                "(sglang.srt.plugins entry point), or set SGLANG_PLUGINS to include it",
            )
        self.memory, self.facts = context
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla = bool(is_mla_backend)
        self.settings = BackendSettings.from_environ()
        self.state_types = [getattr(t, "value", t) for t in (getattr(args, "state_types", None) or [])]
        role = Role.PREFILL if disaggregation_mode == DisaggregationMode.PREFILL else Role.DECODE
        self.role = role
        # per prefill address, the DP layout SGLang's decode queue routes requests by
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        # SGLang holds a failed or aborted room's pages until is_abort_release_safe (its
        # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE switch); answered by the sidecar's drain
        self.enable_deferred_decode_kv_release = deferred_release_enabled()
        self.deferred: dict[int, PdTransferKVReceiver] = {}
        self.geometry = describe_rank(args, self.memory, self.facts, role)
        self.worker_id = f"sglang-{role.value}-pp{args.pp_rank}-tp{args.engine_rank}"
        self.client = Client(
            self.settings.endpoint_for(args, self.facts.dp_rank),
            self.worker_id,
            timeout_s=self.settings.call_timeout_s,
        )
        try:  # a start that fails leaves no connection (socket, doorbell mapping) behind
            # only the regions a view uses (not a device pool a host pool replaces)
            handles = self.memory.handles
            handles = {region.id: handles[region.id] for region in self.geometry.regions}
            self.client.register(
                self.geometry, handles, pp_size=self.facts.pp_size, timeout_s=self.settings.register_timeout_s
            )
        except BaseException:
            self.client.close()
            raise
        log.info(
            "pd-transfer: %s registered %d views with its sidecar",
            self.geometry.rank_id,
            len(self.geometry.views),
        )

    def register_to_bootstrap(self) -> None:
        """Nothing to do: prefill rank 0's sidecar serves the bootstrap."""

    def bootstrap_address(self, sglang_addr: str, prefill_dp_rank: int = 0) -> str:
        """pd-transfer's bootstrap address of prefill DP group ``prefill_dp_rank`` behind
        SGLang's ``host:port`` (see :mod:`.dp_routing`)."""
        return bootstrap_address(sglang_addr, self.settings.bootstrap_port, prefill_dp_rank)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode queue asks once per prefill address before it routes a request:
        the prefill instances' DP size (``PD_TRANSFER_SGLANG_PREFILL_DP_SIZE``), their
        requests placed by ``bootstrap_room`` (prefill refuses other placements at start)."""
        if bootstrap_addr not in self.prefill_info_table:
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=0,  # not known here and not needed: the sidecars reconcile TP sizes
                attn_cp_size=1,
                dp_size=self.settings.prefill_dp_size,
                pp_size=1,
                page_size=None,
                kv_cache_dtype=None,
                follow_bootstrap_room=True,
            )
        return True

    def split_state(self, state_indices: Any) -> tuple[list[int], list[int]]:
        """SGLang's per-component state indices as (state slots, SWA pages)."""
        slots: list[int] = []
        swa: list[int] = []
        for kind, indices in zip(self.state_types, state_indices or []):
            values = [int(i) for i in (indices if indices is not None else [])]
            (slots if kind == "mamba" else swa).extend(values)
        return slots, swa

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """SGLang's deferred release: True once the sidecar drained the room (``required_acks`` unused)."""
        receiver = self.deferred.get(int(bootstrap_room))
        return receiver is None or receiver.is_abort_release_safe()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self.deferred.pop(int(bootstrap_room), None)

    def close(self) -> None:
        self.client.close()


class _Room:
    """What the sender and the receiver share: the room, its client and its last state."""

    def __init__(self, mgr: PdTransferKVManager, bootstrap_addr: str, bootstrap_room: int) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.state: RoomState | None = None
        self.failure: str = ""
        self.created_s = time.monotonic()
        self.asked_s = 0.0

    def _poll_room(self, before_known: int) -> int:
        if self.failure:
            return KVPoll.Failed
        if self.state is not None and self.state.is_terminal:
            return _POLL[self.state.status]
        self.asked_s = time.monotonic()
        try:
            self.state = self.mgr.client.poll(self.room)
        except Refused as err:
            if err.code is Reason.UNKNOWN_ROOM:
                return self._not_yet_known(before_known)
            return self._fail(f"[{err.code_text}] {err.reason}")
        except ClientError as err:
            return self._fail(f"[{err.code_text}] pd-transfer sidecar: {err}")
        if self.state.failed:
            self.failure = f"[{self.state.code_text or 'unknown'}] {self.state.reason}"
        return _POLL[self.state.status]

    def _not_yet_known(self, before_known: int) -> int:
        waited = time.monotonic() - self.created_s
        if waited > self.mgr.settings.bootstrap_timeout_s:
            return self._fail(
                f"[timeout] room {self.room} was not bootstrapped within "
                f"{self.mgr.settings.bootstrap_timeout_s:g} s"
            )
        return before_known

    def _fail(self, text: str) -> int:
        self.failure = self.failure or text
        return KVPoll.Failed

    def failure_exception(self) -> None:
        raise KVTransferError(self.room, self.failure or "pd-transfer: the room failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()


class PdTransferKVSender(_Room, BaseKVSender):
    """Prefill: one request's pages, sent per chunk through the sidecar."""

    def __init__(
        self,
        mgr: PdTransferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        _Room.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages_sent = 0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None) -> None:
        if self.num_pages is None:
            raise RuntimeError(f"room {self.room}: send before init")
        pages = [int(p) for p in kv_indices]
        self.pages_sent += len(pages)
        last = self.pages_sent >= self.num_pages
        slots, swa = self.mgr.split_state(state_indices) if last else ([], [])
        try:
            self.mgr.client.send(
                self.room,
                pages,
                state_slots=slots,
                swa_pages=swa,
                aux_row=self.aux_index if last else None,
                last_chunk=last,
            )
        except ClientError as err:
            self._fail(f"[{err.code_text}] {err.reason if isinstance(err, Refused) else err}")

    def poll(self) -> int:
        return self._poll_room(KVPoll.Bootstrapping)

    def abort(self) -> None:
        try:
            self.mgr.client.abort(self.room)
        except ClientError as err:
            log.warning("room %d: abort: %s", self.room, err)
        self._fail("[aborted] aborted by the prefill scheduler")


class PdTransferKVReceiver(_Room, BaseKVReceiver):
    """Decode: one request's destination pages, announced to the sidecar with expect."""

    def __init__(
        self, mgr: PdTransferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        _Room.__init__(self, mgr, bootstrap_addr, bootstrap_room or 0)
        self.expected = False
        self.drained = False
        self.aborted = False
        self.abort_notified = False
        self.bootstrap_infos = [bootstrap_addr]  # SGLang counts one acknowledgement per entry
        self.prefill_dp_rank = 0

    @property
    def kv_mgr(self) -> PdTransferKVManager:
        """The manager, under the name SGLang's decode queues use."""
        return self.mgr

    def init(self, prefill_dp_rank: int) -> None:
        """The prefill DP group SGLang resolved for the request; its sidecars are asked at expect."""
        groups = self.mgr.settings.prefill_dp_size
        if not 0 <= int(prefill_dp_rank) < groups:
            self._fail(
                f"[invalid_config] room {self.room}: prefill DP rank {prefill_dp_rank} is not one "
                f"of the {groups} DP groups PD_TRANSFER_SGLANG_PREFILL_DP_SIZE declares"
            )
            return
        self.prefill_dp_rank = int(prefill_dp_rank)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        if self.failure:
            return
        if decode_prefix_len:
            self._fail(
                "[layout_unsupported] a decode-side prefix hit (decode_prefix_len "
                f"{decode_prefix_len}) is not supported by pd-transfer's SGLang backend"
            )
            return
        slots, swa = self.mgr.split_state(state_indices)
        try:
            self.mgr.client.expect(
                self.room,
                self.mgr.bootstrap_address(self.bootstrap_addr, self.prefill_dp_rank),
                [int(p) for p in kv_indices],
                state_slots=slots,
                swa_pages=swa,
                aux_row=None if aux_index is None else int(aux_index),
            )
            self.expected = True
        except ClientError as err:
            self._fail(f"[{err.code_text}] {err.reason if isinstance(err, Refused) else err}")

    def poll(self) -> int:
        if not self.expected and not self.failure:
            return KVPoll.WaitingForInput
        if not self.failure and (self.state is None or not self.state.is_terminal):
            rang = self.mgr.client.rang(self.room)
            if rang:
                self.state = RoomState(RoomStatus.SUCCESS)
            elif rang is False and time.monotonic() - self.asked_s < ASK_EVERY_S:
                return _POLL[self.state.status] if self.state is not None else KVPoll.WaitingForInput
        return self._poll_room(KVPoll.WaitingForInput)

    def abort(self) -> None:
        self.aborted = True
        self.ensure_abort_notified()
        self._fail("[aborted] aborted by the decode scheduler")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's failed-transfer path: tell the sidecar the room is over; the pages
        are released once :meth:`is_abort_release_safe` (the drain) says so."""
        if self.abort_notified:
            return
        self.abort_notified = True
        self.mgr.deferred[self.room] = self
        self._abort()

    def _abort(self) -> None:
        if not self.expected:
            self.drained = True
            return
        try:
            self.drained = self.mgr.client.abort(self.room)
        except ClientError as err:
            log.warning("room %d: abort: %s", self.room, err)

    def is_abort_release_safe(self) -> bool:
        """True once no write of this room can land any more (the sidecar drained it)."""
        if not self.drained:
            self._abort()
        return self.drained


class PdTransferKVBootstrapServer(BaseKVBootstrapServer):
    """Binds nothing: prefill rank 0's sidecar serves pd-transfer's bootstrap.

    SGLang starts one bootstrap server per prefill instance on
    ``--disaggregation-bootstrap-port``; with this backend the sidecar of
    prefill rank 0 listens there (or on ``PD_TRANSFER_SGLANG_BOOTSTRAP_PORT``).
    """

    def __init__(self, host: str, port: int, *args: Any, **kwargs: Any) -> None:
        self.host, self.port = host, port
        log.info(
            "pd-transfer: bootstrap for this prefill instance is served by prefill rank 0's sidecar at %s:%s",
            host,
            port,
        )

    def run(self) -> None:
        """Nothing to serve."""

    def close(self) -> None:
        """Nothing to stop."""
