"""``pd-transfer demo`` (the README's main job) runs end to end and verifies every byte."""

import subprocess
import sys


def test_demo_moves_and_verifies_a_small_run():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "demo",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "1",
            "--requests",
            "3",
            "--tokens",
            "512",
            "--window",
            "2",
            "--transport",
            "tcp",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result: OK" in result.stdout
    assert "byte mismatches       0" in result.stdout
    assert "kv sliced" in result.stdout  # the per-pool verdicts are shown, and what they mean
    assert "sliced: a share of each tensor, between TP sizes" in result.stdout
    # a pipe is not a terminal: plain progress lines, the last one at the end
    progress = [line for line in result.stdout.splitlines() if "progress:" in line]
    assert progress and progress[-1].startswith("  progress: 3/3 decode rank-rooms done"), progress


def test_demo_help_shows_every_default_and_what_each_option_is():
    result = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for option, default in (
        ("--page-size", "16"),
        ("--transport", "shm"),
        ("--requests", "24"),
        ("--seed", "0"),
    ):
        assert f"{option}" in text and f"(default: {default})" in text, option
    assert "tokens per KV page" in text


# -- stopping: signals, invalid arguments, a child that fails ---------------------------

import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

DEMO = [
    sys.executable,
    "-m",
    "pd_transfer.cli",
    "demo",
    "--prefill-tp",
    "1",
    "--decode-tp",
    "1",
    "--requests",
    "100000",
    "--tokens",
    "64",
    "--window",
    "1",
    "--timeout-s",
    "300",
]


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _running_demo() -> tuple[subprocess.Popen, dict[int, str], Path]:
    """A demo with its 2 sidecars and 2 workers running rooms: (demo, children, work dir)."""
    demo = subprocess.Popen(DEMO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = demo.stdout.readline()
    while "progress:" not in line:  # printed once every worker started
        assert line, demo.stderr.read()
        line = demo.stdout.readline()
    children = _children(demo.pid)
    assert len(children) == 4, children
    endpoint = next(c for c in children.values() if "--worker-endpoint" in c)
    workdir = Path(endpoint.split("--worker-endpoint unix://")[1].split()[0]).parent
    assert workdir.is_dir()
    return demo, children, workdir


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_every_child_cleans_the_work_directory_and_exits_with_one_line(signum, code):
    demo, children, workdir = _running_demo()
    demo.send_signal(signum)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == code, err
    assert err.strip().splitlines() == [
        f"demo stopped by {signal.Signals(signum).name}: 4 processes stopped, work directory removed"
    ]
    assert not [pid for pid in children if _alive(pid)], children
    assert not workdir.exists()


def test_a_killed_demo_takes_its_children_along():
    # SIGKILL: the demo runs no cleanup; each child gets SIGTERM from the kernel
    # (its parent-death signal) and stops as on any SIGTERM
    demo, children, workdir = _running_demo()
    demo.kill()
    demo.communicate(timeout=60)
    deadline = time.monotonic() + 60  # a generous bound: each child drains first
    while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], children
    shutil.rmtree(workdir, ignore_errors=True)  # the demo's own cleanup did not run


def test_a_child_that_dies_stops_the_demo_at_once_with_its_log():
    demo, children, workdir = _running_demo()
    sidecar = next(pid for pid, cmd in children.items() if "serve --role decode" in cmd)
    os.kill(sidecar, signal.SIGKILL)
    started = time.monotonic()
    _, err = demo.communicate(timeout=60)
    assert time.monotonic() - started < 20  # not the demo's timeout (300 s)
    assert demo.returncode == 1, err
    assert (
        "demo failed: sidecar-decode0 exited with -9 during the run; the end of its log "
        "(sidecar-decode0.log)" in err
    ), err
    assert not [pid for pid in children if _alive(pid)], children
    # the failed run's logs stay, and the demo says where
    assert f"logs of the failed run kept in {workdir} " in err, err
    assert (workdir / "sidecar-decode0.log").is_file() and (workdir / "worker-decode0.log").is_file()
    shutil.rmtree(workdir)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--decode-tp", "3"],
            "pd-transfer: error: --decode-tp 3: llama-3.1-8b: attention.num_kv_heads "
            "8 is not divisible by attn_tp_size 3",
        ),
        (["--model", "gpt-5"], "pd-transfer: error: --model gpt-5: unknown model preset 'gpt-5'"),
        (["--requests", "0"], "argument --requests: expected a positive number, got 0"),
    ],
)
def test_invalid_arguments_exit_2_before_any_process_starts(argv, message):
    demo = subprocess.Popen(
        [sys.executable, "-m", "pd_transfer.cli", "demo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started_children = set()
    while demo.poll() is None:
        started_children |= set(_children(demo.pid))
        time.sleep(0.01)
    out, err = demo.communicate()
    assert demo.returncode == 2, out + err
    assert message in err and out == ""
    assert not started_children
