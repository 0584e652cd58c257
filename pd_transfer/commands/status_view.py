"""``pd-transfer status --addr URL``: a sidecar's /status document as tables."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pd_transfer.errors import ConfigError, Reason


def fetch_status(address: str, timeout_s: float = 5.0) -> dict:
    url = address.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    try:
        with urllib.request.urlopen(url + "/status", timeout=timeout_s) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ConfigError(
            f"cannot read {url}/status: {err}",
            code=Reason.BOOTSTRAP_FAILED,
            hint="is the sidecar running, and is --addr its http_host:http_port?",
        ) from None


def render_status(status: dict) -> str:
    lines = [
        f"sidecar {status['agent_id']} ({status['role']}, rank {status.get('rank') or '-'}): "
        f"{'ready' if status['ready'] else 'NOT ready'}"
    ]
    for reason in status.get("reasons") or []:  # why not ready, each in full
        lines.append(_indented(f"  - {reason}", "    "))
    lines.append(
        "rooms: " + ", ".join(f"{k} {v}" for k, v in status["rooms_by_status"].items() if v)
        if any(status["rooms_by_status"].values())
        else "rooms: none"
    )
    if status.get("insecure"):
        lines.append("security: INSECURE (allow_insecure): no authentication on this sidecar's ports")
    if status.get("unauthenticated_engine"):
        listeners = ", ".join(status.get("engine_listeners") or []) or "-"
        lines.append(
            f"security: UNAUTHENTICATED ENGINE (allow_unauthenticated_engine): the "
            f"{status['unauthenticated_engine']} engine serves anyone on {listeners}"
        )
    if status.get("copies"):  # absent from sidecars before it was reported
        lines.append(f"copies: {status['copies']}")
    if status.get("control_sessions") is not None:  # prefill only (and newer sidecars)
        lines.append(f"control sessions: {status['control_sessions']}")
    lines += ["", f"{'peer':<22}{'state':<12}{'transport':<11}{'mode':<12}{'heard':>8}  reason"]
    for peer in status["peers"] or []:
        heard = "-" if peer["last_heard_s"] is None else f"{peer['last_heard_s']:.1f}s"
        lines.append(
            _indented(
                f"{peer['peer']:<22}{peer['state']:<12}{peer['transport'] or '-':<11}"
                f"{peer['mode'] or '-':<12}{heard:>8}  {peer['reason']}",
                " " * 4,
            )
        )
    if not status["peers"]:
        lines.append("(no peers yet)")
    live = [r for r in status["rooms"] if r["status"] not in ("success", "failed")]
    failed = [r for r in status["rooms"] if r["status"] == "failed"]
    if live or failed:
        lines += ["", f"{'room':<22}{'status':<20}{'age':>8}  reason"]
        for room in live + failed[-10:]:
            lines.append(
                _indented(
                    f"{room['room']:<22}{room['status']:<20}{room['age_s']:>7.1f}s  {room.get('reason', '')}",
                    " " * 4,
                )
            )
    return "\n".join(lines)


def _indented(text: str, prefix: str) -> str:
    """``text`` whole; its continuation lines (a rejection's mismatches) indented by ``prefix``."""
    first, *rest = text.split("\n")
    return "\n".join([first] + [prefix + line for line in rest])
