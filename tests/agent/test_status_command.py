"""``pd-transfer status`` says why a sidecar is not ready, with every mismatch of a rejection."""

import subprocess
import sys
import time

from pd_transfer.cli import build_parser
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}


def _ranks(role, kv_dtype):
    return build_instance(
        model_from_table(dict(TINY), "tiny"),
        role,
        1,
        page_size=4,
        kv_dtype=kv_dtype,
        kv_layout=Layout.NHD,
        num_pages=8,
        num_aux_rows=2,
    )


def _status(address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "status", "--addr", address],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_status_prints_the_readiness_reasons_and_the_whole_rejection(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, "bfloat16"), _ranks(Role.DECODE, "float16")
    cluster = cluster_factory(prefill, decode, decode_config={"prefill_bootstraps": "this"})
    decode_address = cluster.ready[decode[0].rank_id]["http_address"].removeprefix("http://")
    deadline = time.monotonic() + 20
    while "rejected" not in (result := _status(decode_address)).stdout:
        assert time.monotonic() < deadline, result.stdout + result.stderr
        time.sleep(0.2)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("NOT ready")
    # the reason, right under the headline, and the rejection in full: its mismatch lines too
    assert lines[1].startswith(f"  - prefill instance {cluster.bootstrap}: "), result.stdout
    assert "dtype: prefill=bfloat16 decode=float16" in result.stdout.split("\n\n")[0], result.stdout
    peer_rows = result.stdout.split("\n\n")[1]
    assert "rejected" in peer_rows and "dtype: prefill=bfloat16 decode=float16" in peer_rows, result.stdout

    prefill_address = cluster.ready[prefill[0].rank_id]["http_address"].removeprefix("http://")
    on_prefill = _status(prefill_address)
    assert "rejected" in on_prefill.stdout and "dtype: prefill=bfloat16 decode=float16" in on_prefill.stdout


def test_status_addr_defaults_to_the_local_default_http_port():
    args = build_parser().parse_args(["status"])
    assert args.addr == "127.0.0.1:9400"
