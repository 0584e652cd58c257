"""The simulated worker process: ``python -m pd_transfer.sim.worker --role prefill|decode ...``.

One process per rank, next to its sidecar. It builds its rank's geometry
from a model preset (or a ``[model]`` TOML file), allocates every region in
POSIX shared memory, registers with its sidecar through the client library
and drives the schedule of :mod:`pd_transfer.sim.schedule`: prefill fills and
sends, decode expects, waits and verifies every byte it holds. It writes a
JSON report (:mod:`pd_transfer.sim.report`) to ``--report``.

Exit codes:

    0    every room succeeded (decode: and every byte checked out)
    1    a room failed or a byte differed (see the report), or registration was refused
    2    invalid arguments or a schedule that does not fit the pools (one line naming the field)
    130  interrupted (SIGINT); 143 terminated (SIGTERM)

The shared-memory segments are unlinked on every exit path, SIGTERM
included. Progress is logged (``--log-level``), never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.client import AsyncClient, Client, ClientError
from pd_transfer.client.pools import Pools, allocate_pools
from pd_transfer.errors import ConfigError, PdTransferError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.model_spec import ModelSpec
from pd_transfer.layout.presets import load_preset, model_from_table
from pd_transfer.layout.rank_builder import WorkerShape, build_rank
from pd_transfer.layout.views import KV_LAYOUTS, Layout
from pd_transfer.sim.bookkeeping import EngineOptions
from pd_transfer.sim.decode import run_decode
from pd_transfer.sim.prefill import run_prefill
from pd_transfer.sim.report import WorkerReport, write_report
from pd_transfer.sim.schedule import PoolSizes, ScheduledRequest, ScheduleSpec, build_schedule

log = logging.getLogger("pd_transfer.sim.worker")

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM; a SystemExit so no ``except Exception`` eats it."""


# -- arguments ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pd_transfer.sim.worker",
        description="A simulated prefill or decode worker for one rank, driving its sidecar.",
        epilog="exit codes: 0 ok, 1 a room failed or a byte differed, 2 invalid input, "
        "130/143 interrupted/terminated",
    )
    _add_shape_flags(parser.add_argument)
    _add_run_flags(parser.add_argument)
    return parser


def _add_shape_flags(add) -> None:
    """The model and this rank's shape and pools, and the peer's pool sizes."""
    add("--role", required=True, choices=[r.value for r in Role])
    add(
        "--model",
        required=True,
        metavar="PRESET|FILE.toml",
        help="a model preset name (configs/models) or a TOML file with a [model] table",
    )
    add("--tp-size", type=_positive, required=True, help="attention TP size of this instance")
    add("--tp-rank", type=_non_negative, required=True)
    add("--pp-size", type=_positive, default=1)
    add("--pp-rank", type=_non_negative, default=0)
    add("--page-size", type=_positive, default=16)
    add("--kv-layout", default=Layout.NHD.value, choices=[layout.value for layout in KV_LAYOUTS])
    add("--kv-dtype", default=None, help="KV dtype (default: the model's)")
    add("--num-pages", type=_positive, default=1024, help="KV pages in this rank's pool")
    add("--num-swa-pages", type=_positive, default=None, help="SWA pages (default: --num-pages)")
    add("--num-slots", type=_positive, default=None, help="state slots (default: --window)")
    add("--num-aux-rows", type=_positive, default=None, help="aux rows (default: --window)")
    add(
        "--peer-num-pages",
        type=_positive,
        default=None,
        help="KV pages of the other side's ranks (default: --num-pages); both sides derive "
        "the schedule from both sizes",
    )
    add(
        "--peer-num-swa-pages",
        type=_positive,
        default=None,
        help="SWA pages of the other side (default: --peer-num-pages)",
    )


def _add_run_flags(add) -> None:
    """The sidecar to drive, the requests to send, timeouts and outputs."""
    add("--endpoint", required=True, help="the sidecar's worker endpoint, unix://PATH or ipc://PATH")
    add("--bootstrap", default="", help="the prefill instance's bootstrap address (decode)")
    add("--worker-id", default=None, help="default: ROLE-ppP-tpT")
    add("--requests", type=_positive, default=16)
    add("--tokens", type=_positive, default=2048, help="tokens per request")
    add("--seed", type=_non_negative, default=0)
    add("--window", type=_positive, default=4, help="rooms in flight at most")
    add("--chunk-pages", type=_positive, default=64, help="prefill: pages per send")
    add(
        "--contiguous-pages",
        action="store_true",
        help="hand out pages in order instead of shuffled (best case for coalescing)",
    )
    add("--room-timeout-s", type=_seconds, default=60.0, help="wait at most this long per room")
    add("--reply-timeout-s", type=_seconds, default=10.0, help="sidecar reply timeout per call")
    add(
        "--register-timeout-s",
        type=_seconds,
        default=30.0,
        help="reply timeout of register (the sidecar may still be starting)",
    )
    add("--report", required=True, help="where to write the JSON report")
    add(
        "--progress",
        default=None,
        metavar="PATH",
        help="append one line per finished room to PATH (for a supervisor counting them)",
    )
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _positive(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


# -- setup -----------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    role: Role
    worker_id: str
    geometry: RankGeometry
    schedule: list[ScheduledRequest]
    options: EngineOptions


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or the ``[model]`` table of a TOML file."""
    if not name_or_path.endswith(".toml"):
        return load_preset(name_or_path)
    try:
        data = tomllib.loads(Path(name_or_path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--model: cannot read {name_or_path}: {err}") from None
    if "model" not in data:
        raise ConfigError(f"--model: {name_or_path} has no [model] table")
    return model_from_table(data["model"], name_or_path)


def make_setup(args: argparse.Namespace) -> Setup:
    """Geometry, schedule and options from the arguments; ConfigError naming the flag."""
    role = Role(args.role)
    if role is Role.DECODE and not args.bootstrap:
        raise ConfigError(
            "--bootstrap is required for --role decode (tcp://HOST:PORT of the prefill instance's bootstrap)"
        )
    if not args.endpoint.startswith(("unix://", "ipc://")):
        raise ConfigError(f"--endpoint must be a unix:// or ipc:// address, got {args.endpoint!r}")
    spec = load_model(args.model)
    num_slots = args.num_slots or args.window
    num_aux_rows = args.num_aux_rows or args.window
    geometry = _geometry(args, role, spec, num_slots, num_aux_rows)
    schedule = _schedule(args, role, spec, num_slots, num_aux_rows)
    worker_id = args.worker_id or f"{role.value}-pp{args.pp_rank}-tp{args.tp_rank}"
    options = EngineOptions(
        chunk_pages=args.chunk_pages,
        room_timeout_s=args.room_timeout_s,
        bootstrap_addr=args.bootstrap,
        progress_path=args.progress,
    )
    return Setup(role, worker_id, geometry, schedule, options)


def _geometry(
    args: argparse.Namespace, role: Role, spec: ModelSpec, num_slots: int, num_aux_rows: int
) -> RankGeometry:
    """This worker's rank geometry, from the shape flags."""
    return build_rank(
        spec,
        WorkerShape(
            role=role,
            tp_size=args.tp_size,
            tp_rank=args.tp_rank,
            pp_size=args.pp_size,
            pp_rank=args.pp_rank,
            page_size=args.page_size,
            kv_layout=Layout(args.kv_layout),
            num_pages=args.num_pages,
            num_swa_pages=args.num_swa_pages,
            num_slots=num_slots if spec.linear is not None else None,
            num_aux_rows=num_aux_rows,
            kv_dtype=args.kv_dtype,
        ),
    )


def _schedule(
    args: argparse.Namespace, role: Role, spec: ModelSpec, num_slots: int, num_aux_rows: int
) -> list[ScheduledRequest]:
    """The request schedule both sides derive from the seed: this side's pool sizes and the peer's."""
    has_swa = spec.sliding_attention is not None
    own = PoolSizes(
        args.num_pages, (args.num_swa_pages or args.num_pages) if has_swa else 0, num_slots, num_aux_rows
    )
    peer_pages = args.peer_num_pages or args.num_pages
    # the peer's slot and row counts do not shape the schedule (slot = window slot);
    # the peer checks its own against the window
    peer = PoolSizes(
        peer_pages, (args.peer_num_swa_pages or peer_pages) if has_swa else 0, args.window, args.window
    )
    return build_schedule(
        ScheduleSpec(
            seed=args.seed,
            num_requests=args.requests,
            tokens=args.tokens,
            page_size=args.page_size,
            window=args.window,
            prefill=own if role is Role.PREFILL else peer,
            decode=peer if role is Role.PREFILL else own,
            swa_pages_per_request=spec.swa_pages_per_request(args.page_size),
            uses_state=spec.linear is not None,
            shuffle=not args.contiguous_pages,
        )
    )


# -- running ---------------------------------------------------------------------


def run(setup: Setup, pools: Pools, args: argparse.Namespace, report: WorkerReport) -> None:
    """Register and drive the schedule; a refused registration is a fatal report error."""
    arrays = pools.arrays
    if setup.role is Role.PREFILL:
        with Client(args.endpoint, setup.worker_id, timeout_s=args.reply_timeout_s) as client:
            client.register(
                setup.geometry, pools.handles, timeout_s=args.register_timeout_s, pp_size=args.pp_size
            )
            _registered(setup, pools, args)
            run_prefill(client, setup.geometry, arrays, setup.schedule, setup.options, report)
    else:
        asyncio.run(_run_decode(setup, pools, args, report))


def _registered(setup: Setup, pools: Pools, args: argparse.Namespace) -> None:
    log.info(
        "%s registered with %s (%d views, %d regions, %.1f MiB)",
        setup.geometry.rank_id,
        args.endpoint,
        len(setup.geometry.views),
        len(setup.geometry.regions),
        pools.nbytes / 2**20,
    )


async def _run_decode(setup: Setup, pools: Pools, args: argparse.Namespace, report: WorkerReport) -> None:
    async with AsyncClient(args.endpoint, setup.worker_id, timeout_s=args.reply_timeout_s) as client:
        await client.register(
            setup.geometry, pools.handles, timeout_s=args.register_timeout_s, pp_size=args.pp_size
        )
        _registered(setup, pools, args)
        await run_decode(client, setup.geometry, pools.arrays, setup.schedule, setup.options, report)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        setup = make_setup(args)
    except PdTransferError as err:
        log.error("invalid input: %s", err)
        return EXIT_INVALID
    report = WorkerReport(
        setup.role.value, setup.worker_id, setup.geometry.rank_id, setup.geometry.model, len(setup.schedule)
    )
    started = time.monotonic()
    exit_code = EXIT_FAILED
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with allocate_pools(setup.geometry, f"{setup.worker_id}-{os.getpid()}") as pools:
            log.info(
                "%s: %d requests of %d pages, window %d, pools %.1f MiB in shm",
                setup.geometry.rank_id,
                len(setup.schedule),
                len(setup.schedule[0].src_pages),
                args.window,
                pools.nbytes / 2**20,
            )
            run(setup, pools, args, report)
        exit_code = EXIT_OK if report.ok else EXIT_FAILED
    except ClientError as err:
        report.error = f"{err.op} failed [{err.code_text}]: {err.reason}"
        log.error("%s: %s", setup.geometry.rank_id, report.error)
    except PdTransferError as err:
        report.error = f"[{err.code.value}] {err}"
        log.error("%s: %s", setup.geometry.rank_id, report.error)
    except Exception as err:
        report.error = f"internal error: {err!r}"
        log.exception("%s: internal error", setup.geometry.rank_id)
    except Terminated:
        report.error = "terminated by SIGTERM"
        exit_code = EXIT_TERMINATED
    except KeyboardInterrupt:
        report.error = "interrupted by SIGINT"
        exit_code = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        report.elapsed_s = time.monotonic() - started
        write_report(args.report, report)
    log.info(
        "%s: %s, %d/%d rooms succeeded, report in %s",
        setup.geometry.rank_id,
        "ok" if exit_code == EXIT_OK else f"exit {exit_code}",
        sum(o.ok for o in report.outcomes),
        len(setup.schedule),
        args.report,
    )
    return exit_code


def _on_sigterm(signum: int, frame: object) -> None:
    # a second SIGTERM during cleanup is ignored: unlinking the segments is quick
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(EXIT_TERMINATED)


if __name__ == "__main__":
    sys.exit(main())
