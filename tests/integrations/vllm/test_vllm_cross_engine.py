"""Cross-engine: an SGLang prefill (TP 2) and a vLLM decode (TP 4) of one model, byte-exact.

Two models: a Llama-like GQA model, and a GDN hybrid (full attention on
layers 1, 3, gated delta net on layers 0, 2) whose conv state SGLang keeps as
``(channels, taps)`` per slot and vLLM as ``(taps, channels)`` inside a raw
page shared with the attention group (vllm_hybrid_caches.py).

No environment imports both engines, so each side runs in its own: this test
in vLLM's, and the prefill in SGLang's, as one process
(``tests/integrations/sglang/sglang_prefill_server.py``, started once per
module with SGLang's python). There every prefill rank is SGLang's own: its
``MHATokenToKVPool`` (or ``HybridLinearKVPool`` + ``MambaPool`` sized by its
``Qwen3NextConfig``) on CPU, its real ``PrefillBootstrapQueue`` building the
manager through the plugin's ``_init_kv_manager`` hook, and the request sent
through ``PdTransferKVSender``. Decode is the vLLM connector with tensors
shaped as vLLM's CPU backend registers them (``[blocks, heads, block_size, 2
* head_size]``, K | V on the last axis). The two layouts differ in every axis
but the page; the sidecars reconcile them. The oracle is the request's
logical KV and state, written on the SGLang side and expected on the vLLM
side by plain torch indexing.

SGLang's python: ``PDT_TEST_SGLANG_PYTHON``, else the environment
``.ci/engine-venv-sglang`` caches under ``~/.cache/pd-transfer``; without one
the test skips, saying so.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cluster import Sidecar  # noqa: E402
from vllm_harness import BLOCK_SIZE  # noqa: E402
from vllm_hybrid_caches import (  # noqa: E402
    ATTN,
    CONV_GROUPS,
    GDN,
    K_DIM,
    K_HEADS,
    KERNEL,
    V_DIM,
    V_HEADS,
    assert_same_bytes,
    flat_copy,
    gdn_hybrid,
    gdn_states,
    heads_of,
    local_channels,
    put_kv,
    twin,
)
from vllm_instances import (  # noqa: E402
    HEAD_SIZE,
    NUM_BLOCKS,
    NUM_LAYERS,
    SIDECAR_CONFIG,
    TOTAL_HEADS,
    assert_bit_equal,
    expected_decode,
    logical_kv,
    run_until,
)

from pd_transfer.integrations.vllm.specs import RecvSpec, StepSpecs  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SERVER = REPO / "tests" / "integrations" / "sglang" / "sglang_prefill_server.py"


def _sglang_python() -> str | None:
    named = os.environ.get("PDT_TEST_SGLANG_PYTHON", "")
    if named:
        return named
    cached = sorted(
        Path.home().glob(".cache/pd-transfer/sglang-*/bin/python"), key=lambda p: p.stat().st_mtime
    )
    return str(cached[-1]) if cached else None


class SglangPrefill:
    """The SGLang prefill process: one job (a room of TP 2 prefill ranks) at a time."""

    def __init__(self, python: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="pdt-sgl-"))
        self.log = (self.workdir / "server.log").open("w")
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "SGLANG_MAMBA_CONV_DTYPE": "float16",
            "UCX_MODULES": "^ib",
        }
        self.proc = subprocess.Popen(
            [python, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.jobs = 0

    def send(self, job: dict, arrays: dict[str, np.ndarray]) -> None:
        """Start a job: the SGLang side registers, waits for decode's request, then sends."""
        self.jobs += 1
        folder = self.workdir / f"job{self.jobs}"
        folder.mkdir()
        for name, array in arrays.items():
            np.save(folder / f"{name}.npy", array)
        self.job = folder / "job.json"
        self.job.write_text(json.dumps({**job, "arrays": sorted(arrays)}))
        self.proc.stdin.write(f"{self.job}\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line.strip() == f"DONE {self.job}", f"the SGLang prefill process ended: {self.logs()}"
        return json.loads(self.job.with_suffix(".answer.json").read_text())

    def logs(self) -> str:
        self.log.flush()
        return (self.workdir / "server.log").read_text()[-4000:]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def sglang_prefill():
    python = _sglang_python()
    if python is None or not Path(python).exists():
        pytest.skip("no SGLang environment: set PDT_TEST_SGLANG_PYTHON or build .ci/engine-venv-sglang")
    prefill = SglangPrefill(python)
    yield prefill
    prefill.close()


def _job(sidecars, bootstrap: str, room: int, src: list[int], model_dir, **extra) -> dict:
    return {
        "tp": 2,
        "endpoints": [s.endpoint for s in sidecars],
        "sglang_bootstrap": bootstrap.removeprefix("tcp://"),
        "room": room,
        "src": src,
        "page": BLOCK_SIZE,
        "blocks": NUM_BLOCKS,
        "layers": NUM_LAYERS,
        "kv_heads": TOTAL_HEADS,
        "head_dim": HEAD_SIZE,
        "model_dir": str(model_dir),
        "timeout_s": 90,
        **extra,
    }


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A float16 tensor's raw bits (numpy has no bfloat16; the SGLang side views them back)."""
    return tensor.contiguous().view(torch.int16).numpy()


def test_sglang_prefill_to_vllm_decode_lands_byte_exact(sglang_prefill, instances, workdir, model_dir):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    decode = instances("kv_consumer", 4, bootstrap)
    sidecars = [Sidecar(workdir, "prefill", f"sgl2-{r}", dict(SIDECAR_CONFIG), bootstrap) for r in range(2)]
    try:
        for sidecar in sidecars:
            sidecar.wait_ready(timeout_s=120)
        kv = logical_kv(seed=26)
        src, dst = [4, 1, 9], [7, 2, 10]
        sglang_prefill.send(_job(sidecars, bootstrap, 84, src, model_dir), {"kv": _bits(kv)})
        _registered(bootstrap, sglang_prefill)
        before = [{n: t.clone() for n, t in caches.items()} for caches in decode.caches]
        decode.start(StepSpecs(recvs=[RecvSpec("req-x", 84, bootstrap, tuple(dst))]))
        _wait_received(decode, "req-x", sidecars, sglang_prefill)
        answer = sglang_prefill.answer()
        assert answer.get("states") == ["Success", "Success"], answer
        assert "kv.layer[1].k" in answer["views"], answer["views"]  # SGLang's pool, registered by the hook
        for rank, want in enumerate(expected_decode(decode, before, kv, src, dst)):
            assert_bit_equal(decode.caches[rank], want, f"vLLM decode tp{rank}/4")
    finally:
        for sidecar in sidecars:
            sidecar.terminate()
        for sidecar in sidecars:
            sidecar.wait_stopped()


def test_sglang_gdn_hybrid_prefill_to_vllm_decode_lands_byte_exact(
    sglang_prefill, instances, workdir, model_dir
):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    decode = instances("kv_consumer", 4, bootstrap, build=gdn_hybrid)
    sidecars = [Sidecar(workdir, "prefill", f"sgh2-{r}", dict(SIDECAR_CONFIG), bootstrap) for r in range(2)]
    try:
        for sidecar in sidecars:
            sidecar.wait_ready(timeout_s=120)
        gen = torch.Generator().manual_seed(27)
        src, dst, src_slot, dst_slot = [3, 7], [5, 1], 9, 2
        kv = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half()
        conv = torch.randn(2, KERNEL - 1, sum(CONV_GROUPS), generator=gen).half()  # [layer, tap, channel]
        temporal = torch.randn(2, V_HEADS, V_DIM, K_DIM, generator=gen)
        gdn = {"k_heads": K_HEADS, "k_dim": K_DIM, "v_heads": V_HEADS, "v_dim": V_DIM, "kernel": KERNEL}
        job = _job(
            sidecars,
            bootstrap,
            85,
            src,
            model_dir,
            src_slot=src_slot,
            gdn={**gdn, "groups": list(CONV_GROUPS)},
        )
        sglang_prefill.send(job, {"kv": _bits(kv), "conv": _bits(conv), "temporal": temporal.numpy()})
        _registered(bootstrap, sglang_prefill)
        expected = []
        for tp_rank, caches in enumerate(decode.caches):
            flat = flat_copy(caches)
            want = twin(caches, flat)
            for i, name in enumerate(ATTN):
                put_kv(want[name], kv[i][:, src], dst, heads_of(4, tp_rank, TOTAL_HEADS))
            for i, name in enumerate(GDN):
                c, t = gdn_states(want[name], 4)
                c[dst_slot] = conv[i][:, local_channels(4, tp_rank)]
                t[dst_slot] = temporal[i][heads_of(4, tp_rank, V_HEADS)]
            expected.append(flat)
        decode.start(
            StepSpecs(recvs=[RecvSpec("req-xh", 85, bootstrap, tuple(dst), state_slots=(dst_slot,))])
        )
        _wait_received(decode, "req-xh", sidecars, sglang_prefill)
        answer = sglang_prefill.answer()
        assert answer.get("states") == ["Success", "Success"], answer
        assert "mamba.layer[0].conv" in answer["views"], answer["views"]
        for tp_rank, caches in enumerate(decode.caches):
            assert_same_bytes(flat_copy(caches), expected[tp_rank], f"vLLM decode tp{tp_rank}/4")
    finally:
        for sidecar in sidecars:
            sidecar.terminate()
        for sidecar in sidecars:
            sidecar.wait_stopped()


def _registered(bootstrap: str, prefill: SglangPrefill) -> None:
    """Wait until prefill rank 0 serves its rank table (bound when its worker registers):
    SGLang's router sends a request to a prefill server that is up, never before."""
    host, port = bootstrap.removeprefix("tcp://").rsplit(":", 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"the SGLang prefill never registered: {prefill.logs()}"
            time.sleep(0.1)


def _wait_received(decode, req_id: str, sidecars, prefill: SglangPrefill) -> None:
    done = [False] * len(decode.connectors)

    def finished() -> bool:
        for i, connector in enumerate(decode.connectors):
            got = connector.get_transfer_results(set())
            assert not got.failed_recving, connector._worker.failures
            done[i] = done[i] or req_id in got.finished_recving
        return all(done)

    run_until(
        finished,
        90,
        f"{req_id} on decode",
        lambda: decode.logs() + "".join(s.log.read_text()[-2000:] for s in sidecars) + prefill.logs(),
    )
