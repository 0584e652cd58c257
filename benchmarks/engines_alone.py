"""Mooncake's transfer engine and NIXL driven alone, each in the ways its users drive it.

Used by ``engines_bench.py`` (the sender processes of its engine-alone rows, and
the receiver's notification answerer). Each driver is given one case's
descriptors (source and destination offsets, lengths) and times ``repeats``
requests after a warm-up; everything a user sets up once (agents, registration,
metadata, prepared descriptor lists) is set up outside the timed runs.

NIXL (``settings``):

  progress_thread   the initiating agent runs NIXL's progress thread (the
                    receiving agent always does: nothing else progresses it)
  ucx_threads       the UCX backend's ``num_threads`` (vLLM's NixlConnector
                    sets 4); 0: NIXL's default, one worker
  notif             completion as vLLM's NixlConnector signals it: the WRITE
                    carries a notification (``notif_msg``) and the request ends
                    when the receiving agent's ``get_new_notifs`` returns it
                    (the receiver stamps that moment; both processes read the
                    same monotonic clock), not when the initiator sees DONE

In every setting the descriptor lists are prepared once per case
(``prep_xfer_dlist``) and each request is one ``make_prepped_xfer("WRITE", ...)``,
posted and polled to DONE by the initiator, then released.

Mooncake (``settings``):

  batch             descriptors per ``batch_transfer_*`` call
  submit            "sync": ``batch_transfer_sync_write``, one batch after the
                    other; "async": every batch posted with
                    ``batch_transfer_async_write``, then one
                    ``get_batch_transfer_status`` over all of them
  env               the engine's per-peer tcp queue settings (set for the
                    sender's process by the bench)
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import numpy as np

NOTIF_PREFIX = b"pdt-bench "
_ACTIVE_S = 0.5  # after a bench notification, the answerer polls every 50 us for this long


def timed(fn, repeats: int, budget_s: float = 6.0) -> list[float]:
    """Seconds of ``repeats`` runs after a warm-up; a slow path stops after the first run
    past ``budget_s``. ``fn`` may return the moment (``time.monotonic``) its request ended
    where that is not when it returns (a notification stamped by the receiver)."""
    fn()
    out: list[float] = []
    while len(out) < repeats and sum(out) < budget_s:
        start = time.monotonic()
        ended = fn()
        now = time.monotonic()
        out.append((max(ended, start) if isinstance(ended, float) else now) - start)
    return out


# -- NIXL ----------------------------------------------------------------------------------
def nixl_alone(state: dict, address: str, src, s, d, n, repeats: int) -> list[float]:
    from pd_transfer.transport.engines.address import EngineAddress
    from pd_transfer.transport.engines.nixl import NixlEngine

    settings = state["settings"]
    peer = EngineAddress.parse(address, "nixl")
    if "engine" not in state:
        engine = NixlEngine(
            "bench",
            progress_thread=settings["progress_thread"],
            ucx_threads=settings.get("ucx_threads", 0),
        )
        engine.register({"src": (src.data_ptr(), src.numel())})
        engine.agent.add_remote_agent(peer.metadata)
        state["engine"], state["close"] = engine, engine.close
    once, done = nixl_request(
        state["engine"],
        peer.session,
        src.data_ptr() + s,
        peer.regions["dst"][0] + d,
        n,
        notif=settings.get("notif", False),
    )
    try:
        return timed(once, repeats)
    finally:
        done()


def nixl_request(engine, remote: str, src_addr, dst_addr, n, *, notif: bool = False):
    """One case on a NIXL agent as its users drive it: both lists prepared once, a prepped
    WRITE per request; returns (one request, release the lists)."""
    agent = engine.agent
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _table(src_addr, n), "DRAM")
    remote_list = agent.prep_xfer_dlist(remote, _table(dst_addr, n), "DRAM")
    index = np.arange(len(n), dtype=np.int32)
    notified = _NotifWaiter() if notif else None

    def once() -> float | None:
        tag = notified.next_tag() if notified else b""
        handle = agent.make_prepped_xfer("WRITE", local, index, remote_list, index, notif_msg=tag)
        if engine.run(handle, time.monotonic() + 120) != "DONE":
            raise SystemExit("nixl transfer failed")
        return notified.wait(tag) if notified else None

    def done() -> None:
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote_list)
        if notified:
            notified.close()

    return once, done


class _NotifWaiter:
    """The initiator's end of the notification path: a tag per request, and the moment
    the receiver saw it (a datagram from :func:`answer_notifications`)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(120)
        self.seq = itertools.count()

    def next_tag(self) -> bytes:
        return NOTIF_PREFIX + f"{self.sock.getsockname()[1]} {next(self.seq)}".encode()

    def wait(self, tag: bytes) -> float:
        want = tag.split()[-1]
        while True:
            seq, seen = self.sock.recv(256).split()
            if seq == want:
                return float(seen)

    def close(self) -> None:
        self.sock.close()


def answer_notifications(agent, stop: threading.Event) -> None:
    """The receiver's side (a thread): poll the receiving agent's notifications as
    vLLM's connector does and stamp each bench tag with the moment it was seen."""
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    last = 0.0
    while not stop.is_set():
        notifs = agent.get_new_notifs()
        now = time.monotonic()
        for messages in notifs.values():
            for message in messages:
                if message.startswith(NOTIF_PREFIX):
                    port, seq = message[len(NOTIF_PREFIX) :].split()
                    out.sendto(seq + b" " + repr(now).encode(), ("127.0.0.1", int(port)))
                    last = now
        time.sleep(50e-6 if now - last < _ACTIVE_S else 2e-3)
    out.close()


def _table(addresses: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    table = np.zeros((len(nbytes), 3), np.uint64)
    table[:, 0], table[:, 1] = addresses, nbytes
    return table


# -- Mooncake ------------------------------------------------------------------------------
def mooncake_alone(state: dict, address: str, src, s, d, n, repeats: int) -> list[float]:
    from pd_transfer.transport.engines.address import EngineAddress
    from pd_transfer.transport.engines.mooncake import MooncakeEngine

    peer = EngineAddress.parse(address, "mooncake")
    if "engine" not in state:
        state["engine"] = MooncakeEngine()
        state["engine"].register({"src": (src.data_ptr(), src.numel())})
        state["close"] = state["engine"].close
    settings = state["settings"]
    once = mooncake_request(
        state["engine"].engine,
        peer.session,
        src.data_ptr() + s,
        peer.regions["dst"][0] + d,
        n,
        batch=settings["batch"],
        posted=settings.get("submit") == "async",
    )
    return timed(once, repeats)


def mooncake_request(engine, session: str, src_addr, dst_addr, n, *, batch: int, posted: bool):
    """One case on a Mooncake TransferEngine: batches of ``batch`` descriptors, each
    written synchronously in turn, or all posted and then waited for together."""
    src_list, dst_list, lengths = src_addr.tolist(), dst_addr.tolist(), n.tolist()
    cuts = [slice(i, i + batch) for i in range(0, len(lengths), batch)]

    def sync() -> None:
        for cut in cuts:
            if engine.batch_transfer_sync_write(session, src_list[cut], dst_list[cut], lengths[cut]):
                raise SystemExit("mooncake engine failed a batch")

    def post() -> None:
        ids = [
            engine.batch_transfer_async_write(session, src_list[cut], dst_list[cut], lengths[cut])
            for cut in cuts
        ]
        if not all(ids) or engine.get_batch_transfer_status(ids) != 0:
            raise SystemExit("mooncake engine failed a batch")

    return post if posted else sync
