import shutil
import tempfile
from pathlib import Path

import pytest
from cluster import Cluster


@pytest.fixture
def cluster_factory():
    # a short directory: ipc:// socket paths are limited to ~100 characters
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    made = []

    def make(prefill, decode, **kwargs) -> Cluster:
        cluster = Cluster(workdir, prefill, decode, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
    shutil.rmtree(workdir, ignore_errors=True)
