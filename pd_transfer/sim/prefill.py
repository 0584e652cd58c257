"""The simulated prefill engine: compute (fill) each request's pages and send them.

Like an engine running chunked prefill: for each request, chunk after chunk,
the chunk's pages are "computed" (written with the request's deterministic
content) and handed to the sidecar with ``send``; the state slot, SWA pages
and aux row are computed and sent with the last chunk. A request's window
slot (its pages, state slot and aux row) is reused only after ``wait`` says
the room is finished, as an engine frees a request's pages only then.

A refused call (:class:`~pd_transfer.client.Refused`) fails its room; any
other client error (no reply, the sidecar gone) ends the run with it.

Blocking: uses :class:`pd_transfer.client.Client`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pd_transfer.client import Client, Refused
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import Pool
from pd_transfer.sim.bookkeeping import (
    EngineOptions,
    ProgressLog,
    call_args,
    log,
    own_indices,
    refused_outcome,
    state_outcome,
)
from pd_transfer.sim.content import fill_source
from pd_transfer.sim.report import WorkerReport
from pd_transfer.sim.schedule import ScheduledRequest


def run_prefill(
    client: Client,
    geometry: RankGeometry,
    arrays: Mapping[str, np.ndarray],
    schedule: list[ScheduledRequest],
    options: EngineOptions,
    report: WorkerReport,
) -> None:
    """Send every request of ``schedule``, at most one room per window slot in flight."""
    progress = ProgressLog(geometry.rank_id, report, options.progress_path)
    in_flight: dict[int, ScheduledRequest] = {}
    for request in schedule:
        previous = in_flight.pop(request.window_slot, None)
        if previous is not None:
            _finish(client, previous, options, progress)
        try:
            report.nbytes_filled += _send(client, geometry, arrays, request, options)
        except Refused as err:
            progress.record(refused_outcome(request, err))
            continue
        in_flight[request.window_slot] = request
    for request in sorted(in_flight.values(), key=lambda r: r.index):
        _finish(client, request, options, progress)


def _send(
    client: Client,
    geometry: RankGeometry,
    arrays: Mapping[str, np.ndarray],
    request: ScheduledRequest,
    options: EngineOptions,
) -> int:
    """Fill and send one request chunk by chunk; the logical bytes filled."""
    indices = own_indices(geometry, request)
    chunks = request.chunks(options.chunk_pages) if Pool.KV in indices else [request.src_pages[:0]]
    filled = 0
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        to_fill = {Pool.KV: chunk}
        if last:
            to_fill.update({pool: src for pool, (src, _) in indices.items() if pool is not Pool.KV})
        filled += fill_source(geometry, arrays, request.content_seed, to_fill)
        if last:
            client.send(request.room, chunk, last_chunk=True, **call_args(geometry, request, 0))
        else:
            client.send(request.room, chunk, last_chunk=False)
    return filled


def _finish(client: Client, request: ScheduledRequest, options: EngineOptions, progress: ProgressLog) -> None:
    try:
        state = client.wait(request.room, options.room_timeout_s)
    except Refused as err:
        progress.record(refused_outcome(request, err))
        return
    outcome = state_outcome(request, state, options.room_timeout_s)
    progress.record(outcome)
    if outcome.status == "timeout":
        # the window slot is reused next: stop the sidecar reading these source pages
        try:
            client.abort(request.room)
        except Refused as err:
            log.warning(
                "%s abort of timed-out room %d refused [%s]: %s",
                progress.rank,
                request.room,
                err.code_text,
                err.reason,
            )
