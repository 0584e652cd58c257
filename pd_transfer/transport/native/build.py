"""Build the native copy loop (``copy_runs.c``) into a shared library. Stdlib only.

Run at install time by the package's build hook (``hatch_build.py``), or by
hand in a source checkout::

    python -m pd_transfer.transport.native.build

The library is loaded with ctypes (:mod:`pd_transfer.transport.copy.native_loop`);
it is not a Python extension module, so one build serves every Python version.
Without a C compiler nothing is built and copies run through numpy, slower.
``CC`` picks the compiler (default ``cc``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "copy_runs.c"
LIBRARY_NAME = "_copy_runs.so"
FLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-fno-strict-aliasing")


def build(out_dir: Path = HERE, *, quiet: bool = False) -> Path:
    """Compile into ``out_dir / LIBRARY_NAME`` (replaced atomically); the path.

    Raises :class:`RuntimeError` naming the compiler and its output on failure.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    compiler = shlex.split(os.environ.get("CC", "cc"))
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / LIBRARY_NAME
        command = [*compiler, *FLAGS, "-o", str(partial), str(SOURCE)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"cannot run the C compiler {compiler[0]!r}: {err}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.strip()}")
        os.replace(partial, target)
    if not quiet:
        print(f"built {target}")
    return target


if __name__ == "__main__":
    try:
        build()
    except RuntimeError as err:
        sys.exit(f"pd-transfer native copy loop: {err}")
