"""The ready file as an operator's tools read it: every address in it dials, and a
sidecar that shares its shell with an engine backend's settings serves.

What an operator met: decode's ``data_address`` stayed empty while its receiver
listened (the file was written before the worker registered), ``http_address`` was
``http://0.0.0.0:9404``, which cannot be dialled, and a sidecar started beside SGLang
with ``PD_TRANSFER_SGLANG_CALL_TIMEOUT_S`` set exited 2, calling it an unknown setting.
"""

import json
import socket
import urllib.parse
import urllib.request

import numpy as np
from cluster import random_requests, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Layout


def _dial(address: str) -> None:
    parsed = urllib.parse.urlsplit(address)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10):
        pass


def test_every_ready_file_address_dials_and_an_engine_backends_variables_leave_serve_alone(
    cluster_factory, monkeypatch
):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_CALL_TIMEOUT_S", "20")
    monkeypatch.setenv("PD_TRANSFER_SIGBUS_GUARD", "1")
    prefill, decode = small_instances("llama-3.1-8b", 1, 1, Layout.NHD)
    cluster = cluster_factory(prefill, decode, transport="tcp", config={"http_host": "0.0.0.0"})
    requests = random_requests(prefill, decode, np.random.default_rng(7), pages=3)
    cluster.expect(1, requests)
    cluster.send(1, requests)
    states = cluster.wait_decode(1)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), cluster.logs()
    assert cluster.verify(requests) == []
    for geometry in prefill + decode:
        ready = json.loads(cluster.sidecars[geometry.rank_id].ready.read_text())
        assert not ready["http_address"].startswith("http://0.0.0.0"), ready
        with urllib.request.urlopen(ready["http_address"] + "/healthz", timeout=10) as response:
            assert response.status == 200
        _dial(ready["control_address"]) if ready["control_address"] else None
        if geometry.role.value == "decode":
            assert ready["data_address"], ready  # its tcp receiver listens once registered
            _dial(ready["data_address"])
