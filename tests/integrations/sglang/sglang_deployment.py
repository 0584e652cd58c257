"""Real sidecars for SGLang ranks: one ``pd-transfer serve`` process per rank,
prefill rank 0 serving the bootstrap on the port SGLang's bootstrap address
names, and a driver that runs a room through SGLang's sender and receiver
interface exactly as SGLang's scheduler queues call it."""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from cluster import Sidecar
from sglang.srt.disaggregation.base.conn import KVPoll

from pd_transfer.integrations.sglang.conn import PdTransferKVReceiver, PdTransferKVSender
from pd_transfer.processes.ports import spare_port

_tags = itertools.count()
SIDECAR_CONFIG = {
    "transport": "shm",
    "http_port": 0,
    "heartbeat_interval_s": 0.2,
    "heartbeat_misses": 5,
    "bootstrap_timeout_s": 10.0,
    "waiting_timeout_s": 20.0,
    "transfer_timeout_s": 20.0,
    "abort_drain_timeout_s": 3.0,
}


class Deployment:
    """Sidecars for ``prefill_tp`` + ``decode_tp`` ranks under ``workdir``.

    ``prefill_dp`` > 1: that many prefill DP groups of ``prefill_tp`` ranks each
    (prefill rank ``d * prefill_tp + r`` is rank ``r`` of group ``d``), group
    ``d``'s sidecars serving their bootstrap on SGLang's bootstrap port plus ``d``.
    """

    def __init__(
        self,
        workdir: Path,
        prefill_tp: int,
        decode_tp: int,
        config: dict | None = None,
        prefill_dp: int = 1,
    ) -> None:
        self.workdir = workdir
        self.port = _spare_ports(prefill_dp)
        self.sglang_bootstrap = f"127.0.0.1:{self.port}"  # what SGLang hands a sender/receiver
        tag = f"{os.getpid()}-{next(_tags)}"
        cfg = {**SIDECAR_CONFIG, **(config or {})}
        self.sidecars: dict[tuple[str, int], Sidecar] = {}
        try:
            for role, ranks in (("prefill", prefill_tp * prefill_dp), ("decode", decode_tp)):
                for rank in range(ranks):
                    name = f"sgl-{role}-tp{rank}-{tag}"
                    port = self.port + rank // prefill_tp if role == "prefill" else 0
                    bootstrap = f"tcp://127.0.0.1:{port}" if port else ""
                    self.sidecars[(role, rank)] = Sidecar(workdir, role, name, cfg, bootstrap)
            for sidecar in self.sidecars.values():
                sidecar.wait_ready()
        except BaseException:
            self.close()
            raise

    def endpoint(self, role: str, rank: int) -> str:
        return self.sidecars[(role, rank)].endpoint

    def close(self) -> None:
        for sidecar in self.sidecars.values():
            sidecar.terminate()
        for sidecar in self.sidecars.values():
            sidecar.wait_stopped()


def _spare_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now."""
    while True:
        first = spare_port()
        if all(_bindable(first + i) for i in range(1, count)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(pollers, wanted: int, timeout_s: float = 30.0) -> list[int]:
    """Poll every sender/receiver until each reports ``wanted`` or a terminal state."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [p.poll() for p in pollers]
        if all(s == wanted or s == KVPoll.Failed or s == KVPoll.Success for s in states):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.005)


def run_room(
    prefill,
    decode,
    deployment: Deployment,
    room: int,
    src_pages,
    dst_pages,
    *,
    src_aux: int,
    dst_aux: int,
    src_state=None,
    dst_state=None,
    chunk_pages: int = 0,
    timeout_s: float = 30.0,
) -> tuple[list[int], list[int], list, list]:
    """One request through SGLang's interface: receivers announce, senders send per chunk."""
    receivers = [PdTransferKVReceiver(r.manager, deployment.sglang_bootstrap, room) for r in decode]
    senders = [PdTransferKVSender(r.manager, deployment.sglang_bootstrap, room) for r in prefill]
    for receiver in receivers:
        receiver.init(0)
        receiver.send_metadata(dst_pages, dst_aux, dst_state)
    wait_for(senders, KVPoll.WaitingForInput, timeout_s)
    chunks = (
        [src_pages[i : i + chunk_pages] for i in range(0, len(src_pages), chunk_pages)]
        if chunk_pages
        else [src_pages]
    )
    for sender in senders:
        sender.init(len(src_pages), src_aux)
        for i, chunk in enumerate(chunks):
            sender.send(chunk, src_state if i == len(chunks) - 1 else None)
    decode_states = wait_for(receivers, KVPoll.Success, timeout_s)
    prefill_states = wait_for(senders, KVPoll.Success, timeout_s)
    return prefill_states, decode_states, senders, receivers
