import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# the integration harness of tests/agent (real sidecar processes)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))


@pytest.fixture(scope="module")
def workdir():
    # a short directory: ipc:// socket paths are limited to ~100 characters
    path = Path(tempfile.mkdtemp(prefix="pdt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
