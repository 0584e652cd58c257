"""A sidecar that copies between host pools never loads torch.

torch is for CUDA pools (IPC handles, device copies). Loaded, it made every
sidecar start 1-1.5 s slower on the 2-core machine, stop 0.5 s slower, and
hold about 190 MiB more memory; host pools are mapped as numpy arrays instead.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster import random_requests, small_instances

from pd_transfer.client import RoomStatus

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps (Linux)")


def test_the_sidecar_modules_import_without_torch():
    code = (
        "import sys; import pd_transfer.cli, pd_transfer.agent.sidecar; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sidecars_moving_host_pools_never_map_libtorch(cluster_factory, transport):
    prefill, decode = small_instances("qwen3-next-80b-a3b", 2, 4)
    cluster = cluster_factory(prefill, decode, transport=transport)
    requests = random_requests(prefill, decode, np.random.default_rng(4), pages=4)
    cluster.expect(5, requests)
    cluster.send(5, requests, chunk_pages=2)
    states = cluster.wait_decode(5)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    loaded = [
        name
        for name, sidecar in cluster.sidecars.items()
        if "libtorch" in Path(f"/proc/{sidecar.proc.pid}/maps").read_text()
    ]
    assert loaded == []
