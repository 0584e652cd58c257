"""A fake pair of sidecars for the sim tests: one thread serving every worker endpoint.

Just enough of the worker API to drive the simulated engines end to end
without the agent: registrations, chunked sends, expects, waits, aborts. A
room moves once every prefill rank has sent its last chunk and a decode rank
has expected it: the fake reconciles the registered geometries, plans with
the real planner and copies the byte runs between the workers' buffers
(found through ``resolve(segment_name, nbytes)``). ``faults`` lets a test
corrupt a room's destination after the copy, or leave a room hanging.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import worker_api
from pd_transfer.protocol.geometry_codec import geometry_from_data
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.testing import runs

Resolve = Callable[[str, int], np.ndarray]


@dataclass
class Rank:
    endpoint: str
    geometry: RankGeometry | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Room:
    sent: dict[str, dict[str, list]] = field(default_factory=dict)  # prefill rank -> fields
    last: set[str] = field(default_factory=set)
    expected: dict[str, dict[str, Any]] = field(default_factory=dict)  # decode rank -> expect
    done: set[str] = field(default_factory=set)  # decode ranks copied


class FakePair:
    def __init__(self, num_prefill: int, num_decode: int, resolve: Resolve) -> None:
        self.resolve = resolve
        self.hang_rooms: set[int] = set()
        self.refuse_register: str | None = None  # a reason: every register is refused
        self.silent_ops: set[WorkerOp] = set()  # requests never answered
        self.drained = True  # what abort answers
        self.corrupt_rooms: set[int] = set()
        self._dir = tempfile.mkdtemp(prefix="pdt-pair-")
        self._context = zmq.Context()
        self.prefill = [Rank(f"ipc://{self._dir}/p{i}.sock") for i in range(num_prefill)]
        self.decode = [Rank(f"ipc://{self._dir}/d{i}.sock") for i in range(num_decode)]
        self._sockets = {}
        for rank in self.prefill + self.decode:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(rank.endpoint)
            self._sockets[rank.endpoint] = socket
        self.rooms: dict[int, Room] = {}
        self._waits: list[tuple[float, str, bytes, int, int, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for socket in self._sockets.values():
            socket.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- serving ------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for socket in self._sockets.values():
            poller.register(socket, zmq.POLLIN)
        ranks = {r.endpoint: r for r in self.prefill + self.decode}
        while not self._stop.is_set():
            for socket, _ in poller.poll(20):
                endpoint = next(e for e, s in self._sockets.items() if s is socket)
                identity, frame = socket.recv_multipart()
                op, message = worker_api.decode_request(frame)
                if op in self.silent_ops:
                    continue
                if op is WorkerOp.REGISTER and self.refuse_register:
                    error = PdTransferError(self.refuse_register, code=Reason.DTYPE_MISMATCH)
                    socket.send_multipart([identity, worker_api.error_reply(message["id"], error)])
                    continue
                reply = self._handle(ranks[endpoint], identity, op, message)
                if reply is not None:
                    socket.send_multipart([identity, worker_api.ok_reply(message["id"], **reply)])
            self._answer_waits()

    def _handle(self, rank: Rank, identity: bytes, op: WorkerOp, message: dict) -> dict | None:
        room_id = message.get("room")
        if op is WorkerOp.REGISTER:
            rank.geometry = geometry_from_data(message["geometry"])
            rank.arrays = {
                r.id: self.resolve(message["handles"][r.id], r.nbytes) for r in rank.geometry.regions
            }
            return {}
        room = self.rooms.setdefault(room_id, Room()) if room_id is not None else None
        rank_id = rank.geometry.rank_id
        if op is WorkerOp.SEND:
            fields = room.sent.setdefault(
                rank_id, {"pages": [], "swa_pages": [], "state_slots": [], "aux_row": None}
            )
            fields["pages"] += message["pages"]
            if message["last"]:
                fields.update(
                    swa_pages=message["swa_pages"],
                    state_slots=message["state_slots"],
                    aux_row=message["aux_row"],
                )
                room.last.add(rank_id)
        elif op is WorkerOp.EXPECT:
            room.expected[rank_id] = message
        elif op is WorkerOp.WAIT:
            deadline = time.monotonic() + message["timeout_s"]
            self._waits.append(
                (deadline, rank.endpoint, identity, message["id"], room_id, rank in self.prefill)
            )
            self._progress(room_id)
            return None
        elif op is WorkerOp.POLL:
            return {"status": self._status(room_id, rank in self.prefill, rank_id)}
        elif op is WorkerOp.ABORT:
            return {"drained": self.drained}
        self._progress(room_id)
        return {}

    def _status(self, room_id: int, is_prefill: bool, rank_id: str) -> str:
        room = self.rooms.get(room_id, Room())
        if is_prefill:
            done = len(room.done) == len(self.decode)
        else:
            done = rank_id in room.done
        return "success" if done else "waiting_for_input"

    def _progress(self, room_id: int) -> None:
        room = self.rooms[room_id]
        if room_id in self.hang_rooms or len(room.last) < len(self.prefill):
            return
        sources = {r.geometry.rank_id: r.geometry for r in self.prefill}
        for rank in self.decode:
            dst = rank.geometry
            if dst is None or dst.rank_id in room.done or dst.rank_id not in room.expected:
                continue
            recon = reconcile(list(sources.values()), [dst])
            for src_id in recon.sources_for(dst):
                requests = self._requests(room.sent[src_id], room.expected[dst.rank_id], dst)
                plan = plan_pair(recon, sources[src_id], dst, requests)
                src_arrays = next(r.arrays for r in self.prefill if r.geometry.rank_id == src_id)
                for i, batch in enumerate(plan.batches):
                    loaded = runs.load_runs(batch, f"batch {i}", src_arrays, rank.arrays)
                    runs.copy_runs(src_arrays[batch.src_region], rank.arrays[batch.dst_region], loaded)
            if room_id in self.corrupt_rooms:
                view = next(v for v in dst.views if v.pool is Pool.KV)
                page = room.expected[dst.rank_id]["pages"][0]
                index_stride = view.strides_nbytes[[a.role.value for a in view.axes].index("index")]
                rank.arrays[view.region][view.offset_nbytes + page * index_stride] ^= 0xFF
            room.done.add(dst.rank_id)

    @staticmethod
    def _requests(sent: dict, expected: dict, dst: RankGeometry) -> dict:
        requests = {Pool.KV: (sent["pages"], expected["pages"])}
        pools = dst.pools()
        if sent["swa_pages"] and Pool.SWA in pools:
            requests[Pool.SWA] = (sent["swa_pages"], expected["swa_pages"])
        if sent["state_slots"] and Pool.MAMBA in pools:
            requests[Pool.MAMBA] = (sent["state_slots"], expected["state_slots"])
        if sent["aux_row"] is not None:
            requests[Pool.AUX] = ([sent["aux_row"]], [expected["aux_row"]])
        return requests

    def _answer_waits(self) -> None:
        now = time.monotonic()
        keep = []
        for deadline, endpoint, identity, request_id, room_id, is_prefill in self._waits:
            rank = next(r for r in self.prefill + self.decode if r.endpoint == endpoint)
            status = self._status(room_id, is_prefill, rank.geometry.rank_id)
            if status == "success" or now >= deadline:
                self._sockets[endpoint].send_multipart(
                    [identity, worker_api.ok_reply(request_id, status=status)]
                )
            else:
                keep.append((deadline, endpoint, identity, request_id, room_id, is_prefill))
        self._waits = keep
