"""``pd-transfer check``: exit codes and what the operator reads.

0 when the pair reconciles (a per-rank table), 1 when it does not (every
mismatch with both values), 2 for invalid input (one line naming the field).
Most cases call :func:`pd_transfer.cli.main` in-process; a few run the real
``python -m pd_transfer.cli`` to pin the process exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_transfer.cli import EXIT_INVALID, EXIT_OK, EXIT_REJECTED, main
from pd_transfer.layout.presets import preset_names
from pd_transfer.layout.views import KV_LAYOUTS

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "configs" / "workers"
PREFILL_TP2 = str(WORKERS / "llama-3.1-8b.prefill-tp2.toml")
DECODE_TP4 = str(WORKERS / "llama-3.1-8b.decode-tp4.toml")
DECODE_TP4_FP8 = str(WORKERS / "llama-3.1-8b.decode-tp4-fp8.toml")
DECODE_PAGE64 = str(WORKERS / "llama-3.1-8b.decode-tp2-page64.toml")
TOKENS = ["--tokens", "64"]  # 4 pages: enough to size the plan, quick to build

VALID_WORKER = """\
[worker]
role = "prefill"
model = "llama-3.1-8b"
attn_tp_size = 2
"""


def _check(capsys, prefill: str, decode: str) -> tuple[int, str, str]:
    code = main(["check", "--prefill", prefill, "--decode", decode, *TOKENS])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_accepts_a_reconcilable_pair_with_a_row_per_decode_rank_and_source(capsys):
    code, out, err = _check(capsys, PREFILL_TP2, DECODE_TP4)
    assert code == EXIT_OK and err == ""
    lines = out.splitlines()
    assert "verdict: ACCEPTED" in lines
    assert lines[lines.index("verdict: ACCEPTED") + 2].split()[:3] == ["decode", "rank", "from"]
    kv_rows = [line.split() for line in lines if line.startswith("decode[") and " kv " in line]
    # decode tp 4 over prefill tp 2: decode ranks 0-1 read prefill rank 0, ranks 2-3 rank 1
    assert [(row[0], row[1], row[3]) for row in kv_rows] == [
        ("decode[pp0,tp0]", "prefill[pp0,tp0]", "sliced"),
        ("decode[pp0,tp1]", "prefill[pp0,tp0]", "sliced"),
        ("decode[pp0,tp2]", "prefill[pp0,tp1]", "sliced"),
        ("decode[pp0,tp3]", "prefill[pp0,tp1]", "sliced"),
    ]
    # 4 pages x 32 layers x K and V, one strided descriptor of 16 tokens each
    assert all(row[4:6] == ["256", "4096"] for row in kv_rows)


def test_check_rejects_and_lists_every_mismatch_with_both_values(capsys):
    code, out, err = _check(capsys, PREFILL_TP2, DECODE_TP4_FP8)
    assert code == EXIT_REJECTED and err == ""
    lines = out.splitlines()
    assert "verdict: REJECTED" in lines
    assert "cannot reconcile prefill (attn_tp=2) with decode (attn_tp=4): 2 mismatches" in lines
    for tensor in ("k", "v"):
        assert (
            f"  - kv.layer[0-31].{tensor}.dtype: prefill=bfloat16 decode=float8_e4m3fn  [dtype_mismatch]"
        ) in lines
    assert "page_size_mismatch" not in out  # its page size 32 against 16 converts
    assert "decode rank" not in out  # no plan table for a rejected pair


def test_check_shows_different_page_sizes_as_a_converted_verdict(capsys):
    code, out, err = _check(capsys, PREFILL_TP2, DECODE_PAGE64)
    assert code == EXIT_OK and err == ""
    lines = out.splitlines()
    assert "sample request: kv 4->1, aux 1" in lines  # 64 tokens: 4 pages of 16, 1 of 64
    kv_rows = [line.split() for line in lines if line.startswith("decode[") and " kv " in line]
    assert [(row[0], row[1], " ".join(row[3:6])) for row in kv_rows] == [
        ("decode[pp0,tp0]", "prefill[pp0,tp0]", "converted pages 16->64"),
        ("decode[pp0,tp1]", "prefill[pp0,tp1]", "converted pages 16->64"),
    ]
    # 32 layers x K and V: the 4 prefill pages land in one decode page, one run each tensor
    assert all(row[6:8] == ["64", "64"] for row in kv_rows)


def test_check_takes_an_uneven_pipeline_split_from_the_worker_config(capsys, tmp_path):
    path = tmp_path / "prefill-pp2.toml"
    path.write_text(VALID_WORKER + "pp_size = 2\npp_layers = [4, 28]\n")
    code, out, err = _check(capsys, str(path), DECODE_TP4)
    assert code == EXIT_OK and err == "", out
    assert out.startswith("prefill: llama-3.1-8b attn_tp=2 pp=2 pp_layers=[4, 28] page_size=16")
    kv_rows = [line.split() for line in out.splitlines() if line.startswith("decode[") and " kv " in line]
    # 4 pages x 4 layers x K and V from stage 0, x 28 layers from stage 1
    assert [(row[1], row[4]) for row in kv_rows[:2]] == [
        ("prefill[pp0,tp0]", "32"),
        ("prefill[pp1,tp0]", "224"),
    ]


@pytest.mark.parametrize(
    "layers,problem",
    [
        (
            "[4, 4]",
            "pp_layers [4, 4] must be 2 positive layer counts (one per stage) that add up to the model's 32 layers",
        ),
        ("[32]", "worker.pp_layers: 1 counts for pp_size 2"),
        ("[0, 32]", "worker.pp_layers: must be positive layer counts, one per stage, got [0, 32]"),
    ],
)
def test_check_names_the_file_of_a_split_that_does_not_cover_the_layers(capsys, tmp_path, layers, problem):
    path = tmp_path / "prefill-pp2.toml"
    path.write_text(VALID_WORKER + f"pp_size = 2\npp_layers = {layers}\n")
    code, out, err = _check(capsys, str(path), DECODE_TP4)
    assert code == EXIT_INVALID and out == ""
    assert err.startswith(f"pd-transfer: error: --prefill {path}: ") and problem in err, err


SWA40_WORKER = """\
[worker]
role = "{role}"
attn_tp_size = 1
page_size = 16

[model]
name = "swa-40"
num_layers = 2
layer_cycle = ["sliding_attention", "attention"]

[model.attention]
num_kv_heads = 8
head_dim = 64

[model.sliding_attention]
num_kv_heads = 8
head_dim = 64
window_tokens = 40
"""


def test_check_sizes_the_sample_requests_window_pages_by_the_models_window(capsys, tmp_path):
    paths = []
    for role in ("prefill", "decode"):
        paths.append(tmp_path / f"{role}.toml")
        paths[-1].write_text(SWA40_WORKER.format(role=role))
    code = main(["check", "--prefill", str(paths[0]), "--decode", str(paths[1]), "--tokens", "256"])
    out, _ = capsys.readouterr()
    assert code == EXIT_OK
    # 256 tokens: 16 kv pages; a 40-token window straddles ceil(40 / 16) + 1 = 4 pages of 16
    assert "sample request: kv 16, swa 4, aux 1" in out.splitlines(), out


def test_check_refuses_a_decode_config_passed_as_prefill(capsys):
    code, out, err = _check(capsys, DECODE_TP4, PREFILL_TP2)
    assert code == EXIT_INVALID and out == ""
    assert err == (
        f"pd-transfer: error: {DECODE_TP4}: worker.role is 'decode' but the file was "
        "given as --prefill; pass a prefill worker config\n"
    )


def _problem_line(field: str, text: str) -> str:
    return f"  - {field}: {text}"


MALFORMED = {
    # name: (file text or None for a missing file, expected stderr after "<path>: ")
    "unreadable": (None, "cannot read worker config: No such file or directory"),
    "invalid-toml": (
        "[worker\nrole = 'prefill'\n",
        "not valid TOML: Expected ']' at the end of a table declaration (at line 1, column 8)",
    ),
    "unknown-preset": (
        VALID_WORKER.replace("llama-3.1-8b", "llama-9"),
        "invalid worker config: 1 problem(s)\n"
        + _problem_line(
            "worker.model", f"unknown model preset 'llama-9'; known presets: {', '.join(preset_names())}"
        ),
    ),
    "bad-kv-layout": (
        VALID_WORKER + 'kv_layout = "nhd_paged"\n',
        "invalid worker config: 1 problem(s)\n"
        + _problem_line(
            "worker.kv_layout", f"'nhd_paged' is not one of {[layout.value for layout in KV_LAYOUTS]}"
        ),
    ),
    "zero-tp": (
        VALID_WORKER.replace("attn_tp_size = 2", "attn_tp_size = 0"),
        "invalid worker config: 1 problem(s)\n"
        + _problem_line("worker.attn_tp_size", "must be a positive integer, got 0"),
    ),
    "negative-tp": (
        VALID_WORKER.replace("attn_tp_size = 2", "attn_tp_size = -2"),
        "invalid worker config: 1 problem(s)\n"
        + _problem_line("worker.attn_tp_size", "must be a positive integer, got -2"),
    ),
    "unknown-key": (
        VALID_WORKER + "tp_size = 2\n",
        "invalid worker config: 1 problem(s)\n"
        + _problem_line(
            "worker",
            "unknown key(s) ['tp_size']; accepted: role, model, "
            "attn_tp_size, pp_size, pp_layers, page_size, kv_layout, kv_dtype, "
            "num_pages, num_slots, num_aux_rows",
        ),
    ),
    "missing-role": (
        VALID_WORKER.replace('role = "prefill"\n', ""),
        "invalid worker config: 1 problem(s)\n" + _problem_line("worker.role", "required"),
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_check_reports_invalid_config_on_one_line_naming_the_field(capsys, tmp_path, name):
    text, expected = MALFORMED[name]
    path = tmp_path / f"{name}.toml"
    if text is not None:
        path.write_text(text)
    code, out, err = _check(capsys, str(path), DECODE_TP4)
    assert code == EXIT_INVALID and out == ""
    assert err == f"pd-transfer: error: --prefill {path}: {expected}\n"


def test_check_names_the_side_and_the_file_of_an_invalid_config(capsys, tmp_path):
    path = tmp_path / "decode.toml"
    path.write_text(VALID_WORKER.replace('"prefill"', '"decode"').replace("llama-3.1-8b", "llama-9"))
    code, out, err = _check(capsys, PREFILL_TP2, str(path))
    assert code == EXIT_INVALID and out == ""
    assert err.startswith(f"pd-transfer: error: --decode {path}: invalid worker config"), err
    assert "- worker.model: unknown model preset 'llama-9'" in err


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_check_names_the_side_and_the_file_of_a_tp_size_the_model_cannot_split(capsys, tmp_path, side):
    path = tmp_path / f"{side}-tp3.toml"  # llama-3.1-8b has 8 kv heads: 3 ranks cannot share them
    path.write_text(
        VALID_WORKER.replace('"prefill"', f'"{side}"').replace("attn_tp_size = 2", "attn_tp_size = 3")
    )
    pair = (str(path), DECODE_TP4) if side == "prefill" else (PREFILL_TP2, str(path))
    code, out, err = _check(capsys, *pair)
    assert code == EXIT_INVALID and out == ""
    assert err.startswith(
        f"pd-transfer: error: --{side} {path}: attention.num_kv_heads 8 is not divisible by attn_tp_size 3"
    ), err


def test_plan_for_a_decode_rank_the_config_lacks_is_a_usage_error_before_any_table():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "plan",
            "--prefill",
            PREFILL_TP2,
            "--decode",
            DECODE_TP4,
            "--decode-rank",
            "7",
            *TOKENS,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_INVALID and result.stdout == "", result.stdout
    assert result.stderr == (
        f"pd-transfer: error: --decode-rank 7: --decode {DECODE_TP4} has "
        f"attn_tp_size 4, so its ranks are 0 to 3\n"
    )
    negative = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "plan",
            "--prefill",
            PREFILL_TP2,
            "--decode",
            DECODE_TP4,
            "--decode-rank",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        negative.returncode == EXIT_INVALID and "--decode-rank: expected an integer >= 0" in negative.stderr
    )


def test_unknown_preset_message_lists_every_known_preset(capsys, tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(VALID_WORKER.replace("llama-3.1-8b", "llama-9"))
    _, _, err = _check(capsys, str(path), DECODE_TP4)
    assert {"llama-3.1-8b", "qwen3-next-80b-a3b", "deepseek-v3"} <= set(preset_names())
    assert all(name in err for name in preset_names())


def test_bad_kv_layout_message_lists_every_accepted_layout(capsys, tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(VALID_WORKER + 'kv_layout = "paged"\n')
    _, _, err = _check(capsys, str(path), DECODE_TP4)
    for accepted in ("nhd", "hnd", "layer_first", "page_first", "page_first_direct", "page_head"):
        assert f"'{accepted}'" in err


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--help"], "exit codes: 0 ok, 1 not reconcilable, 2 invalid input"),
        (["check", "--help"], "exit codes: 0 reconcilable, 1 not reconcilable, 2 invalid input"),
    ],
)
def test_help_states_the_exit_codes(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize(
    "decode,status,marker",
    [
        (DECODE_TP4, EXIT_OK, "verdict: ACCEPTED"),
        (DECODE_TP4_FP8, EXIT_REJECTED, "verdict: REJECTED"),
        (str(WORKERS / "no-such-worker.toml"), EXIT_INVALID, "cannot read worker config"),
    ],
    ids=["accepted", "rejected", "invalid"],
)
def test_module_entry_point_exits_with_the_documented_status(decode, status, marker):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "check",
            "--prefill",
            PREFILL_TP2,
            "--decode",
            decode,
            *TOKENS,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == status
    assert marker in (result.stdout if status != EXIT_INVALID else result.stderr)


def test_serve_flags_are_sidecar_fields_and_state_their_defaults():
    """Each serve flag sets a SidecarConfig field, and --help states that field's default."""
    import dataclasses

    from pd_transfer.config.serve_flags import SERVE_FLAGS, _help
    from pd_transfer.config.sidecar import SidecarConfig

    fields = {f.name: f for f in dataclasses.fields(SidecarConfig)}
    for entry in SERVE_FLAGS:
        assert entry.field in fields, f"{entry.name} sets no field ({entry.field})"
    assert _help(next(e for e in SERVE_FLAGS if e.field == "http_port")).endswith(
        f"(default: {SidecarConfig.http_port})"
    )
    assert "(default: 1073741824 = 1 GiB)" in _help(
        next(e for e in SERVE_FLAGS if e.field == "max_inflight_nbytes_total")
    )


def test_a_bad_serve_flag_value_is_refused_naming_the_flag(capsys, monkeypatch):
    monkeypatch.delenv("PD_TRANSFER_SECRET_FILE", raising=False)
    code = main(["serve", "--role", "prefill", "--insecure", "--control-port", "70000", "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and "--control-port" in err and "70000" in err, err


def test_plan_limit_is_per_pool_so_every_pool_shows_its_first_descriptors(capsys):
    prefill, decode = (
        str(WORKERS / f"qwen3-next-80b-a3b.{side}.toml") for side in ("prefill-tp2", "decode-tp4")
    )
    assert main(["plan", "--prefill", prefill, "--decode", decode, "--limit", "2", *TOKENS]) == EXIT_OK
    out = capsys.readouterr().out
    listing = out[out.index("  src region") :].splitlines()[1:]
    pools = [line.split()[0].split(".")[0] for line in listing if not line.startswith("  ...")]
    assert pools == ["kv", "kv", "mamba", "mamba", "aux", "aux"], listing
    more = [line for line in listing if line.startswith("  ...")]
    assert [m.rsplit(" ", 2)[1] for m in more] == ["kv", "mamba", "aux"], more
