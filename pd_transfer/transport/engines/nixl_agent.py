"""NIXL's agent for the nixl transport: loading it, one agent, and the decode-side receiver.

Loading NIXL sets two things first: without RDMA devices ``UCX_MODULES=^ib``
(UCX's verbs module otherwise crashes the process at exit), and NIXL's
Python logger, which prints INFO lines to stdout, is routed into ours at
WARNING. The UCX backend starts with ``ucx_error_handling_mode=none``: the
default ``peer`` mode rules out UCX's shared-memory transports; a dead peer
is then found by the write deadline and the probe of :mod:`~pd_transfer.transport.engines.link`,
and by the sidecars' heartbeats. An agent that receives runs NIXL's progress
thread (nothing else progresses a passive target), paused 1 ms between polls
of an idle worker (:func:`_new_agent`; NIXL's wrapper would have it spin);
an agent that only initiates runs without it (``progress_thread=False``):
:meth:`NixlEngine.wait` progresses its worker by polling the transfer's
state until done or the deadline. Every call into NIXL that can raise is
translated into :class:`TransportError` here or in :mod:`~pd_transfer.transport.engines.nixl`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.engines.address import EngineAddress
from pd_transfer.transport.engines.interfaces import device_of
from pd_transfer.transport.engines.link import PROBE_LANDING
from pd_transfer.transport.engines.runs import region_bases
from pd_transfer.transport.engines.staging.link_staging import EngineReceiver, ReceiverStaging
from pd_transfer.transport.regions import Regions

log = logging.getLogger(__name__)

_API_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")


def _no_rdma_devices() -> bool:
    try:
        with os.scandir("/sys/class/infiniband") as entries:
            return not any(entries)
    except OSError:
        return True


def load_api():
    """The NIXL Python API module, or TransportError naming the extra to install."""
    if _no_rdma_devices():
        os.environ.setdefault("UCX_MODULES", "^ib")
    problems = []
    for name in _API_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            problems.append(f"{name}: {err}")
            continue
        if hasattr(module, "nixl_agent"):
            _quiet_logging()
            return module
    raise TransportError(
        f"the nixl transport needs NIXL ({'; '.join(problems)})",
        code=Reason.TRANSPORT_UNSUPPORTED,
        hint="pip install 'pd-transfer[nixl]' (and apt-get install libibverbs1)",
    )


def _quiet_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout; send WARNING and up to ours instead."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.getenv("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


PROGRESS_DELAY_US = 1000  # the agent's progress thread, between polls of an idle UCX worker
_MAKING = threading.Lock()


def _new_agent(api, name: str, config, delay_us: int):
    """``api.nixl_agent(name, config)`` whose progress thread pauses ``delay_us`` between polls.

    NIXL's Python wrapper sets that delay to 0, and the thread then polls UCX
    in a loop with ``sched_yield``: a whole core per agent, idle or not (0.99
    of a CPU per idle agent, measured here). A few sidecars on a small host
    then starve each other's event loops and miss heartbeats. With 1 ms the
    idle agent costs 0.01-0.03 of a CPU and transfers ran as fast over UCX
    tcp and shm. The wrapper builds its config from the bindings' class; while
    the agent is made, that class is swapped for one that keeps our delay.
    """
    wrapper = sys.modules.get(getattr(api.nixl_agent, "__module__", ""))
    # NIXL's bindings, found at run time: untyped, hence Any (Paced subclasses one of them)
    bindings: Any = getattr(wrapper, "nixlBind", None)
    base: Any = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        log.warning("this NIXL has no progress-thread delay to set; its agent may keep a core busy")
        return api.nixl_agent(name, config)

    class Paced(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored):
            base.pthrDelay.__set__(self, delay_us)

    with _MAKING:
        bindings.nixlAgentConfig = Paced
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


def _detach(handle) -> None:
    """Drop what a released handle of NIXL's wrapper still holds of its agent's bindings.

    NIXL's handle objects keep the native agent (``_agent``) for as long as they live,
    released or not, and a handle can live on in a traceback's frame. The native agent,
    with its UCX workers, would then be destroyed whenever garbage collection reaches that
    frame, on whichever thread, in the middle of unrelated work. Released, a handle needs
    nothing of its agent.
    """
    try:
        handle._agent = None
    except AttributeError:  # a NIXL whose handles keep no agent
        pass


def release(handle) -> None:
    """Release a prepared list or a transfer now and let go of its agent (:func:`_detach`);
    raises what NIXL raises (a transfer it cannot cancel)."""
    handle.release()
    _detach(handle)


class _Unreleased:
    """Transfer handles NIXL could not release when their wait ended, kept until it can.

    Releasing a handle cancels what UCX still can; a transfer it cannot cancel (a peer
    stopped mid-write) keeps its handle, and the handle keeps its agent. Dropped, such a
    handle would be released by garbage collection, on any thread, perhaps after the
    agent's worker went with the transfer still in it. Kept here, it is released by a later
    post or close of any agent in this process, once NIXL agrees.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list = []

    def release(self, handle) -> None:
        try:
            release(handle)
        except Exception:  # NIXL cannot cancel it yet
            log.warning("a nixl transfer could not be cancelled; its release is retried later")
            with self._lock:
                self._handles.append(handle)

    def retry(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, []
        kept = []
        for handle in handles:
            try:
                release(handle)
            except Exception:
                kept.append(handle)
        if kept:
            with self._lock:
                self._handles.extend(kept)


_UNRELEASED = _Unreleased()


class NixlEngine:
    """One NIXL agent with the UCX backend, and the memory registered with it.

    ``progress_thread``: run NIXL's progress thread; an agent that is written
    into needs it, one that only initiates is faster without (see the module).
    ``host``: UCX listens only on the network device holding it (``NET_DEVICES``;
    "" or a wildcard: on every device, UCX's default). ``ucx_threads``: 0 or 1, the
    caller's thread posts each request on the agent's one worker (NIXL's default);
    more, the UCX backend's ``num_threads``: that many workers with a thread each,
    a request's descriptors split among them in batches (NIXL's ``split_batch_size``).
    """

    def __init__(
        self,
        role: str,
        error_handling_mode: str = "none",
        *,
        progress_thread: bool = True,
        host: str = "127.0.0.1",
        ucx_threads: int = 0,
    ) -> None:
        api = load_api()
        backend = {"ucx_error_handling_mode": error_handling_mode}
        if ucx_threads > 1:
            backend["num_threads"] = str(ucx_threads)
        device = device_of(host)
        if device:  # UCX's own config, as UCX_NET_DEVICES would set it, for this agent only
            backend["engine_config"] = f"NET_DEVICES={device}"
        self.progress_thread = progress_thread
        self.name = f"pdt-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # STRICT: the agent is used from several worker threads (one write per link)
            sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync)
            self.agent = (
                _new_agent(api, self.name, config, PROGRESS_DELAY_US)
                if progress_thread
                else api.nixl_agent(self.name, config)
            )
            self.agent.create_backend("UCX", backend)
        except Exception as err:  # the bindings raise their own error types
            raise TransportError(f"nixl agent did not start: {err}", code=Reason.TRANSPORT_FAILED) from None
        self._registered: dict[int, tuple[int, object]] = {}  # address -> (nbytes, reg dlist)
        self.scratch = PROBE_LANDING  # where probes read into: never freed (engines.link)
        self.register({"scratch": (int(self.scratch.ctypes.data), self.scratch.nbytes)})

    def register(self, bases: dict[str, tuple[int, int]]) -> None:
        for region_id, (address, nbytes) in bases.items():
            known = self._registered.get(address)
            if known is not None and known[0] == nbytes:
                continue
            if known is not None:
                self.unregister(address)
            try:
                descs = self.agent.register_memory(np.array([[address, nbytes, 0]], np.uint64), "DRAM")
            except Exception as err:
                raise TransportError(
                    f"nixl refused to register region {region_id!r} ({nbytes} bytes): {err}",
                    code=Reason.REGION_INVALID,
                ) from None
            self._registered[address] = (nbytes, descs)

    def unregistered(self, bases: dict[str, tuple[int, int]]) -> bool:
        return any(self._registered.get(a, (None,))[0] != n for a, n in bases.values())

    def unregister(self, address: int) -> None:
        known = self._registered.pop(address, None)
        if known is not None:
            self.agent.deregister_memory(known[1])

    def descs(self, addresses: np.ndarray, nbytes: np.ndarray):
        table = np.empty((len(nbytes), 3), np.uint64)
        table[:, 0], table[:, 1], table[:, 2] = addresses, nbytes, 0
        return self.agent.get_xfer_descs(table, "DRAM")

    def run(self, handle, deadline_s: float) -> str:
        """Post ``handle`` and wait: "DONE", "TIMEOUT", or "ERR: <why>" (handle then released)."""
        return self.wait(handle, self.post(handle), deadline_s)

    def post(self, handle) -> str:
        """Start ``handle``; its first state ("PROC" while it runs). Then :meth:`wait`, once."""
        _UNRELEASED.retry()
        try:
            return self.agent.transfer(handle)
        except Exception as err:  # e.g. nixlRemoteDisconnectError: the peer went away
            return f"ERR: {type(err).__name__}: {err}"

    def wait(self, handle, state: str, deadline_s: float) -> str:
        """Wait for a posted ``handle``: "DONE", "TIMEOUT", or "ERR: <why>" (then released)."""
        try:
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline_s:
                    state = "TIMEOUT"
                    break
                time.sleep(pause)
                pause = min(pause * 2 or 20e-6, 1e-3)
                state = self.agent.check_xfer_state(handle)
        except Exception as err:  # e.g. nixlRemoteDisconnectError: the peer went away
            state = f"ERR: {type(err).__name__}: {err}"
        _UNRELEASED.release(handle)  # cancels what UCX still can; keeps what it cannot
        return state

    def probe(self, remote: str, remote_address: int, timeout_s: float = 5.0) -> bool:
        """Read one byte of the peer's memory: does it answer?"""
        one = np.ones(1, np.int64)
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.descs(np.array([self.scratch.ctypes.data], np.uint64), one),
                self.descs(np.array([remote_address], np.uint64), one),
                remote,
            )
            return self.run(handle, time.monotonic() + timeout_s) == "DONE"
        except Exception:
            return False

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def close(self) -> None:
        """Unregister every region and destroy the native agent now, on the closing thread.

        The wrapper may outlive this call (a traceback's frame of one of its methods keeps
        it), so the native agent is taken from it here: left to garbage collection, its UCX
        workers would be destroyed at some later moment, on whichever thread collects. Only
        a transfer NIXL could not cancel keeps the native agent alive, until it can
        (:class:`_Unreleased`); every other handle let go of it when released (:func:`release`).
        """
        _UNRELEASED.retry()
        for address in list(self._registered):
            self.unregister(address)
        self._registered.clear()
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.agent = None  # the wrapper's native agent: destroyed here if nothing kept it


class NixlReceiver(EngineReceiver):
    """The decode side: registers the rank's regions once and publishes agent metadata.

    ``engine``: share a started agent (the sidecar's own transport's, see
    :meth:`NixlTransport.start`); stopping then only unregisters the regions.
    ``host``: where an agent of its own listens (see :class:`NixlEngine`).
    """

    engine: NixlEngine | None

    def __init__(
        self,
        regions: Regions,
        error_handling_mode: str = "none",
        engine: NixlEngine | None = None,
        staging: ReceiverStaging | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__()
        self.regions = regions
        self.host = host
        self.error_handling_mode = error_handling_mode
        self.engine = engine
        self._owns_engine = engine is None
        self._bases: dict[str, tuple[int, int]] = {}
        self.staging = staging if staging is not None else ReceiverStaging()

    async def start(self) -> str:
        self._bases = region_bases(self.regions, "destination")
        if self.engine is None:
            self.engine = await asyncio.to_thread(
                NixlEngine, "recv", self.error_handling_mode, host=self.host
            )
        await asyncio.to_thread(self.engine.register, self._bases)
        # the staging area is registered before the metadata is taken: it has to be in it
        control, area = await self.staging.start(self.regions, self.engine.register, self.admission)
        self.address = EngineAddress(
            "nixl", self.engine.name, self._bases, self.engine.metadata(), control=control, staging=area
        ).encode()
        return self.address
