"""The ``pd-transfer`` command line.

Exit codes are part of the interface:

    0  success (for ``check``: the two configs are reconcilable)
    1  the configs cannot be reconciled (every mismatch is printed)
    2  invalid input: unreadable file, unknown preset, bad value (one line per
       problem, naming the field)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pd_transfer import __version__
from pd_transfer.commands.reports import check_report, plan_report
from pd_transfer.config.worker_geometry import load_worker_config
from pd_transfer.errors import ConfigError, GeometryError, PdTransferError
from pd_transfer.layout.geometry import Role
from pd_transfer.memory import orphans as shm_orphans

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_INVALID = 2

_DESCRIPTION = """\
pd-transfer moves KV cache and Mamba/linear-attention state from prefill
workers to decode workers, across different tensor-parallel sizes and memory
layouts, and refuses loudly (before any traffic) when the two sides cannot be
reconciled.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-transfer",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 1 not reconcilable, 2 invalid input",
    )
    parser.add_argument("--version", action="version", version=f"pd-transfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_check(sub)
    _add_plan(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_keygen(sub)
    _add_identity(sub)
    _add_status(sub)
    shm_orphans.add_command(sub)
    return parser


def _add_check(sub) -> None:
    check = sub.add_parser(
        "check",
        help="reconcile two worker configs offline and print the verdicts",
        description="Build every rank's registration from a prefill and a decode worker "
        "config, reconcile them as the sidecars would, and print for every rank "
        "pair that must talk the verdict per pool and the size of the plan for a "
        "sample request (descriptors, byte runs, bytes), or every mismatch.",
        epilog="exit codes: 0 reconcilable, 1 not reconcilable, 2 invalid input",
    )
    _add_pair_args(check)
    check.set_defaults(handler=_cmd_check)


def _add_plan(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the detailed transfer plan of one rank pair",
        description="Like check, then print the first descriptors of the plan between one "
        "prefill rank and one decode rank.",
    )
    _add_pair_args(plan)
    plan.add_argument(
        "--decode-rank",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="decode attention-TP rank to plan for (default 0)",
    )
    plan.add_argument(
        "--limit",
        type=_positive_int,
        default=12,
        metavar="N",
        help="descriptors to print per pool (default 12)",
    )
    plan.set_defaults(handler=_cmd_plan)


def _add_keygen(sub) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="write a CURVE keypair and a shared secret for a deployment",
        description="Write curve.key (CURVE secret key, Z85), curve.pub (its public key) and "
        "secret (a 32-byte shared secret, hex) into DIR, each with mode 0600. Point "
        "curve_secret_key_file at curve.key and secret_file at secret on every "
        "sidecar; give workers the same secret file (PD_TRANSFER_SECRET_FILE).",
        epilog="exit codes: 0 written, 2 a file exists (see --force) or DIR is unwritable",
    )
    keygen.add_argument("--out", required=True, metavar="DIR", help="directory to write the keys to")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")
    keygen.set_defaults(handler=_cmd_keygen)


def _add_status(sub) -> None:
    status = sub.add_parser(
        "status",
        help="print a running sidecar's peers, verdicts and live rooms",
        description="Read a sidecar's /status endpoint and print it as tables.",
        epilog="exit codes: 0 ready, 1 not ready, 2 cannot reach the sidecar",
    )
    status.add_argument(
        "--addr",
        default=_default_http_address(),
        metavar="HOST:PORT",
        help="the sidecar's HTTP address, http_host:http_port (default "
        "%(default)s, a sidecar with the default http settings)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.set_defaults(handler=_cmd_status)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="run a sidecar next to one GPU worker",
        description="Run the pd-transfer sidecar of one prefill or decode worker. The worker "
        "registers its pools through the client library on --worker-endpoint; "
        "prefill rank 0 serves the rank table on --bootstrap, the other prefill "
        "ranks announce themselves there, decode finds it from each request. "
        "Flags override the [sidecar] table of --config. SIGINT/SIGTERM drains; "
        "a second one stops at once. "
        "Authentication: peers and workers prove a shared secret read from the file "
        "secret_file (or PD_TRANSFER_SECRET_FILE) or from PD_TRANSFER_SECRET; there "
        "is deliberately no --secret flag, since any user can read a command line. "
        "Without a secret the sidecar refuses to start, unless allow_insecure = true "
        "(--insecure) turns authentication off: it then warns at every start and "
        "reports it in /status, /readyz and the pd_transfer_insecure metric.",
        epilog="exit codes: 0 stopped, 2 invalid config, 3 could not start",
    )
    from pd_transfer.config.serve_flags import add_serve_flags

    serve.add_argument("--config", metavar="FILE", help="TOML file with a [sidecar] table")
    add_serve_flags(serve)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text: key=value lines; json: one JSON object per line",
    )
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (flags > PD_TRANSFER_* > file > defaults) as TOML and exit",
    )
    serve.set_defaults(handler=_cmd_serve)


def _add_demo(sub) -> None:
    from pd_transfer.commands.demo import add_arguments

    demo = sub.add_parser(
        "demo",
        help="run a prefill and a decode instance on this machine and verify every byte",
        description="Start prefill and decode sidecars plus a simulated worker per rank on this "
        "machine (CPU, shared memory, loopback), run requests of a model preset "
        "between them, verify every destination byte against the ground truth and "
        "print a summary.",
        epilog="exit codes: 0 every byte verified, 1 a room failed or a byte differed, 2 invalid arguments",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(demo)
    demo.set_defaults(handler=_cmd_demo)


def _add_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", required=True, metavar="FILE", help="prefill worker config (TOML, see configs/)"
    )
    parser.add_argument(
        "--decode", required=True, metavar="FILE", help="decode worker config (TOML, see configs/)"
    )
    parser.add_argument(
        "--tokens",
        type=_positive_int,
        default=4096,
        metavar="N",
        help="tokens in the sample request used to size the plan (default 4096)",
    )


def _default_http_address() -> str:
    from pd_transfer.config.sidecar import SidecarConfig

    return f"{SidecarConfig.http_host}:{SidecarConfig.http_port}"


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _load_pair(args: argparse.Namespace):
    pair = _load_side(args.prefill, Role.PREFILL), _load_side(args.decode, Role.DECODE)
    for config, role in zip(pair, (Role.PREFILL, Role.DECODE)):
        if config.role is not role:
            raise ConfigError(
                f"{config.source}: worker.role is {config.role.value!r} but the file "
                f"was given as --{role.value}; pass a {role.value} worker config"
            )
    return pair


def _load_side(path: str, role: Role):
    """The worker config given as ``--prefill`` or ``--decode``; an invalid one, or one whose
    ranks cannot be built (attn_tp_size 3 over 8 kv heads), is an error naming the side and
    the file (``--decode configs/x.toml: worker.model: ...``)."""
    try:
        config = load_worker_config(path)
        config.build_ranks()
        return config
    except (ConfigError, GeometryError) as err:
        message = err.message.removeprefix(f"{path}: ")
        raise ConfigError(f"--{role.value} {path}: {message}", code=err.code, hint=err.hint) from None


def _cmd_check(args: argparse.Namespace) -> int:
    prefill, decode = _load_pair(args)
    text, ok = check_report(prefill, decode, args.tokens)
    print(text)
    return EXIT_OK if ok else EXIT_REJECTED


def _cmd_plan(args: argparse.Namespace) -> int:
    prefill, decode = _load_pair(args)
    if args.decode_rank >= decode.attn_tp_size:  # before any table: a usage error
        raise ConfigError(
            f"--decode-rank {args.decode_rank}: --decode {args.decode} has "
            f"attn_tp_size {decode.attn_tp_size}, so its ranks are 0 to "
            f"{decode.attn_tp_size - 1}"
        )
    text, ok = plan_report(prefill, decode, args.tokens, args.decode_rank, args.limit)
    print(text)
    return EXIT_OK if ok else EXIT_REJECTED


def _cmd_serve(args: argparse.Namespace) -> int:
    from pd_transfer.agent.auth import Security
    from pd_transfer.commands.serve import configure_logging, serve
    from pd_transfer.config.serve_flags import FLAG_OF, flag_overrides
    from pd_transfer.config.sidecar import load_sidecar_config

    config = load_sidecar_config(args.config, flag_overrides(args), flags=FLAG_OF)
    # an unusable or missing secret or key is invalid config (2), for --print-config too:
    # a config it prints is one serve starts with
    security = Security.from_config(config)
    if args.print_config:
        from pd_transfer.config.sidecar import render_toml

        print(render_toml(config), end="")  # secret_file is a path; the secret is never printed
        return EXIT_OK
    from pd_transfer.agent.descriptors import raise_fd_limit

    raise_fd_limit()  # descriptors for peers, strangers and their reserve (agent/descriptors.py)
    configure_logging(args.log_level, args.log_format)
    return serve(config, security)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pd_transfer.security.curve import write_keys

    try:
        paths = write_keys(args.out, force=args.force)
    except OSError as err:
        raise ConfigError(f"keygen: cannot write to {args.out}: {err.strerror}") from None
    for path in paths:
        print(path)
    return EXIT_OK


def _add_identity(sub) -> None:
    identity = sub.add_parser(
        "identity",
        help="write one sidecar's identity key and its allow-list line",
        description="Write identity.key (a CURVE secret key of this sidecar's own, Z85, mode 0600: "
        "its identity_key_file) and identity.allow (the line naming it: public key, role, agent "
        "id, decode instance) into DIR, and print that line. Collect the lines of every sidecar "
        "into the identity_allow_file of the sidecars they connect to (prefill).",
        epilog="exit codes: 0 written, 2 a file exists (see --force) or DIR is unwritable",
    )
    identity.add_argument("--role", required=True, choices=("prefill", "decode"))
    identity.add_argument("--agent-id", required=True, help="the sidecar's agent_id")
    identity.add_argument("--instance-id", default="", help="decode: the instance_id it registers under")
    identity.add_argument("--out", required=True, metavar="DIR", help="directory to write the key to")
    identity.add_argument("--force", action="store_true", help="replace existing files")
    identity.set_defaults(handler=_cmd_identity)


def _cmd_identity(args: argparse.Namespace) -> int:
    from pd_transfer.security.identity import Identity, write_identity

    who = Identity(args.role, args.agent_id, args.instance_id)
    try:
        keypair, _ = write_identity(args.out, who, force=args.force)
    except OSError as err:
        raise ConfigError(f"identity: cannot write to {args.out}: {err.strerror}") from None
    print(who.line(keypair.public))
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from pd_transfer.commands.status_view import fetch_status, render_status

    status = fetch_status(args.addr)
    print(json.dumps(status, indent=1) if args.json else render_status(status))
    return EXIT_OK if status["ready"] else EXIT_REJECTED


def _cmd_demo(args: argparse.Namespace) -> int:
    from pd_transfer.commands.demo import run_demo

    return run_demo(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except PdTransferError as err:
        print(f"pd-transfer: error: {err}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
