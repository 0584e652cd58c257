"""``pd-transfer demo``: a prefill and a decode instance on this machine, verified.

Starts one sidecar and one simulated worker per rank (prefill TP 2 and decode
TP 4 of Llama-3.1-8B by default), all on loopback and shared memory, runs the
requests, and prints progress while they run and a summary at the end. Every
process of the run authenticates with a shared secret made for the run (mode
0600 in its work directory). The decode workers check every destination byte against the deterministic ground
truth (:mod:`pd_transfer.sim.content`); any failed room or differing byte
makes the demo exit 1.

The arguments are checked before any process starts (the model preset, and
both instances built and reconciled as the sidecars would): invalid ones
exit 2 with the reason. A child that fails stops the demo at once, with the
end of that child's log, and a failed run keeps its work directory (every
log) and prints where. SIGINT and SIGTERM stop every child and remove the
work directory, then exit 130 or 143 with one line; SIGKILL stops them too
(:mod:`pd_transfer.processes.parent_death`).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.commands import demo_summary
from pd_transfer.commands.demo_summary import log_tail
from pd_transfer.layout.views import KV_LAYOUTS
from pd_transfer.processes.parent_death import tied_to_parent
from pd_transfer.processes.ports import spare_port
from pd_transfer.security.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret_file

EXIT_OK, EXIT_FAILED = 0, 1
DEMO_SECRET = "secret"  # an ephemeral shared secret in the work directory, made per run
CHILD_STOP_S = 10.0  # after SIGTERM, how long a child may take before it is killed
PLAIN_PROGRESS_S = 5.0  # progress lines at most this often when stdout is not a terminal


class Stopped(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM (not an Exception: nothing eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b", help="model preset (configs/models)")
    parser.add_argument("--prefill-tp", type=_positive(int), default=2, help="prefill attention TP size")
    parser.add_argument("--decode-tp", type=_positive(int), default=4, help="decode attention TP size")
    parser.add_argument("--requests", type=_positive(int), default=24, help="requests to run")
    parser.add_argument("--tokens", type=_positive(int), default=4096, help="tokens per request")
    parser.add_argument(
        "--page-size", type=_positive(int), default=16, help="tokens per KV page, both instances"
    )
    parser.add_argument(
        "--kv-layout",
        default="nhd",
        choices=[x.value for x in KV_LAYOUTS],
        help="KV layout of the decode pools (prefill uses nhd)",
    )
    parser.add_argument(
        "--transport", default="shm", choices=["shm", "tcp"], help="how prefill writes into decode's pools"
    )
    parser.add_argument("--window", type=_positive(int), default=4, help="rooms in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests' pages and content")
    parser.add_argument("--timeout-s", type=_positive(float), default=120.0, help="give up after this long")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the work directory (logs, reports) after a run that passed; a failed run keeps it anyway",
    )


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path


def _spawn(name: str, args: list[str], workdir: Path) -> Proc:
    """Start ``python args``; sidecars and workers alike read the run's secret (below)."""
    log_path = workdir / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env.update(PYTHONUNBUFFERED="1", **{SECRET_FILE_ENV: str(workdir / DEMO_SECRET)})
    popen = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
        env=env,
        start_new_session=True,
        preexec_fn=tied_to_parent(),
    )
    return Proc(name, popen, log_path)


def _wait_ready(paths: list[Path], procs: list[Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode} while starting; "
                    f"see {proc.log_path}:\n{log_tail(proc.log_path)}"
                )
        if time.monotonic() > deadline:
            raise RuntimeError("sidecars did not become ready in time")
        time.sleep(0.05)


def run_demo(args: argparse.Namespace) -> int:
    """ConfigError (exit 2) for invalid arguments, before any process starts."""
    verdicts = demo_summary.verdicts(args)
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in (signal.SIGINT, signal.SIGTERM)}
    workdir = Path(tempfile.mkdtemp(prefix="pd-transfer-demo-"))
    procs: list[Proc] = []
    stopped, code = None, EXIT_FAILED
    try:
        code = _run(args, workdir, procs, verdicts)
        return code
    except RuntimeError as err:
        print(f"demo failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except Stopped as stop:
        stopped = stop.signum
        return 128 + stop.signum
    finally:
        for signum in previous:  # the cleanup below is bounded; a second signal waits for it
            signal.signal(signum, signal.SIG_IGN)
        _stop_children(procs)
        if args.keep:
            print(f"work directory kept: {workdir}")
        elif code != EXIT_OK and stopped is None:  # a failed run keeps what tells why
            print(
                f"logs of the failed run kept in {workdir} (sidecar-*.log, worker-*.log; "
                f"docs/operations.md#a-failed-demo); remove it when done",
                file=sys.stderr,
            )
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if stopped is not None:
            print(
                f"demo stopped by {signal.Signals(stopped).name}: {len(procs)} processes "
                f"stopped{'' if args.keep else ', work directory removed'}",
                file=sys.stderr,
            )


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def _stop_children(procs: list[Proc]) -> None:
    """SIGTERM to every child still running (sidecars drain, workers unlink their pools),
    then SIGKILL to any that is still there after :data:`CHILD_STOP_S`."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CHILD_STOP_S
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def _run(args: argparse.Namespace, workdir: Path, procs: list[Proc], verdicts: str) -> int:
    """Start the sidecars, then the workers, follow them to the end; the exit code."""
    pages = math.ceil(args.tokens / args.page_size)
    num_pages = args.window * pages + 8
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    new_secret_file(workdir / DEMO_SECRET)  # every sidecar and worker of the run authenticates
    print(
        f"pd-transfer demo: {args.model}, prefill TP {args.prefill_tp} -> decode TP "
        f"{args.decode_tp}, {args.requests} requests x {args.tokens} tokens, transport "
        f"{args.transport}, decode kv layout {args.kv_layout}"
    )
    sides = [("prefill", args.prefill_tp), ("decode", args.decode_tp)]
    ready = []
    for role, tp in sides:
        for rank in range(tp):
            name = f"{role}{rank}"
            ready.append(workdir / f"{name}.ready.json")
            cmd = _sidecar_command(args, role, rank, workdir, ready[-1], bootstrap)
            procs.append(_spawn(f"sidecar-{name}", cmd, workdir))
    _wait_ready(ready, procs, 60)
    workers = []
    for role, tp in sides:
        for rank in range(tp):
            name = f"{role}{rank}"
            cmd = _worker_command(args, role, tp, rank, workdir, num_pages, bootstrap)
            workers.append(_spawn(f"worker-{name}", cmd, workdir))
    sidecars = list(procs)
    procs += workers
    started = time.monotonic()
    _show_progress(args, workdir, sidecars, workers, started)
    return demo_summary.summarise(args, workdir, workers, time.monotonic() - started, verdicts)


def _sidecar_command(
    args: argparse.Namespace, role: str, rank: int, workdir: Path, ready_file: Path, bootstrap: str
) -> list[str]:
    """The ``python`` arguments that serve the sidecar of ``role`` rank ``rank``."""
    name = f"{role}{rank}"
    cmd = [
        "-m",
        "pd_transfer.cli",
        "serve",
        "--role",
        role,
        "--agent-id",
        f"{role}-tp{rank}",
        "--worker-endpoint",
        f"unix://{workdir}/{name}.sock",
        "--transport",
        args.transport,
        "--ready-file",
        str(ready_file),
        "--http-port",
        "0",
        "--log-level",
        "warning",
    ]
    if role == "prefill":
        cmd += ["--bootstrap", bootstrap]
    return cmd


def _worker_command(
    args: argparse.Namespace, role: str, tp: int, rank: int, workdir: Path, num_pages: int, bootstrap: str
) -> list[str]:
    """The ``python`` arguments that run the simulated worker of ``role`` rank ``rank``."""
    name = f"{role}{rank}"
    cmd = [
        "-m",
        "pd_transfer.sim.worker",
        "--role",
        role,
        "--model",
        args.model,
        "--tp-size",
        str(tp),
        "--tp-rank",
        str(rank),
        "--page-size",
        str(args.page_size),
        "--kv-layout",
        args.kv_layout if role == "decode" else "nhd",
        "--num-pages",
        str(num_pages),
        "--endpoint",
        f"unix://{workdir}/{name}.sock",
        "--requests",
        str(args.requests),
        "--tokens",
        str(args.tokens),
        "--seed",
        str(args.seed),
        "--window",
        str(args.window),
        "--report",
        str(workdir / f"{name}.report.json"),
        "--progress",
        str(workdir / f"{name}.progress"),
        "--log-level",
        "WARNING",
    ]
    if role == "decode":
        cmd += ["--bootstrap", bootstrap]
    return cmd


def _check_children(sidecars: list[Proc], workers: list[Proc]) -> None:
    """A sidecar that exited, or a worker that exited with an error, while the run goes
    on: the demo stops now, with the end of that child's own log."""
    running = any(w.popen.poll() is None for w in workers)
    for proc in sidecars + workers:
        code = proc.popen.poll()
        if code is None or (proc in workers and (code == 0 or not running)):
            continue
        raise RuntimeError(
            f"{proc.name} exited with {code} during the run; the end of its log "
            f"({proc.log_path.name}):\n{log_tail(proc.log_path)}"
        )


def _show_progress(args, workdir: Path, sidecars: list[Proc], workers: list[Proc], started: float) -> None:
    """One line that updates in place, with an ETA, on a terminal; elsewhere (a log, a
    pipe) a plain line when the count changed, at most every :data:`PLAIN_PROGRESS_S`."""
    decode_progress = [workdir / f"decode{r}.progress" for r in range(args.decode_tp)]
    total = args.requests * args.decode_tp
    on_terminal = sys.stdout.isatty()
    shown, shown_s = -1, -PLAIN_PROGRESS_S
    while any(w.popen.poll() is None for w in workers):
        _check_children(sidecars, workers)
        done, now = sum(_count_lines(p) for p in decode_progress), time.monotonic()
        if done != shown and (on_terminal or now - shown_s >= PLAIN_PROGRESS_S or done == total):
            shown, shown_s = done, now
            print(_progress_line(done, total, now - started), end="\r" if on_terminal else "\n", flush=True)
        if now - started > args.timeout_s:
            raise RuntimeError(f"the demo did not finish within {args.timeout_s:.0f} s")
        time.sleep(0.5)
    done = sum(_count_lines(p) for p in decode_progress)  # the workers are done: the final count
    if done != shown:
        print(_progress_line(done, total, time.monotonic() - started), end="\r" if on_terminal else "\n")
    if on_terminal:
        print()


def _progress_line(done: int, total: int, elapsed_s: float) -> str:
    rate = done / max(elapsed_s, 1e-9)
    eta = f", about {(total - done) / rate:.0f} s left" if 0 < done < total else ""
    return f"  progress: {done}/{total} decode rank-rooms done ({rate:.1f}/s{eta})   "


def _count_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0
