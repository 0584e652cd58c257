"""Identity keys, sans-IO: the allow-list's format, the gate's check of a claimed agent id,
and the settings that identities need."""

import dataclasses

import pytest

from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.security import (
    ClientHandshake,
    Decision,
    Gate,
    SecuritySettings,
    new_routing_id,
    parse_secret,
)
from pd_transfer.security.curve import write_keys
from pd_transfer.security.identity import Identity, parse_allow_list, write_identity
from pd_transfer.security.messages import AuthResult, decode

KEY = parse_secret(b"k" * 32, "test")
PUBLIC_A = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
PUBLIC_B = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
PUBLIC_HASH = "#" + PUBLIC_B[1:]  # '#' is a Z85 character: a key may start with it


def test_the_allow_list_maps_keys_to_identities_and_only_whole_lines_are_comments():
    text = f"# who\n\n{PUBLIC_A} decode decode-0 dec-A\n{PUBLIC_HASH} prefill prefill-0\n"
    assert parse_allow_list(text, "allow") == {
        PUBLIC_A: Identity("decode", "decode-0", "dec-A"),
        PUBLIC_HASH: Identity("prefill", "prefill-0"),
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{PUBLIC_A} decode", "allow line 1: expected 'PUBLIC_KEY ROLE AGENT_ID [INSTANCE_ID]'"),
        (f"{PUBLIC_A} router r-0", "allow line 1: role 'router' is not one of prefill, decode"),
        ("tooshort decode d-0", "allow line 1: expected a Z85 CURVE key of 40 characters"),
        (f"{PUBLIC_A} decode d-0\n{PUBLIC_A} decode d-1", "allow line 2: the key is listed twice"),
        (f"{PUBLIC_A} decode d-0\n{PUBLIC_B} decode d-0", "allow line 2: agent id 'd-0' is listed twice"),
    ],
)
def test_a_bad_allow_list_line_is_a_config_error_naming_the_line(text, expected):
    with pytest.raises(ConfigError) as err:
        parse_allow_list(text, "allow")
    assert expected in err.value.message


def _gate(identities):
    return Gate(KEY, "prefill-0", identities=identities)


def test_the_gate_refuses_a_hello_claiming_another_agent_id_than_its_key():
    gate = _gate({PUBLIC_A: Identity("decode", "decode-9", "dec-B")})
    answer = gate.admit(new_routing_id(), ClientHandshake(KEY, "decode-0").hello(), PUBLIC_A)
    assert answer.decision is Decision.REFUSE and answer.error.code is Reason.IDENTITY_MISMATCH
    assert "claims agent id 'decode-0', but its identity key is 'decode-9''s" in answer.error.message
    refused = decode(answer.reply)
    assert isinstance(refused, AuthResult) and refused.reason is Reason.IDENTITY_MISMATCH


def test_the_gate_refuses_a_connection_without_a_listed_key_and_knows_who_a_listed_one_is():
    who = Identity("decode", "decode-0", "dec-A")
    gate = _gate({PUBLIC_A: who})
    unlisted = gate.admit(new_routing_id(), ClientHandshake(KEY, "decode-0").hello(), "")
    assert unlisted.error.code is Reason.IDENTITY_MISMATCH
    identity, client = new_routing_id(), ClientHandshake(KEY, "decode-0")
    proof = client.receive(gate.admit(identity, client.hello(), PUBLIC_A).reply)
    assert decode(gate.admit(identity, proof).reply).accepted
    assert gate.identity_of(identity) == who and gate.peer_of(identity) == "decode-0"


def test_without_identities_the_gate_takes_the_claimed_name_and_holds_no_identity():
    gate = Gate(KEY, "prefill-0")
    identity, client = new_routing_id(), ClientHandshake(KEY, "anyone")
    proof = client.receive(gate.admit(identity, client.hello()).reply)
    assert decode(gate.admit(identity, proof).reply).accepted
    assert gate.peer_of(identity) == "anyone" and gate.identity_of(identity) is None


def test_identity_settings_need_curve_and_are_read_at_start(tmp_path):
    keys = tmp_path / "keys"
    write_keys(str(keys))
    keypair, (key_file, line_file) = write_identity(str(tmp_path / "me"), Identity("decode", "d-0", "i"))
    assert line_file.read_text().split() == [keypair.public, "decode", "d-0", "i"]
    allow = tmp_path / "allow"
    allow.write_text(line_file.read_text())
    base = SidecarConfig(role=Role.PREFILL, secret_file=str(keys / "secret"))
    with pytest.raises(ConfigError, match="identity_key_file is presented through CURVE"):
        SecuritySettings.from_config(dataclasses.replace(base, identity_key_file=str(key_file)), {})
    with pytest.raises(ConfigError, match="identity_allow_file checks the CURVE keys"):
        SecuritySettings.from_config(dataclasses.replace(base, identity_allow_file=str(allow)), {})
    curve = dataclasses.replace(
        base,
        curve_secret_key_file=str(keys / "curve.key"),
        identity_key_file=str(key_file),
        identity_allow_file=str(allow),
    )
    settings = SecuritySettings.from_config(curve, {})
    assert settings.identity_keypair.public == keypair.public
    assert settings.identities == {keypair.public: Identity("decode", "d-0", "i")}
    assert "identities checked (1 listed)" in settings.describe()
