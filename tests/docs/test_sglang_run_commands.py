"""docs/sglang.md's sidecar commands start as written.

The Run block's shell lines are followed in order: ``export`` sets the
environment, ``pd-transfer keygen`` runs (into a temporary directory standing
for the documented one), and each ``pd-transfer serve`` goes through the CLI
parser, the configuration loader and the security check exactly as
``pd-transfer serve`` does before it binds anything, so a documented command
that would exit 2 (no secret, an unknown flag, a bad address) fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pd_transfer.agent.auth import Security
from pd_transfer.cli import build_parser, main
from pd_transfer.config.serve_flags import FLAG_OF, flag_overrides
from pd_transfer.config.sidecar import load_sidecar_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
DOC_KEYS = "/etc/pd-transfer/keys"


def run_block() -> list[str]:
    """The first fenced block under '## Run', as shell commands (continuations joined)."""
    text = DOC.read_text()
    section = text[text.index("## Run") :]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#", 1)[0].rstrip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.strip()]


def test_the_documented_sidecar_commands_pass_the_checks_serve_runs_first(tmp_path, monkeypatch, capsys):
    for name in ("PD_TRANSFER_SECRET_FILE", "PD_TRANSFER_SECRET", "PD_TRANSFER_ALLOW_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    keys = tmp_path / "keys"
    environ: dict[str, str] = {}
    served = 0
    for line in run_block():
        words = shlex.split(line.replace(DOC_KEYS, str(keys)))
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            environ[name] = value
        elif words[:2] == ["pd-transfer", "keygen"]:
            assert main(words[1:]) == 0
        elif words[:2] == ["pd-transfer", "serve"]:
            args = build_parser().parse_args(words[1:])
            config = load_sidecar_config(args.config, flag_overrides(args), environ, flags=FLAG_OF)
            security = Security.from_config(config)  # serve exits 2 here without a secret
            assert security.enabled, f"{line}: starts without authentication"
            served += 1
    assert served == 2, "the Run block shows a prefill and a decode sidecar"
    assert environ.get("PD_TRANSFER_SECRET_FILE") == str(keys / "secret")


def test_without_the_secret_the_same_command_is_refused(monkeypatch):
    for name in ("PD_TRANSFER_SECRET_FILE", "PD_TRANSFER_SECRET", "PD_TRANSFER_ALLOW_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    serve = next(line for line in run_block() if line.startswith("pd-transfer serve"))
    args = build_parser().parse_args(shlex.split(serve)[1:])
    config = load_sidecar_config(args.config, flag_overrides(args), {}, flags=FLAG_OF)
    with pytest.raises(Exception, match="secret"):
        Security.from_config(config)
