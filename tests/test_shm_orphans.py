"""``pd-transfer shm-clean``: what a killed worker leaves in /dev/shm is found and removed,
and a segment any live process holds is never touched."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from pd_transfer.memory.segments import SEGMENT_DIR, create_segment

CHILD = """
import sys, time
from pd_transfer.memory.segments import create_segment
segments = [create_segment(sys.argv[1] + name, 1 << 20) for name in ("kv", "aux")]
for s in segments:
    s.array[:] = 7  # the pages exist: memory a leak would keep
print("ready", flush=True)
time.sleep(600)
"""


def _shm_clean(*args: str) -> subprocess.CompletedProcess:
    # processes this test cannot inspect (a sandbox's init) are not workers
    return subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "shm-clean", "--skip-uninspectable", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_killed_workers_segments_are_listed_then_removed_and_held_ones_are_kept():
    prefix = f"pdt-shmclean-{os.getpid()}-"
    child = subprocess.Popen([sys.executable, "-c", CHILD, prefix], stdout=subprocess.PIPE, text=True)
    held = create_segment(prefix + "held", 1 << 16)  # this process keeps it mapped
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)  # a worker killed before it could unlink
        child.wait(timeout=30)
        left = sorted(p.name for p in Path(SEGMENT_DIR).glob(f"{prefix}*"))
        assert left == [prefix + "aux", prefix + "held", prefix + "kv"]

        listed = _shm_clean("--prefix", prefix)
        assert listed.returncode == 1, listed.stderr
        assert listed.stdout.split() == [prefix + "aux", prefix + "kv"]
        assert "2 orphaned, 1 in use" in listed.stderr

        removed = _shm_clean("--prefix", prefix, "--remove")
        assert removed.returncode == 0, removed.stderr
        assert "removed 2 segments, 2.0 MiB" in removed.stderr
        assert sorted(p.name for p in Path(SEGMENT_DIR).glob(f"{prefix}*")) == [prefix + "held"]
        assert held.array.shape == (1 << 16,)  # still mapped and usable
    finally:
        child.kill()
        child.wait()
        held.close()
        held.unlink()
        for path in Path(SEGMENT_DIR).glob(f"{prefix}*"):
            path.unlink()
