"""Where the secret and keys come from, and that the secret is never shown."""

import os
import stat
import subprocess
import sys

import pytest

from pd_transfer.cli import build_parser, main
from pd_transfer.config.sidecar import load_sidecar_config
from pd_transfer.errors import ConfigError
from pd_transfer.security import SecuritySettings, load_secret, parse_secret
from pd_transfer.security.curve import PUBLIC_KEY_FILE, SECRET_KEY_FILE, SHARED_SECRET_FILE

SECRET_HEX = "5ec7e7" + "ab" * 29


def _config(tmp_path, text, environ=None):
    path = tmp_path / "sidecar.toml"
    path.write_text('[sidecar]\nrole = "prefill"\n' + text)
    return load_sidecar_config(str(path), {}, environ or {})


def test_secret_is_hex_when_it_looks_like_hex_else_raw():
    assert parse_secret(b"ab" * 16 + b"\n", "s").value == bytes.fromhex("ab" * 16)
    assert parse_secret(b"a long passphrase!", "s").value == b"a long passphrase!"


def test_short_secret_is_a_config_error_that_does_not_show_it():
    with pytest.raises(ConfigError, match="the secret is 10 bytes, at least 16") as err:
        parse_secret(b"hunter2ab0", "PD_TRANSFER_SECRET")
    assert "hunter2" not in str(err.value)


def test_secret_comes_from_file_or_variables_and_both_are_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET_HEX)
    path.chmod(0o600)
    assert load_secret(str(path), {}).value == bytes.fromhex(SECRET_HEX)
    assert load_secret("", {"PD_TRANSFER_SECRET_FILE": str(path)}).value == bytes.fromhex(SECRET_HEX)
    assert load_secret("", {"PD_TRANSFER_SECRET": "r" * 20}).value == b"r" * 20
    assert load_secret("", {}) is None
    with pytest.raises(ConfigError, match="set one"):
        load_secret(str(path), {"PD_TRANSFER_SECRET": "r" * 20})
    with pytest.raises(ConfigError, match="cannot read it"):
        load_secret(str(tmp_path / "missing"), {})


def test_secret_never_appears_in_its_printed_forms():
    secret = parse_secret(SECRET_HEX.encode(), "s")
    for text in (repr(secret), str(secret), f"{secret}", repr(SecuritySettings(secret=secret))):
        assert SECRET_HEX not in text and "redacted" in text


def test_no_secret_is_a_config_error_that_names_keygen_and_the_opt_out(tmp_path):
    with pytest.raises(ConfigError) as err:
        SecuritySettings.from_config(_config(tmp_path, ""), {})
    text = str(err.value)
    assert "\n" not in text  # one line
    assert "pd-transfer keygen" in text and "allow_insecure = true" in text and "--insecure" in text
    off = SecuritySettings.from_config(_config(tmp_path, "allow_insecure = true\n"), {})
    assert not off.auth_enabled


def test_allow_insecure_comes_from_file_variable_or_flag(tmp_path):
    assert _config(tmp_path, "", {"PD_TRANSFER_ALLOW_INSECURE": "true"}).allow_insecure is True
    assert _config(tmp_path, "").allow_insecure is False
    with pytest.raises(ConfigError, match="PD_TRANSFER_ALLOW_INSECURE: expected true or false, got 'maybe'"):
        _config(tmp_path, "", {"PD_TRANSFER_ALLOW_INSECURE": "maybe"})
    assert build_parser().parse_args(["serve", "--insecure"]).allow_insecure is True
    assert build_parser().parse_args(["serve"]).allow_insecure is None  # unset: the file decides


def test_serve_has_no_secret_flag_and_its_help_says_why(capsys):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert not any("secret" in option for a in serve._actions for option in a.option_strings)
    help_text = " ".join(serve.format_help().split())
    assert "there is deliberately no --secret flag" in help_text
    with pytest.raises(SystemExit):
        main(["serve", "--role", "prefill", "--secret", "x" * 32])
    assert "unrecognized arguments: --secret" in capsys.readouterr().err


def test_print_config_shows_the_secret_file_path_never_the_secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET_HEX)
    env = {**os.environ, "PD_TRANSFER_SECRET_FILE": str(path)}
    out = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "serve", "--role", "decode", "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert f'secret_file = "{path}"' in out.stdout
    assert SECRET_HEX not in out.stdout + out.stderr
    env = {**os.environ, "PD_TRANSFER_SECRET": SECRET_HEX}
    env.pop("PD_TRANSFER_SECRET_FILE", None)
    out = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "serve", "--role", "decode", "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert SECRET_HEX not in out.stdout + out.stderr and 'secret_file = ""' in out.stdout


def test_serve_exits_2_for_an_unusable_secret(tmp_path, capsys, no_secret):
    path = tmp_path / "secret"
    path.write_text("short")
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[sidecar]\nrole = "prefill"\nsecret_file = "{path}"\n')
    assert main(["serve", "--config", str(config)]) == 2
    assert "the secret is 5 bytes, at least 16 are needed" in capsys.readouterr().err


def test_keygen_writes_a_keypair_and_a_secret_readable_only_by_the_owner(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keygen", "--out", str(out)]) == 0
    for name in (SECRET_KEY_FILE, PUBLIC_KEY_FILE, SHARED_SECRET_FILE):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    config = _config(
        tmp_path,
        f'curve_secret_key_file = "{out / SECRET_KEY_FILE}"\nsecret_file = "{out / SHARED_SECRET_FILE}"\n',
    )
    settings = SecuritySettings.from_config(config, {})
    assert settings.curve_keypair.public == (out / PUBLIC_KEY_FILE).read_text().strip()
    assert settings.curve_server_key == settings.curve_keypair.public  # one deployment keypair
    assert len(settings.secret.value) == 32
    assert main(["keygen", "--out", str(out)]) == 2  # never overwrites silently
    assert "already exist" in capsys.readouterr().err
    assert main(["keygen", "--out", str(out), "--force"]) == 0


def test_a_malformed_curve_key_is_a_config_error(tmp_path):
    config = _config(tmp_path, 'curve_server_key = "not-a-key"\nallow_insecure = true\n')
    with pytest.raises(ConfigError, match="expected a Z85 CURVE key of 40 characters"):
        SecuritySettings.from_config(config, {})


def test_an_insecure_sidecar_warns_that_authentication_is_off(caplog):
    from pd_transfer.agent.auth import Security

    with caplog.at_level("INFO", logger="pd_transfer.agent.auth"):
        Security(SecuritySettings()).log_mode()
        Security(SecuritySettings(secret=parse_secret(SECRET_HEX.encode(), "s"))).log_mode()
    off, on = caplog.records
    assert off.levelname == "WARNING" and "INSECURE, authentication OFF" in off.getMessage()
    assert on.levelname == "INFO" and "shared-secret authentication on" in on.getMessage()
    assert SECRET_HEX not in caplog.text
