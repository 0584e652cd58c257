"""Engine adapters are optional: pd-transfer never imports them, and their pure parts never import the engine."""

import subprocess
import sys

import pytest

PURE_VLLM_MODULES = [
    "pd_transfer.integrations.vllm",
    "pd_transfer.integrations.vllm.memory",
    "pd_transfer.integrations.vllm.states",
    "pd_transfer.integrations.vllm.params",
    "pd_transfer.integrations.vllm.specs",
    "pd_transfer.integrations.vllm.scheduler_side",
    "pd_transfer.integrations.vllm.staging",
    "pd_transfer.integrations.vllm.worker_side",
    "pd_transfer.integrations.vllm.hybrid_state",
    "pd_transfer.integrations.vllm.settings",
]


def _loaded_after(*modules: str) -> set[str]:
    code = f"import sys\nfor m in {list(modules)!r}: __import__(m)\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_pd_transfer_and_its_sidecar_never_import_an_engine_adapter():
    loaded = _loaded_after(
        "pd_transfer", "pd_transfer.client", "pd_transfer.agent.sidecar", "pd_transfer.cli"
    )
    leaked = sorted(m for m in loaded if m.startswith(("pd_transfer.integrations", "vllm", "sglang")))
    assert leaked == []


@pytest.mark.parametrize("module", PURE_VLLM_MODULES)
def test_vllm_connector_logic_imports_without_vllm(module):
    # only connector.py (loaded by vLLM itself) may import vLLM
    loaded = _loaded_after(module)
    assert not any(m == "vllm" or m.startswith("vllm.") for m in loaded)
    assert "pd_transfer.integrations.vllm.connector" not in loaded
