"""SGLang integration tests: they run in the SGLang environment that
``.ci/engine-venv-sglang`` builds (SGLang 0.5.23 over the local CPU torch), and
skip with the reason anywhere SGLang does not import."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    import sglang.srt.disaggregation.base.conn  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
except Exception as err:  # noqa: BLE001 - any import failure means: no SGLang here
    pytest.skip(
        f"SGLang does not import here ({type(err).__name__}: {err}); "
        f"run these tests with the environment .ci/engine-venv-sglang builds",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))  # cluster.Sidecar
