"""Tests of the vLLM connector; they need vLLM, so they run in the engine venv.

``.ci/engine-venv-vllm`` builds that venv (vLLM 0.33 with the local CPU torch,
cached outside the clone) and prints its python; CI runs this directory with
it. Under any other python (the project's own ``.venv``) each test module
skips itself with the reason (``pytest.importorskip`` at its top).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# the real sidecar launcher of tests/agent/cluster.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def model_dir():
    """A local model directory with only a Llama config.json (vLLM's config needs no weights)."""
    path = Path(tempfile.mkdtemp(prefix="pdt-vllm-model-"))
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workdir():
    # short: unix socket paths are limited to ~100 characters
    path = Path(tempfile.mkdtemp(prefix="pdt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def instances(workdir, model_dir):
    """``make(kv_role, tp_size, bootstrap, ...)``: a vLLM instance's worker connectors on real sidecars."""
    import vllm_instances  # imports vLLM: only once a test asks for it

    made = []

    def make(role, tp_size, bootstrap, **kwargs):
        made.append(vllm_instances.Instance(workdir, model_dir, role, tp_size, bootstrap, **kwargs))
        return made[-1]

    yield make
    for instance in made:
        instance.close()
