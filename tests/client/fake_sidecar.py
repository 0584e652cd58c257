"""A tiny fake sidecar: a ROUTER thread answering worker_api requests from a script.

Every request is parsed with the contract's own
:func:`pd_transfer.protocol.worker_api.decode_request`, so a client that
encodes a field wrongly fails here as it would against the real sidecar.
The script is a function ``(op, message) -> reply fields | None`` (None: no
reply at all); ``delays`` holds back the reply of an op by some seconds.
"""

from __future__ import annotations

import heapq
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pd_transfer.protocol import worker_api
from pd_transfer.protocol.worker_api import WorkerOp

Script = Callable[[WorkerOp, dict[str, Any]], dict[str, Any] | None]


def default_script(op: WorkerOp, message: dict[str, Any]) -> dict[str, Any] | None:
    if op in (WorkerOp.POLL, WorkerOp.WAIT):
        return {"ok": True, "status": "success"}
    if op is WorkerOp.ABORT:
        return {"ok": True, "drained": True}
    return {"ok": True}


class FakeSidecar:
    def __init__(self, script: Script = default_script) -> None:
        self.script = script
        self.delays: dict[WorkerOp, float] = {}
        self.requests: list[tuple[WorkerOp, dict[str, Any]]] = []
        self.raw_replies: list[bytes] = []  # sent verbatim before the scripted reply
        self._dir = tempfile.mkdtemp(prefix="pdt-")
        self.endpoint = f"ipc://{self._dir}/worker.sock"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def ops(self) -> list[WorkerOp]:
        return [op for op, _ in self.requests]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        due: list[tuple[float, int, list[bytes]]] = []
        order = itertools.count()
        while not self._stop.is_set():
            wait_s = 0.05 if not due else max(0.0, min(0.05, due[0][0] - time.monotonic()))
            if self._socket.poll(int(wait_s * 1000)):
                identity, frame = self._socket.recv_multipart()
                try:
                    op, message = worker_api.decode_request(frame)
                except worker_api.WorkerApiError as err:
                    self._socket.send_multipart([identity, worker_api.error_reply(-1, err)])
                    continue
                self.requests.append((op, message))
                for raw in self.raw_replies:
                    self._socket.send_multipart([identity, raw])
                reply = self.script(op, message)
                if reply is not None:
                    frames = [identity, worker_api.encode({"id": message["id"], **reply})]
                    heapq.heappush(due, (time.monotonic() + self.delays.get(op, 0.0), next(order), frames))
            while due and due[0][0] <= time.monotonic():
                self._socket.send_multipart(heapq.heappop(due)[2])
