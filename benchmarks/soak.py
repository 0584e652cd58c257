"""Bounded soak: normal rooms mixed with aborts, corrupt frames and killed sidecars.

    python benchmarks/soak.py [--seconds 120] [--seed 0] [--transport shm|tcp]

Loopback only. Starts a prefill TP 2 / decode TP 2 deployment of
llama-3.1-8b (page size 16, 96 pages a rank) as real sidecar processes, the
four workers played by this process through the asyncio client with pools in
shared memory, and for ``--seconds`` runs up to ``--concurrency`` rooms at a
time. Each room fills its source pages with the sim's content of its own seed
(pd_transfer.sim.content), and is one of: normal (one or two chunks), aborted
by the decode worker, aborted by the prefill worker. Meanwhile mutated frames
go to the prefill control sockets, and every ``--kill-every`` seconds (about)
a prefill sidecar is SIGKILLed and restarted, its worker registering again.

Every room must end terminal; every room that succeeded is verified item by
item on both decode ranks. Destination pages are reused only once no write
can land: after Success, or when ``abort()`` reported them drained; otherwise
they stay quarantined for the rest of the run (fail closed).

Prints rooms started, succeeded, failed by reason, lost (must be 0: no
terminal status by the end) and wrong bytes (must be 0), the peak RSS
(VmHWM) of each sidecar process, and exits 1 if lost or wrong bytes are not 0,
a sidecar died on its own, or something leaked. Stops by itself: the run,
then at most ~30 s of draining.

Only prefill ranks other than 0 are killed by default; ``--kill-rank-0``
includes rank 0, which serves the rank table: a restarted rank 0 learns the
other ranks again without their restarting (pinned by
``test_restarted_prefill_rank_0_serves_new_rooms_without_restarting_the_others``
in tests/faults/test_killed_sidecars.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / d) for d in ("agent", "faults", "fuzz", "protocol"))]

from cluster import Sidecar  # noqa: E402
from fuzz_frames import FreshSessions, control_seeds, random_mutation  # noqa: E402
from protocol_samples import every_frame_type  # noqa: E402

from pd_transfer.client import AsyncClient, ClientError, RoomStatus, allocate_pools  # noqa: E402
from pd_transfer.layout.geometry import Role  # noqa: E402
from pd_transfer.layout.presets import load_preset  # noqa: E402
from pd_transfer.layout.rank_builder import build_instance  # noqa: E402
from pd_transfer.layout.views import Layout, Pool  # noqa: E402
from pd_transfer.memory.segments import SEGMENT_DIR  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402
from pd_transfer.security.secret import use_ephemeral_secret  # noqa: E402
from pd_transfer.sim.content import fill_source, verify_destination  # noqa: E402

TERMINAL = (RoomStatus.SUCCESS, RoomStatus.FAILED)
NUM_PAGES, NUM_AUX_ROWS = 96, 64
CONFIG = {
    "http_port": 0,
    "heartbeat_interval_s": 0.2,
    "heartbeat_misses": 5,
    "bootstrap_timeout_s": 5.0,
    "waiting_timeout_s": 5.0,
    "transfer_timeout_s": 5.0,
    "abort_drain_timeout_s": 2.0,
    "room_ttl_s": 60.0,
}
ROOM_WAIT_S = 25.0  # longer than any room deadline (bootstrap 5 * 1.25 + 0.5, then 5 + 5)


def peak_rss_kib(pid: int) -> int:
    """VmHWM of ``pid`` in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class FreeList:
    """Indices of one pool; ``quarantine`` keeps those a late write might still reach."""

    def __init__(self, count: int) -> None:
        self.free = list(range(count))
        self.quarantined = 0

    def take(self, rng: random.Random, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        picked = rng.sample(self.free, n)
        for i in picked:
            self.free.remove(i)
        return picked

    def give(self, indices) -> None:
        self.free.extend(indices)

    def quarantine(self, indices) -> None:
        self.quarantined += len(indices)


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="pdt-soak-"))
        use_ephemeral_secret(self.workdir)  # sidecars and clients authenticate, as deployed
        self.tag = f"soak{args.seed}-{time.monotonic_ns() % 10**6}"
        spec = load_preset("llama-3.1-8b")
        shape = {
            "page_size": 16,
            "kv_layout": Layout.NHD,
            "num_pages": NUM_PAGES,
            "num_aux_rows": NUM_AUX_ROWS,
        }
        self.prefill = build_instance(spec, Role.PREFILL, 2, **shape)
        self.decode = build_instance(spec, Role.DECODE, 2, **shape)
        self.bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        self.config = {**CONFIG, "transport": args.transport}
        self.sidecars: dict[str, Sidecar] = {}
        self.peaks: dict[str, int] = {}  # sidecar process label -> VmHWM KiB
        self.restarts: Counter = Counter()
        self.pools, self.clients = {}, {}
        self.src = {Pool.KV: FreeList(NUM_PAGES), Pool.AUX: FreeList(NUM_AUX_ROWS)}
        self.dst = {Pool.KV: FreeList(NUM_PAGES), Pool.AUX: FreeList(NUM_AUX_ROWS)}
        self.stats: Counter = Counter()
        self.failed_by_reason: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.problems: list[str] = []
        self.corrupt = None
        self.elapsed = 0.0
        self.bad_frames = 0.0

    # -- processes ------------------------------------------------------------------
    def _start(self, geometry) -> Sidecar:
        role = geometry.role.value
        name = f"{role}-tp{geometry.tp_rank}-{self.tag}"
        return Sidecar(self.workdir, role, name, self.config, self.bootstrap if role == "prefill" else "")

    async def start(self) -> None:
        for geometry in self.prefill + self.decode:
            self.sidecars[geometry.rank_id] = self._start(geometry)
        self.ready = {rank: await asyncio.to_thread(s.wait_ready) for rank, s in self.sidecars.items()}
        for geometry in self.prefill + self.decode:
            rank = geometry.rank_id
            self.pools[rank] = allocate_pools(geometry, f"{self.tag}-{geometry.role.value}{geometry.tp_rank}")
            await self._register(geometry)
        self.corrupt = [
            FreshSessions("control", self.ready[g.rank_id]["control_address"]) for g in self.prefill
        ]

    async def _register(self, geometry) -> None:
        rank = geometry.rank_id
        old = self.clients.get(rank)
        if old is not None:
            old.close()
        client = self.clients[rank] = AsyncClient(self.sidecars[rank].endpoint, rank, timeout_s=10)
        await client.register(geometry, self.pools[rank].handles, timeout_s=30)

    def _label(self, rank: str) -> str:
        return f"{rank}#{self.restarts[rank]}"

    async def kill_and_restart(self, geometry) -> None:
        rank = geometry.rank_id
        old = self.sidecars[rank]
        self.peaks[self._label(rank)] = peak_rss_kib(old.proc.pid)
        old.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(old.proc.wait)
        self.stats["sidecars killed"] += 1
        old.log.rename(old.log.with_name(f"{old.name}.run{self.restarts[rank]}.log"))
        old.ready.unlink(missing_ok=True)
        self.restarts[rank] += 1
        await asyncio.sleep(self.rng.uniform(0, 0.5))
        self.sidecars[rank] = self._start(geometry)
        self.ready[rank] = await asyncio.to_thread(self.sidecars[rank].wait_ready)
        await self._register(geometry)
        self.corrupt[geometry.tp_rank] = FreshSessions("control", self.ready[rank]["control_address"])

    # -- chaos ----------------------------------------------------------------------
    async def chaos_kills(self, until: float) -> None:
        ranks = self.prefill if self.args.kill_rank_0 else self.prefill[1:]
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.args.kill_every)
            if time.monotonic() > until - 5:
                return
            await self.kill_and_restart(self.rng.choice(ranks))

    async def chaos_frames(self, until: float) -> None:
        seeds = control_seeds(every_frame_type())
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            target = self.rng.choice(self.corrupt)
            for _ in range(self.rng.randint(1, 10)):
                target.send(random_mutation(self.rng, seeds), self.rng.random() < 0.5)
                self.stats["corrupt frames sent"] += 1

    # -- rooms ----------------------------------------------------------------------
    async def room(self, room: int, slots: asyncio.Semaphore) -> None:
        async with slots:
            n = self.rng.randint(1, 4)
            wanted = [
                (self.src, Pool.KV, n),
                (self.src, Pool.AUX, 1),
                (self.dst, Pool.KV, n),
                (self.dst, Pool.AUX, 1),
            ]
            taken = [(lists, pool, lists[pool].take(self.rng, count)) for lists, pool, count in wanted]
            if any(indices is None for _, _, indices in taken):
                for lists, pool, indices in taken:
                    if indices is not None:
                        lists[pool].give(indices)
                self.stats["rooms not started (pages exhausted)"] += 1
                await asyncio.sleep(0.2)
                return
            src = {Pool.KV: taken[0][2], Pool.AUX: taken[1][2]}
            dst = {Pool.KV: taken[2][2], Pool.AUX: taken[3][2]}
            try:
                await self._run_room(room, src, dst)
            finally:
                await self._release_src(room, src)

    async def _run_room(self, room: int, src: dict, dst: dict) -> None:
        for geometry in self.prefill:  # this room's own content: a stale page would show
            fill_source(geometry, self.pools[geometry.rank_id].arrays, room, src)
        plan = self.rng.choices(
            ["normal", "chunked", "abort_decode", "abort_prefill"], weights=[70, 15, 8, 7]
        )[0]
        self.stats["rooms started"] += 1
        self.stats[f"plan {plan}"] += 1
        decode = [self.clients[g.rank_id] for g in self.decode]
        try:
            await asyncio.gather(
                *(c.expect(room, self.bootstrap, dst[Pool.KV], aux_row=dst[Pool.AUX][0]) for c in decode)
            )
        except ClientError as err:
            self._failed(err.code_text, f"expect refused: {err}")
            return
        if plan == "abort_decode":
            await asyncio.sleep(self.rng.uniform(0, 0.05))
            await asyncio.gather(*(c.abort(room) for c in decode), return_exceptions=True)
        await asyncio.gather(*(self._send(g, room, src, plan) for g in self.prefill))
        results = await asyncio.gather(*(c.wait(room, ROOM_WAIT_S) for c in decode), return_exceptions=True)
        states = [r for r in results if not isinstance(r, BaseException)]
        if len(states) < len(results) or any(s.status not in TERMINAL for s in states):
            self.stats["rooms lost"] += 1
            self.examples.setdefault("lost", f"room {room}: {results}")
            self.dst[Pool.KV].quarantine(dst[Pool.KV])
            self.dst[Pool.AUX].quarantine(dst[Pool.AUX])
            return
        if all(s.status is RoomStatus.SUCCESS for s in states):
            self.stats["rooms succeeded"] += 1
            self._verify(room, src, dst)
            self._give_dst(dst)
            return
        failed = next(s for s in states if s.status is RoomStatus.FAILED)
        self._failed(failed.code_text, failed.reason)
        # pages of a failed room are reused only when no write can land any more
        drained = await asyncio.gather(*(c.abort(room) for c in decode), return_exceptions=True)
        if all(d is True for d in drained):
            self._give_dst(dst)
        else:
            self.dst[Pool.KV].quarantine(dst[Pool.KV])
            self.dst[Pool.AUX].quarantine(dst[Pool.AUX])

    async def _send(self, geometry, room: int, src: dict, plan: str) -> None:
        client = self.clients[geometry.rank_id]
        pages = src[Pool.KV]
        try:
            if plan in ("chunked", "abort_prefill") and len(pages) > 1:
                cut = len(pages) // 2
                await client.send(room, pages[:cut], last_chunk=False)
                if plan == "abort_prefill":
                    await client.abort(room)
                    return
                await asyncio.sleep(self.rng.uniform(0, 0.02))
                pages = pages[cut:]
            elif plan == "abort_prefill":
                await client.abort(room)
                return
            await client.send(room, pages, aux_row=src[Pool.AUX][0])
        except ClientError as err:  # a killed sidecar, a refused call: decode reports the room
            self.stats[f"prefill calls failed ({err.code_text})"] += 1

    async def _release_src(self, room: int, src: dict) -> None:
        """Source pages are free once every prefill rank's room is terminal (or its sidecar gone)."""
        deadline = time.monotonic() + ROOM_WAIT_S
        for geometry in self.prefill:
            while True:
                try:
                    state = await self.clients[geometry.rank_id].poll(room)
                except ClientError:
                    break  # unknown on a restarted sidecar, or the sidecar is down: no reader left
                if state.status in TERMINAL:
                    break
                if time.monotonic() > deadline:
                    self.stats["prefill rooms lost"] += 1
                    self.examples.setdefault("prefill lost", f"room {room} on {geometry.rank_id}: {state}")
                    break
                await asyncio.sleep(0.05)
        self.src[Pool.KV].give(src[Pool.KV])
        self.src[Pool.AUX].give(src[Pool.AUX])

    def _give_dst(self, dst: dict) -> None:
        self.dst[Pool.KV].give(dst[Pool.KV])
        self.dst[Pool.AUX].give(dst[Pool.AUX])

    def _failed(self, code: str | None, reason: str) -> None:
        code = code or "<no code>"
        self.stats["rooms failed"] += 1
        self.failed_by_reason[code] += 1
        self.examples.setdefault(code, reason[:300])
        if not reason:
            self.problems.append(f"a room failed with {code} but no reason text")

    def _verify(self, room: int, src: dict, dst: dict) -> None:
        requests = {Pool.KV: (src[Pool.KV], dst[Pool.KV]), Pool.AUX: (src[Pool.AUX], dst[Pool.AUX])}
        for geometry in self.decode:
            arrays = self.pools[geometry.rank_id].arrays
            result = verify_destination(geometry, arrays, room, requests)
            self.stats["bytes verified"] += result.nbytes_checked
            if not result.ok:
                item_nbytes = result.nbytes_checked // max(result.items_checked, 1)
                self.stats["wrong bytes"] += result.items_wrong * item_nbytes
                self.examples.setdefault("wrong bytes", "\n".join(result.lines[:5]))

    # -- the run ----------------------------------------------------------------------
    async def run(self) -> None:
        await self.start()
        started = time.monotonic()
        until = started + self.args.seconds
        chaos = [asyncio.create_task(self.chaos_frames(until)), asyncio.create_task(self.chaos_kills(until))]
        slots = asyncio.Semaphore(self.args.concurrency)
        rooms: set[asyncio.Task] = set()
        room_id = 1000
        while time.monotonic() < until:
            await slots.acquire()  # a free slot: start the next room
            slots.release()
            room_id += 1
            task = asyncio.create_task(self.room(room_id, slots))
            rooms.add(task)
            task.add_done_callback(rooms.discard)
            await asyncio.sleep(self.rng.uniform(0, 0.02))
        for task in chaos:
            task.cancel()
        await asyncio.gather(*chaos, return_exceptions=True)
        done, pending = await asyncio.wait(rooms, timeout=2 * ROOM_WAIT_S) if rooms else (set(), set())
        for task in done:
            if task.exception() is not None:
                self.problems.append(f"room task failed: {task.exception()!r}")
        if pending:
            self.stats["rooms lost"] += len(pending)
            for task in pending:
                task.cancel()
        self.elapsed = time.monotonic() - started
        for rank, sidecar in self.sidecars.items():
            self.peaks[self._label(rank)] = peak_rss_kib(sidecar.proc.pid)
            if sidecar.proc.poll() is not None:
                self.problems.append(f"sidecar {rank} died on its own: {sidecar.log.read_text()[-1500:]}")
        self.bad_frames = await asyncio.to_thread(self._scrape_bad_frames)

    def _scrape_bad_frames(self) -> float:
        import urllib.request

        total = 0.0
        for geometry in self.prefill:
            url = self.ready[geometry.rank_id]["http_address"] + "/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                for line in response.read().decode().splitlines():
                    if line.startswith("pd_transfer_bad_frames_total{"):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    def shutdown(self) -> None:
        for client in self.clients.values():
            client.close()
        running = [s for s in self.sidecars.values() if s.proc.poll() is None]
        for sidecar in running:
            sidecar.proc.send_signal(signal.SIGTERM)
        for sidecar in running:
            try:
                code = sidecar.proc.wait(timeout=20)
            except Exception:
                sidecar.proc.kill()
                code = "killed after 20 s"
            if code != 0:
                self.problems.append(f"sidecar {sidecar.name} exited {code} on SIGTERM")
        for pools in self.pools.values():
            pools.close()
        left = [n for n in Path(SEGMENT_DIR).iterdir() if n.name.startswith(f"pdt-{self.tag}")]
        if left:
            self.problems.append(f"{len(left)} shared-memory segments left: {left[:3]}")
        shutil.rmtree(self.workdir, ignore_errors=True)

    def report(self) -> int:
        s = self.stats
        print(
            f"soak: {self.elapsed:.0f} s, prefill TP 2 -> decode TP 2, llama-3.1-8b, "
            f"{self.args.transport}, seed {self.args.seed}, up to {self.args.concurrency} rooms at a time"
        )
        print(f"  rooms started      {s['rooms started']}")
        print(
            f"  succeeded          {s['rooms succeeded']}  (every one verified: "
            f"{s['bytes verified'] / 2**20:.0f} MiB checked)"
        )
        print(f"  failed with reason {s['rooms failed']}")
        for code, count in self.failed_by_reason.most_common():
            print(f"    {code:22s} {count:5d}   e.g. {self.examples[code][:110]}")
        print(f"  lost               {s['rooms lost'] + s['prefill rooms lost']}  (must be 0)")
        print(f"  wrong bytes        {s['wrong bytes']}  (must be 0)")
        print(
            "  plans              "
            + ", ".join(f"{k[5:]} {v}" for k, v in sorted(s.items()) if k.startswith("plan "))
        )
        print(
            f"  corrupt frames     {s['corrupt frames sent']} sent to prefill control sockets; "
            f"{self.bad_frames:.0f} counted by the running prefill sidecars"
        )
        print(f"  sidecars killed    {s['sidecars killed']} (SIGKILL + restart, worker re-registered)")
        others = {k: v for k, v in s.items() if k.startswith(("prefill calls", "rooms not started"))}
        if others:
            print(f"  also               {others}")
        print(
            f"  pages quarantined  {self.dst[Pool.KV].quarantined} kv, {self.dst[Pool.AUX].quarantined} aux "
            f"(failed rooms not drained: never reused)"
        )
        print("  peak RSS (VmHWM) per sidecar process:")
        for label, kib in sorted(self.peaks.items()):
            print(f"    {label:24s} {kib / 1024:7.1f} MiB")
        for key in ("lost", "prefill lost", "wrong bytes"):
            if key in self.examples:
                print(f"  {key}: {self.examples[key]}")
        for problem in self.problems:
            print(f"  PROBLEM: {problem}")
        bad = s["rooms lost"] + s["prefill rooms lost"] + s["wrong bytes"] + len(self.problems)
        print("result:", "ok" if not bad else "FAILED")
        return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills, about")
    parser.add_argument("--kill-rank-0", action="store_true", help="also kill prefill rank 0")
    args = parser.parse_args()
    soak = Soak(args)
    try:
        asyncio.run(soak.run())
    finally:
        soak.shutdown()
    return soak.report()


if __name__ == "__main__":
    sys.exit(main())
