"""Prefill rank 0 binds its instance's rank table at registration; a bind that fails
refuses the registration with the reason, and leaves the sidecar able to try again."""

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from cluster import Sidecar, small_instances

from pd_transfer.client import Client, Refused, allocate_pools


def test_a_bootstrap_address_in_use_refuses_rank_0s_registration_until_it_is_free():
    """Rank 0 is never left registered with no rank table served (an internal error,
    then 'already registered' on every retry)."""
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    bootstrap = f"tcp://127.0.0.1:{squatter.getsockname()[1]}"
    prefill, _ = small_instances("llama-3.1-8b", 1, 1)
    sidecar = Sidecar(workdir, "prefill", "p0", {"http_port": 0}, bootstrap=bootstrap)
    pools = allocate_pools(prefill[0], f"t{os.getpid()}-bootstrap-in-use")
    try:
        sidecar.wait_ready()
        with Client(sidecar.endpoint, "prefill-worker", timeout_s=10) as client:
            with pytest.raises(Refused) as refused:
                client.register(prefill[0], pools.handles)
            assert refused.value.code_text == "bootstrap_failed"
            assert bootstrap in refused.value.reason and "in use" in refused.value.reason
            squatter.close()
            client.register(prefill[0], pools.handles)  # registered now, not half before
        with socket.create_connection(("127.0.0.1", int(bootstrap.rsplit(":", 1)[1])), timeout=5):
            pass  # the rank table is served
    finally:
        squatter.close()
        sidecar.stop()
        pools.close()
        shutil.rmtree(workdir, ignore_errors=True)
