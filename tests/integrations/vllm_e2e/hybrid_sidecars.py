"""Two sidecars for the hybrid end-to-end run (hybrid_run.py reads their addresses from
``run.json`` in its work directory), and the environment the vLLM engines run with."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from pd_transfer.processes.ports import spare_port


def engine_env() -> dict:
    """The engines' environment: no pd-transfer settings of this run, CPU-friendly vLLM knobs."""
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
            env = {**engine_env(), "PD_TRANSFER_SECRET_FILE": str(secret)}
            log = (workdir / f"{role}.log").open("w")
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        for role in ("prefill", "decode"):
            ready = workdir / f"{role}.ready.json"
            deadline = time.monotonic() + 60
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
