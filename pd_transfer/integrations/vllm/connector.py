"""``PdTransferConnector``: vLLM's ``KVConnectorBase_V1`` (and ``SupportsHMA``) over pd-transfer.

vLLM builds one instance with role SCHEDULER in its engine-core process and
one with role WORKER in each worker process; they share only the
:class:`PdTransferConnectorMetadata` vLLM passes each step. This module only
translates between vLLM's objects and :mod:`.scheduler_side` /
:mod:`.worker_side`, which hold the logic; :mod:`.settings` refuses the
vLLM settings it does not support, :mod:`.cache_groups` picks the KV-cache
groups it moves (several Mamba/GDN groups through one group's layers), and
:mod:`.hybrid_state` says which blocks hold a request's Mamba state and who
computes the last prompt token. The connector describes memory and
the request lifecycle; matching TP sizes, MLA and layouts between prefill and
decode is the sidecars' verdict, made before any traffic.

``kv_connector_extra_config`` keys:

    worker_endpoint    (workers, required) this rank's sidecar, e.g.
                       "unix:///run/pd/decode-tp{tp_rank}.sock" ({tp_rank} and
                       {dp_rank} are filled in)
    bootstrap_addr     (prefill scheduler, required) the prefill instance's bootstrap
                       address, returned to the router for decode ({dp_rank} is filled in)
    secret_file        the sidecar's shared secret, if it requires one
    timeout_s          reply timeout of each sidecar call (default 10)
    register_timeout_s how long registration waits for the sidecar (default 60)

Imports vLLM: loaded only by ``kv_connector_module_path``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from pd_transfer.client import Client
from pd_transfer.errors import ConfigError
from pd_transfer.integrations.vllm import settings
from pd_transfer.integrations.vllm.cache_groups import cache_groups
from pd_transfer.integrations.vllm.hybrid_state import drop_last_prompt_token
from pd_transfer.integrations.vllm.memory import describe_kv_caches
from pd_transfer.integrations.vllm.scheduler_side import SchedulerSide
from pd_transfer.integrations.vllm.specs import StepSpecs
from pd_transfer.integrations.vllm.worker_side import WorkerSide
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool

log = logging.getLogger(__name__)

_ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}


@dataclass
class PdTransferConnectorMetadata(KVConnectorMetadata):
    """One step's sends, receives and aborts, from the scheduler to every worker."""

    step: StepSpecs = field(default_factory=StepSpecs)


class PdTransferConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        self._extra = dict(config.kv_connector_extra_config or {})
        pd_role = _ROLES.get(config.kv_role)
        if pd_role is None:
            raise ConfigError(
                f"kv_transfer_config.kv_role is {config.kv_role!r}; the pd-transfer connector "
                f"runs as 'kv_producer' (prefill) or 'kv_consumer' (decode)"
            )
        self._pd_role = pd_role
        settings.refuse_unsupported(vllm_config, self._extra, prefill=pd_role is Role.PREFILL)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._groups = cache_groups(kv_cache_config, tp_size)
        self._specs = self._groups.specs
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            bootstrap = settings.fill_placeholders(
                str(self._extra.get("bootstrap_addr", "")), tp_rank=0, dp_rank=settings.dp_rank(vllm_config)
            )
            if self._pd_role is Role.PREFILL and not (
                isinstance(bootstrap, str) and bootstrap.startswith("tcp://")
            ):
                raise ConfigError(
                    f"kv_connector_extra_config.bootstrap_addr is {bootstrap!r}; a prefill "
                    f"instance needs its sidecars' bootstrap address 'tcp://host:port'"
                )
            specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
            block_size = specs[self._groups.kv_group].block_size
            swa = self._groups.first(Pool.SWA)
            window = specs[swa].sliding_window if swa is not None else None
            mamba = self._groups.first(Pool.MAMBA)
            self._scheduler = SchedulerSide(
                block_size=block_size,
                bootstrap_addr=bootstrap,
                sliding_window=window,
                state_scratch_blocks=specs[mamba].num_speculative_blocks if mamba is not None else 0,
            )

    # -- scheduler side ---------------------------------------------------------------
    @property
    def _side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker's pd-transfer connector")
        return self._scheduler

    def on_new_request(self, request) -> None:
        """Prefill of a model with a Mamba group: decode computes the last prompt token (see .hybrid_state)."""
        if self._pd_role is Role.PREFILL and Pool.MAMBA in self._groups.pools:
            drop_last_prompt_token(request)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A load writes every group pd-transfer moves (attention pages, window pages, every state group)."""
        return tuple(sorted(g for groups in self._groups.pools.values() for g in groups))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids() if num_external_tokens > 0 else None
        self._side.update_state_after_alloc(
            request,
            self._ids(ids, Pool.KV),
            num_external_tokens,
            self._ids(ids, Pool.SWA),
            self._groups.state_ids(ids),
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._side.scheduled(
                new.req_id,
                self._ids(new.block_ids, Pool.KV),
                True,
                new.num_computed_tokens,
                scheduled.get(new.req_id, 0),
                self._ids(new.block_ids, Pool.SWA),
                self._groups.state_ids(new.block_ids),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            self._side.scheduled(
                req_id,
                self._ids(new_ids, Pool.KV),
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i],
                scheduled.get(req_id, 0),
                self._ids(new_ids, Pool.SWA),
                self._groups.state_ids(new_ids),
            )
        return PdTransferConnectorMetadata(self._side.build_step())

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        capped = request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        return self._side.request_finished(request, list(block_ids), capped)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        capped = request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        return self._side.request_finished(
            request,
            self._ids(block_ids, Pool.KV),
            capped,
            self._ids(block_ids, Pool.SWA),
            self._groups.state_ids(block_ids),
        )

    def _ids(self, per_group, pool: Pool) -> list[int]:
        """The KV or SWA pool's block ids out of vLLM's per-group tuple (empty without either)."""
        return self._groups.ids(per_group, pool)

    def update_connector_output(self, connector_output) -> None:
        self._side.update_connector_output(
            connector_output.finished_sending, connector_output.finished_recving
        )

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        tp_size, tp_rank = settings.tp_position(self._vllm_config)
        endpoint = self._extra.get("worker_endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(
                "kv_connector_extra_config.worker_endpoint is missing: give each rank's "
                "sidecar, e.g. 'unix:///run/pd/decode-tp{tp_rank}.sock'"
            )
        endpoint = settings.fill_placeholders(
            endpoint, tp_rank=tp_rank, dp_rank=settings.dp_rank(self._vllm_config)
        )
        self._groups.check_state_aliases(kv_caches)
        memory = describe_kv_caches(
            {name: t for name, t in kv_caches.items() if name in self._specs},
            self._specs,
            role=self._pd_role,
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_kv_heads=self._vllm_config.model_config.get_total_num_kv_heads(),
            model=str(self._vllm_config.model_config.model),
        )
        worker_id = f"vllm-{self._pd_role.value}-tp{tp_rank}"
        client = Client(
            endpoint,
            worker_id,
            timeout_s=float(self._extra.get("timeout_s", 10.0)),
            secret_file=str(self._extra.get("secret_file", "")),
        )
        self._worker = WorkerSide(client)
        self._worker.register(
            memory, f"{worker_id}-{os.getpid()}", timeout_s=float(self._extra.get("register_timeout_s", 60.0))
        )
        log.info(
            "pd-transfer connector: %s registered %d layers in %d regions with %s",
            memory.geometry.rank_id,
            len(memory.layers),
            len(memory.storages),
            endpoint,
        )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_step(self._get_connector_metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request runs only after its whole KV arrived."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """The layer is written: the sidecar may move it for this step's streamed rooms."""
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Announce the streamed rooms' remaining layers; the copies run on, blocks held until reported."""
        if self._worker is not None:
            self._worker.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        results = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(
            results.finished_sending, results.finished_recving, results.failed_recving
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """A failed receive's blocks, reported in the same pass as the request in ``failed_recving``.

        Only with one KV-cache group: vLLM's block ids are unique per group, and
        its scheduler refuses (RuntimeError) block-level errors for a model with
        several groups; ``failed_recving`` alone then fails or recomputes the request.
        """
        errors = self._worker.load_errors() if self._worker is not None else set()
        return errors if len(self._kv_cache_config.kv_cache_groups) == 1 else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
