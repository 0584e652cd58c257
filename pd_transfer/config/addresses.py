"""The address and port fields of the sidecar config, checked one way.

Three shapes, each with one rule and, where the fix is obvious, the value that
was probably meant:

- a port (``control_port``, ``data_port``, ``http_port``): 0-65535, 0 binds
  any free port (the ready file tells which);
- a host to bind or publish (``control_host``, ``data_host``, ``http_host``):
  a name or an IP address, without scheme or port (``0.0.0.0:9400`` ->
  ``0.0.0.0`` and the port in its own field);
- a peer address (``bootstrap``, each of ``prefill_bootstraps``):
  ``tcp://HOST:PORT`` with a fixed port, since other sidecars dial it
  (``localhost:8998`` -> ``tcp://localhost:8998``).

Each check returns the problem's text, or "" when the value is good.
"""

from __future__ import annotations

import ipaddress
import re

PORT_FIELDS = ("control_port", "data_port", "http_port")
HOST_FIELDS = {"control_host": "control_port", "data_host": "data_port", "http_host": "http_port"}
EXAMPLE_BOOTSTRAP_PORT = 8998

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(?P<port>\d+)")


def port_problem(port: int | float) -> str:
    if 0 <= port <= 65535:
        return ""
    return f"must be a port number, 0-65535 (0: any free port), got {port}"


def host_problem(field: str, host: str) -> str:
    if _is_host(host):
        return ""
    rest = host.split("://", 1)[1] if "://" in host else host
    match = _HOST_PORT.fullmatch(rest)
    if match:
        bare = match["host"]
        return (
            f"{host!r} is an address, not a host: did you mean {field} = {bare!r} and "
            f"{HOST_FIELDS[field]} = {match['port']}?"
        )
    if rest != host and _is_host(rest.rstrip("/")):
        return f"{host!r} is an address, not a host: did you mean {rest.rstrip('/')!r}?"
    if not host:
        return "must not be empty: a host name or IP address, e.g. 127.0.0.1"
    return f"{host!r} is not a host name or IP address (e.g. 127.0.0.1, 0.0.0.0, node-1.example)"


def peer_address_problem(address: str) -> str:
    """``tcp://HOST:PORT`` with a port other sidecars can dial."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    match = _HOST_PORT.fullmatch(rest)
    if match and _is_host(match["host"]):
        meant = f"tcp://{rest}"
        if scheme != "tcp":
            said = "has no scheme" if not scheme else f"is not a {scheme}:// address"
            return f"{address!r} {said}: did you mean {meant!r}?"
        if not 0 < int(match["port"]) < 65536:
            return f"{address!r}: the port must be 1-65535 (other sidecars dial it, so 0 cannot pick one)"
        return ""
    host = rest.rstrip("/")
    if _is_host(host):
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{address!r} has no port: did you mean 'tcp://{shown}:{EXAMPLE_BOOTSTRAP_PORT}'?"
    return f"{address!r} is not a tcp://HOST:PORT address (e.g. tcp://10.0.0.1:{EXAMPLE_BOOTSTRAP_PORT})"


def _is_host(host: str) -> bool:
    if not host:
        return False
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return bool(_HOST_NAME.fullmatch(host)) and ".." not in host and not host.isdigit()
    return True


def dialable_host(host: str) -> str:
    """A host a process on this machine can dial for a socket bound to ``host``: a
    wildcard bind (``0.0.0.0``, ``::``) is reached on the loopback of its family."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "::1"
    return host
