"""The worker process: runs, reports, exit codes and shared-memory cleanup."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from fake_pair import FakePair
from sim_models import TINY

from pd_transfer.memory.segments import SEGMENT_DIR, open_segment
from pd_transfer.sim import worker
from pd_transfer.sim.schedule import ROOM_STRIDE

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = "tcp://127.0.0.1:5999"
SEED = 11


@pytest.fixture
def model_file(tmp_path):
    table = TINY["gqa"]
    lines = [
        "[model]",
        f'name = "{table["name"]}"',
        f"num_layers = {table['num_layers']}",
        'layer_cycle = ["attention"]',
        "[model.attention]",
        f"num_kv_heads = {table['attention']['num_kv_heads']}",
        f"head_dim = {table['attention']['head_dim']}",
    ]
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pair_factory():
    made, mapped = [], []

    def resolve(name, nbytes):
        mapped.append(open_segment(name, nbytes))
        return mapped[-1].array

    def make(num_prefill, num_decode):
        made.append(FakePair(num_prefill, num_decode, resolve))
        return made[-1]

    yield make
    for pair in made:
        pair.close()
    for segment in mapped:
        segment.close()


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap_workers():
    """A failed test must not leave a worker (and its segments) running."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _worker(tmp_path, model_file, role, tp_size, tp_rank, endpoint, tag, *extra):
    name = f"{role}{tp_rank}"
    cmd = [
        sys.executable,
        "-m",
        "pd_transfer.sim.worker",
        "--role",
        role,
        "--model",
        str(model_file),
        "--tp-size",
        str(tp_size),
        "--tp-rank",
        str(tp_rank),
        "--page-size",
        "4",
        "--num-pages",
        "40",
        "--endpoint",
        endpoint,
        "--requests",
        "6",
        "--tokens",
        "30",
        "--seed",
        str(SEED),
        "--window",
        "3",
        "--chunk-pages",
        "3",
        "--worker-id",
        f"{tag}-{name}",
        "--report",
        str(tmp_path / f"{name}.json"),
        "--progress",
        str(tmp_path / f"{name}.progress"),
        "--room-timeout-s",
        "5",
        "--log-level",
        "WARNING",
        *extra,
    ]
    if role == "decode":
        cmd += ["--bootstrap", BOOTSTRAP]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    STARTED.append(
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
    return STARTED[-1]


def _segments(tag):
    return glob.glob(os.path.join(SEGMENT_DIR, f"pdt-{tag}-*"))


def test_workers_run_the_schedule_and_leave_nothing_behind(tmp_path, model_file, pair_factory):
    pair = pair_factory(1, 2)
    tag = f"t{uuid.uuid4().hex[:8]}"
    procs = [_worker(tmp_path, model_file, "prefill", 1, 0, pair.prefill[0].endpoint, tag)]
    procs += [
        _worker(
            tmp_path, model_file, "decode", 2, r, pair.decode[r].endpoint, tag, "--kv-layout", "page_first"
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    for name in ("prefill0", "decode0", "decode1"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert (
            report["ok"],
            report["rooms"],
            report["succeeded"],
            report["failed"],
            report["num_mismatches"],
            report["error"],
        ) == (True, 6, 6, [], 0, None)
        progress = (tmp_path / f"{name}.progress").read_text().splitlines()
        assert sorted(progress) == sorted(f"{i} {SEED * ROOM_STRIDE + i} success" for i in range(6))
    decode = json.loads((tmp_path / "decode1.json").read_text())
    assert decode["rank"] == "decode[pp0,tp1]" and len(decode["latencies_s"]) == 6
    assert decode["bytes_verified"] > 0 and decode["latency_p50_s"] is not None
    assert _segments(tag) == []


def _argv(tmp_path, model_file, role, endpoint, tag):
    return [
        "--role",
        role,
        "--model",
        str(model_file),
        "--tp-size",
        "1",
        "--tp-rank",
        "0",
        "--page-size",
        "4",
        "--num-pages",
        "40",
        "--endpoint",
        endpoint,
        "--tokens",
        "30",
        "--window",
        "3",
        "--bootstrap",
        BOOTSTRAP,
        "--worker-id",
        tag,
        "--report",
        str(tmp_path / f"{role}0.json"),
    ]


def test_a_refused_registration_exits_1_with_the_reason(tmp_path, model_file, pair_factory):
    pair = pair_factory(1, 1)
    pair.refuse_register = "kv.layer[0].k.dtype: prefill=bfloat16 decode=float16"
    tag = f"t{uuid.uuid4().hex[:8]}"
    argv = _argv(tmp_path, model_file, "decode", pair.decode[0].endpoint, tag)
    assert worker.main(argv) == worker.EXIT_FAILED
    report = json.loads((tmp_path / "decode0.json").read_text())
    assert report["ok"] is False
    assert report["error"] == (
        "register failed [dtype_mismatch]: kv.layer[0].k.dtype: prefill=bfloat16 decode=float16"
    )
    assert _segments(tag) == []


def test_sigterm_exits_143_and_unlinks_the_segments(tmp_path, model_file, pair_factory):
    pair = pair_factory(1, 1)
    pair.hang_rooms.update(SEED * ROOM_STRIDE + i for i in range(6))
    tag = f"t{uuid.uuid4().hex[:8]}"
    procs = {
        role: _worker(tmp_path, model_file, role, 1, 0, rank.endpoint, tag)
        for role, rank in (("prefill", pair.prefill[0]), ("decode", pair.decode[0]))
    }
    deadline = time.monotonic() + 20
    first = SEED * ROOM_STRIDE

    def both_under_way():  # a send proves prefill's handler is in place (it is set before the pools)
        room = pair.rooms.get(first)
        return room is not None and room.sent and room.expected

    while not both_under_way() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert both_under_way(), "both workers should have reached the first room within 20 s"
    time.sleep(0.2)  # now both block waiting on rooms that never finish
    assert _segments(tag), "the workers should hold their segments while running"
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    for role, proc in procs.items():
        _, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 143, (role, stderr)
        assert json.loads((tmp_path / f"{role}0.json").read_text())["error"] == "terminated by SIGTERM"
    assert _segments(tag) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--bootstrap", BOOTSTRAP, "--num-pages", "10"],
            "decode.num_pages is 10 but 3 rooms in flight need 8 pages each (24)",
        ),
        ([], "--bootstrap is required for --role decode"),
        (["--bootstrap", BOOTSTRAP, "--model", "no-such-model"], "unknown model preset 'no-such-model'"),
    ],
)
def test_invalid_input_exits_2_naming_the_field(tmp_path, model_file, caplog, extra, message):
    argv = _argv(tmp_path, model_file, "decode", "ipc:///tmp/pdt-unused.sock", "inv")
    argv[argv.index("--bootstrap") : argv.index("--bootstrap") + 2] = []
    assert worker.main(argv + extra) == worker.EXIT_INVALID
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "decode0.json").exists()
