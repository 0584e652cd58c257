"""The simulated decode engine: expect rooms, wait for them, verify every byte.

One task per window slot runs that slot's requests in turn: ``expect`` (the
destination pages, state slot and aux row), ``wait`` until the room is
terminal, then check the destination bytes this rank holds against
:mod:`pd_transfer.sim.content`. So at most ``window`` rooms are in flight and
a slot's pages are reused only once the previous room on them is finished
and checked. The latency of a room is measured from ``expect`` to the reply
that says it succeeded.

A room that failed, or is still not terminal after ``room_timeout_s``
(counted as failed, status ``timeout``), is aborted; its slot is reused only
if the abort reports the pages drained (fail closed: otherwise the slot is
retired and its later requests fail with a reason naming the room).

A refused call (:class:`~pd_transfer.client.Refused`) fails its room; any
other client error (no reply, the sidecar gone) ends the run with it.

Asyncio: uses :class:`pd_transfer.client.AsyncClient`. The byte check runs in
``asyncio.to_thread``: it is numpy work that releases the GIL, and running it
on the loop would delay the replies of the other rooms and so inflate their
measured latency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import numpy as np

from pd_transfer.client import AsyncClient, ClientError, Refused
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import Pool
from pd_transfer.sim.bookkeeping import (
    EngineOptions,
    ProgressLog,
    call_args,
    own_indices,
    refused_outcome,
    state_outcome,
)
from pd_transfer.sim.content import verify_destination
from pd_transfer.sim.report import RoomOutcome, WorkerReport
from pd_transfer.sim.schedule import ScheduledRequest

log = logging.getLogger(__name__)


async def run_decode(
    client: AsyncClient,
    geometry: RankGeometry,
    arrays: Mapping[str, np.ndarray],
    schedule: list[ScheduledRequest],
    options: EngineOptions,
    report: WorkerReport,
) -> None:
    """Expect and verify every request of ``schedule``, one task per window slot."""
    progress = ProgressLog(geometry.rank_id, report, options.progress_path)
    by_slot: dict[int, list[ScheduledRequest]] = {}
    for request in schedule:
        by_slot.setdefault(request.window_slot, []).append(request)
    try:
        async with asyncio.TaskGroup() as group:
            for requests in by_slot.values():
                group.create_task(_run_slot(client, geometry, arrays, requests, options, progress))
    except* ClientError as group:
        # the sidecar is gone (timeout, closed, garbled): one error says it, not a group
        raise group.exceptions[0] from None


async def _run_slot(
    client: AsyncClient,
    geometry: RankGeometry,
    arrays: Mapping[str, np.ndarray],
    requests: list[ScheduledRequest],
    options: EngineOptions,
    progress: ProgressLog,
) -> None:
    retired_by: RoomOutcome | None = None
    for request in requests:
        if retired_by is not None:
            progress.record(
                RoomOutcome(
                    request.index,
                    request.room,
                    "failed",
                    "aborted",
                    f"not started: room {retired_by.room} on the same pages ended "
                    f"{retired_by.status} and its abort did not confirm the pages drained",
                )
            )
            continue
        outcome, drained = await _run_room(client, geometry, arrays, request, options)
        progress.record(outcome)
        if not drained:
            retired_by = outcome


async def _run_room(
    client: AsyncClient,
    geometry: RankGeometry,
    arrays: Mapping[str, np.ndarray],
    request: ScheduledRequest,
    options: EngineOptions,
) -> tuple[RoomOutcome, bool]:
    """One room from expect to verified; the outcome and whether its pages are free again."""
    indices = own_indices(geometry, request)
    empty = np.empty(0, np.int64)
    started = time.monotonic()
    try:
        await client.expect(
            request.room,
            options.bootstrap_addr,
            indices.get(Pool.KV, (empty, empty))[1],
            **call_args(geometry, request, 1),
        )
        state = await client.wait(request.room, options.room_timeout_s)
    except Refused as err:
        return refused_outcome(request, err), True
    latency_s = time.monotonic() - started
    outcome = state_outcome(request, state, options.room_timeout_s, latency_s)
    if not state.succeeded:
        return outcome, await _abort(client, request)
    checked = await asyncio.to_thread(verify_destination, geometry, arrays, request.content_seed, indices)
    return RoomOutcome(
        request.index,
        request.room,
        "success",
        latency_s=latency_s,
        nbytes=checked.nbytes_checked,
        mismatches=tuple(checked.lines),
    ), True


async def _abort(client: AsyncClient, request: ScheduledRequest) -> bool:
    """Abort a failed or stuck room; True once the sidecar says no write can land any more."""
    try:
        drained = await client.abort(request.room)
    except Refused as err:
        log.warning(
            "abort of room %d refused [%s]: %s; its pages are retired",
            request.room,
            err.code_text,
            err.reason,
        )
        return False
    if not drained:
        log.warning("abort of room %d did not confirm the pages drained; they are retired", request.room)
    return drained
