"""A network namespace of the test's own, whose loopback the test can cut.

Two sidecars started in it (through ``nsenter``, which execs them) talk over
its own 127.0.0.1, invisible to the rest of the machine. :meth:`vanish` then
throttles that loopback to 8 bits per second: no acknowledgement, FIN or RST
gets through any more, which is what a peer sees when the other host loses
power or its network. The kernel of a stopped or starved process would still
acknowledge; this is the case only the connection's own timeout can tell.

Needs ``unshare``, ``nsenter`` and ``tc`` (iproute2) and the right to make a
network namespace (root, or an unprivileged user namespace); without them
:func:`private_network` skips the test saying which step failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

# (unshare's flags, nsenter's flags): as root, a network namespace alone; else inside
# a user namespace of our own, mapped to root there
_WAYS = ((("--net",), ()), (("--user", "--map-root-user", "--net"), ("--user", "--preserve-credentials")))


class PrivateNetwork:
    def __init__(self, holder: subprocess.Popen, enter: tuple[str, ...]) -> None:
        self.holder = holder
        self.prefix = ("nsenter", f"--target={holder.pid}", "--net", *enter, "--")

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, timeout=30)

    def vanish(self) -> None:
        """Every packet on the namespace's loopback from now on waits (practically) forever."""
        for cmd in (
            ("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"),
            ("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb")
            + ("rate", "8bit", "ceil", "8bit", "burst", "1", "cburst", "1"),
        ):
            done = self.run(*cmd)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def restore(self) -> None:
        self.run("tc", "qdisc", "del", "dev", "lo", "root")


def _own_namespace(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    except OSError:
        return False


@contextlib.contextmanager
def private_network() -> Iterator[PrivateNetwork]:
    missing = [tool for tool in ("unshare", "nsenter", "tc", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"a private network namespace needs {', '.join(missing)} (iproute2, util-linux)")
    why = []
    for unshare_flags, enter in _WAYS:
        holder = subprocess.Popen(
            ["unshare", *unshare_flags, "--", "sleep", "infinity"], stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 30
        while holder.poll() is None and not _own_namespace(holder.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        network = PrivateNetwork(holder, enter)
        up = network.run("ip", "link", "set", "lo", "up") if holder.poll() is None else None
        if up is not None and up.returncode == 0 and _own_namespace(holder.pid):
            try:
                yield network
            finally:
                network.restore()
                holder.kill()
                holder.wait()
            return
        holder.kill()
        _, err = holder.communicate()
        why.append(
            f"unshare {' '.join(unshare_flags)}: {(err or b'').decode().strip() or (up and up.stderr.strip())}"
        )
    pytest.skip("cannot make a private network namespace here: " + "; ".join(why))
