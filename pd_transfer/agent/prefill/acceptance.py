"""The prefill side's verdict on a decode peer, decided before any traffic.

Once the rank table is complete and every PP stage of the decode instance
has a rank registered (:mod:`.decode_instances`), the whole prefill instance
is reconciled with the decode instance by the function ``pd-transfer check``
calls (:func:`~pd_transfer.layout.instance_reconcile.reconcile_instances`);
the registering rank's region handles are checked, its data plane is
connected, and the transfer strategy per pool is chosen
(:mod:`.strategies`). The Verdict says accepted (with the plan summary) or
rejected (with every mismatch, both sides' values, a code and a hint);
either way it is counted and logged for operators.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from pd_transfer.agent import integrity
from pd_transfer.agent.prefill.verdicts import plan_summary
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.fanout import decode_ranks_fed
from pd_transfer.layout.geometry import handle_problems
from pd_transfer.layout.instance_reconcile import reconcile_instances
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.protocol import MismatchRecord, Verdict

if TYPE_CHECKING:
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.observe import Observer
    from pd_transfer.agent.prefill.decode_instances import DecodeInstances
    from pd_transfer.agent.prefill.records import DecodePeer
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.geometry import RankGeometry
    from pd_transfer.protocol import RankTable

log = logging.getLogger(__package__)
MAX_REJECTIONS_KEPT = 64  # last rejection text per decode rank, to log only what changed


class Acceptor(Protocol):
    """What a verdict uses of the prefill side: its rank table, this rank's geometry and
    data plane, the decode instances registered, and what it counts and logs."""

    table: RankTable | None
    table_ready: asyncio.Event
    decode_instances: DecodeInstances
    rejections: dict[str, str]  # decode rank -> its last rejection

    @property
    def config(self) -> SidecarConfig: ...

    @property
    def geometry(self) -> RankGeometry | None: ...

    @property
    def dataplane(self) -> DataPlane: ...

    @property
    def observe(self) -> Observer: ...


async def send_verdict(side: Acceptor, peer: DecodePeer) -> None:
    """Reconcile the prefill instance with ``peer``, connect its data plane, answer the Verdict."""
    if not await _table_ready(side, peer) or await _registration_rejected(side, peer):
        return
    decode = await _decode_instance(side, peer)
    if decode is None:
        return
    table, geometry = side.table, side.geometry
    if table is None or geometry is None:  # cleared with its worker (PrefillSide.on_worker_lost)
        raise PdTransferError(
            f"no verdict for {peer.rank_id}: the prefill worker is gone", code=Reason.WORKER_LOST
        )
    recon, headline, mismatches = instance_verdict([e.geometry for e in table.entries], decode)
    if not recon.ok:
        await _reject(side, peer, headline, mismatches)
        return
    decode_geometry = peer.registered.geometry
    peer.reconciliation = recon
    peer.planner = PairPlanner(recon, geometry, decode_geometry)
    peer.fed = decode_ranks_fed(recon, geometry.rank_id, decode_geometry)
    try:
        peer.link = await side.dataplane.connect(peer.registered)
    except PdTransferError as err:
        await _reject(
            side,
            peer,
            f"no data plane to {peer.rank_id}",
            [
                MismatchRecord(
                    path="transport",
                    code=err.code,
                    prefill=side.config.transport,
                    decode=peer.registered.data_address or "<no data address>",
                    hint=str(err),
                )
            ],
        )
        return
    await _accept(side, peer, recon)


async def _table_ready(side: Acceptor, peer: DecodePeer) -> bool:
    """Wait for the complete rank table; False once ``peer`` was rejected for want of it."""
    try:
        async with asyncio.timeout(side.config.bootstrap_timeout_s):
            await side.table_ready.wait()
    except TimeoutError:
        await _reject(
            side,
            peer,
            "prefill rank table incomplete",
            [
                MismatchRecord(
                    path="prefill.rank_table",
                    code=Reason.BOOTSTRAP_FAILED,
                    prefill="incomplete",
                    decode="-",
                    hint="start every prefill rank's sidecar and worker",
                )
            ],
        )
        return False
    return True


async def _registration_rejected(side: Acceptor, peer: DecodePeer) -> bool:
    """Reject ``peer`` (True) when its region handles are invalid."""
    handles = {h.region: h.handle for h in peer.registered.region_handles}
    problems = handle_problems(peer.registered.geometry, handles) if handles else []
    if problems:
        await _reject(
            side,
            peer,
            f"invalid registration of {peer.rank_id}",
            [
                MismatchRecord(
                    path=f"decode.{p.subject or 'handles'}",
                    code=p.code,
                    prefill="-",
                    decode=p.detail,
                    hint="each region needs its own segment",
                )
                for p in problems
            ],
        )
    return bool(problems)


def link_transport(peer: DecodePeer) -> str:
    """The name of the transport ``peer``'s link writes with (``ShmLink`` -> ``shm``)."""
    return type(peer.link).__name__.removesuffix("Link").lower() or "-"


async def _accept(side: Acceptor, peer: DecodePeer, recon: Reconciliation) -> None:
    """``peer`` is accepted: count it, log it, and send the Verdict with the plan summary."""
    peer.accepted = True
    side.rejections.pop(peer.rank_id, None)
    observe = side.observe
    modes = [v.mode.value for v in recon.verdicts]
    observe.peer(peer.rank_id, "accepted", channel=peer.channel, transport=link_transport(peer), modes=modes)
    observe.verdict(True)
    observe.verdict_modes({m: modes.count(m) for m in set(modes)})
    strategies = side.dataplane.strategies(peer.data_link, peer.pair_planner)
    observe.strategies(peer.rank_id, strategies)
    log.info(
        "prefill: accepted %s (feeds decode tp ranks %s)",
        peer.rank_id,
        peer.fed,
        extra={"peer": peer.rank_id},
    )
    peer.integrity = integrity.prefill_layout(
        side.config, side.dataplane.on_device, peer.pair_planner, peer.features, peer.rank_id
    )
    peer.bells = side.dataplane.doorbells(peer.data_link, peer.registered.doorbell)
    await peer.channel.send(
        Verdict(
            accepted=True,
            integrity=peer.integrity is not None,
            doorbell=peer.bells is not None,
            plan=plan_summary(recon, peer.pair_planner, strategies),
            transport=link_transport(peer),
        )
    )


def instance_verdict(
    prefill: list[RankGeometry], decode: list[RankGeometry]
) -> tuple[Reconciliation, str, list[MismatchRecord]]:
    """The pair's reconciliation and, when rejected, the headline and mismatch records a
    Verdict carries: what ``pd-transfer check`` prints for the same instances."""
    recon = reconcile_instances(prefill, decode)
    if recon.ok:
        return recon, "", []
    error = recon.error()
    return recon, error.headline, [MismatchRecord.from_mismatch(m) for m in error.mismatches]


async def _decode_instance(side: Acceptor, peer: DecodePeer) -> list[RankGeometry] | None:
    """``peer``'s rank and one rank of every other stage of its decode instance, or None
    once ``peer`` was rejected (an impossible stage, or a stage that never registered)."""
    register = peer.registered
    geometry = register.geometry
    if geometry.pp_rank >= register.pp_size:
        await _reject(
            side,
            peer,
            f"invalid registration of {peer.rank_id}",
            [
                MismatchRecord(
                    path="decode.pp_rank",
                    code=Reason.SHARD_RANGE_INVALID,
                    prefill="-",
                    decode=f"pp_rank {geometry.pp_rank} of pp_size {register.pp_size}",
                    hint="register each decode stage with its instance's pp_size",
                )
            ],
        )
        return None
    decode = await side.decode_instances.gathered(register, side.config.bootstrap_timeout_s)
    if decode is None:
        await _reject(
            side,
            peer,
            "decode instance incomplete",
            [
                MismatchRecord(
                    path="decode.rank_table",
                    code=Reason.BOOTSTRAP_FAILED,
                    prefill="-",
                    decode=f"missing {side.decode_instances.missing(register)}",
                    hint="start every decode rank's sidecar and worker (each stage registers with "
                    "every prefill rank)",
                )
            ],
        )
    return decode


async def _reject(side: Acceptor, peer: DecodePeer, headline: str, mismatches: list[MismatchRecord]) -> None:
    hints = [f"  hint: {h}" for h in dict.fromkeys(m.hint for m in mismatches if m.hint)]
    text = "\n".join([headline] + [f"  - {m.render()}" for m in mismatches] + hints)
    side.observe.peer(peer.rank_id, "rejected", text, peer.channel)
    side.observe.verdict(False, mismatches[0].code.value if mismatches else "")
    text = f"{headline}: " + "; ".join(m.render() for m in mismatches[:8]) + "".join(f";{h}" for h in hints)
    # a decode rank retrying (with backoff) is rejected again for the same reasons: debug
    again = side.rejections.pop(peer.rank_id, None) == text
    side.rejections[peer.rank_id] = text
    while len(side.rejections) > MAX_REJECTIONS_KEPT:
        del side.rejections[next(iter(side.rejections))]
    log.log(
        logging.DEBUG if again else logging.WARNING,
        "prefill: rejected %s%s: %s",
        peer.rank_id,
        " again" if again else "",
        text,
        extra={"peer": peer.rank_id},
    )
    await peer.channel.send(Verdict(accepted=False, headline=headline, mismatches=tuple(mismatches)))
