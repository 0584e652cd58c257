"""Layer-wise streaming: how much of a request's transfer is left after its last layer.

    python benchmarks/streaming_bench.py [--tokens 8192] [--layer-ms 12] [--transport shm]

Llama-3.1-8B, ``--tokens`` tokens (page 16, random pages), prefill TP 1 ->
decode TP 1 between real sidecar processes. Two ways, on the same bytes:

- not streamed: the worker finishes every layer, then send(); the transfer
  time is send() -> decode sees Success (the physical floor of this case);
- streamed: send(..., stream=True) before the forward pass, then one
  layer_ready() per layer every ``--layer-ms`` (a simulated forward pass);
  the exposed time is the last layer_ready() -> decode sees Success.

Prints medians of ``--repeats`` and the ratio exposed / not streamed, with the
target (< 0.25). No assertion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cluster import PAGE, Cluster  # noqa: E402
from pd_transfer.agent.prefill.streaming import span_of  # noqa: E402


def one_room(cluster: Cluster, room: int, src, dst, layers: list[int], layer_s: float, stream: bool) -> float:
    prefill, decode = cluster.clients["p-tp0"], cluster.clients["d0-tp0"]
    decode.expect(room, cluster.bootstrap, dst, aux_row=room % 64)
    time.sleep(0.05)  # the request reaches prefill first: time the transfer, not the request
    if stream:
        prefill.send(room, src, aux_row=room % 64, stream=True)
        for layer in layers:
            time.sleep(layer_s)  # the forward pass of this layer
            prefill.layer_ready(room, layer)
        start = time.perf_counter()
    else:
        time.sleep(layer_s * len(layers))
        start = time.perf_counter()
        prefill.send(room, src, aux_row=room % 64)
    state = decode.wait(room, 120)
    if state.status.value != "success":
        raise RuntimeError(f"room {room} failed: {state.reason}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--layer-ms",
        type=float,
        default=12.0,
        help="simulated forward time per layer (an 8k-token prefill of an 8B "
        "model on one H100 is roughly 10-15 ms per layer)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    args = parser.parse_args()
    pages = args.tokens // PAGE
    workdir = Path(tempfile.mkdtemp(prefix="pdt-stream-"))
    cluster = Cluster(workdir, num_pages=pages + 64, transport=args.transport)
    try:
        layers = sorted(span_of(cluster.prefill[0]))
        nbytes = sum(v.item_nbytes * pages for v in cluster.decodes[0][0].views if v.pool.value == "kv")
        rng = np.random.default_rng(0)
        one_room(cluster, 1, [0], [0], layers, 0.0, stream=False)  # warm-up: bootstrap
        plain, exposed = [], []
        for i in range(args.repeats):
            for stream, out in ((False, plain), (True, exposed)):
                src = rng.choice(pages + 64, pages, replace=False).tolist()
                dst = rng.choice(pages + 64, pages, replace=False).tolist()
                out.append(
                    one_room(cluster, 100 + 2 * i + stream, src, dst, layers, args.layer_ms / 1e3, stream)
                )
    finally:
        cluster.close()
    plain_s, exposed_s = statistics.median(plain), statistics.median(exposed)
    ratio = exposed_s / plain_s
    print(
        f"Llama-3.1-8B, {args.tokens} tokens, {len(layers)} layers, {nbytes / 2**30:.2f} GiB of "
        f"KV, TP 1 -> 1 over {args.transport}, forward pass {args.layer_ms:g} ms per layer; "
        f"medians of {args.repeats}"
    )
    print(f"{'case':<44}{'ms':>9}{'GB/s':>8}")
    print(f"{'not streamed: send -> decode success':<44}{plain_s * 1e3:>9.1f}{nbytes / plain_s / 1e9:>8.2f}")
    print(f"{'streamed: last layer_ready -> decode success':<44}{exposed_s * 1e3:>9.1f}")
    verdict = "met" if ratio < 0.25 else "MISSED"
    print(f"exposed / not streamed: {ratio:.2f}x; target < 0.25x ({verdict})")


if __name__ == "__main__":
    main()
