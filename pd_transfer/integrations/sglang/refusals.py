"""SGLang settings pd-transfer's backend does not serve, refused at start by name.

The queue hook checks SGLang's disaggregation settings before it shares any
pool: a server started with one of them fails at start with a
:class:`~pd_transfer.errors.ConfigError` that names the flag and the reason,
instead of serving requests that would each fail (or, worse, move bytes to
the wrong place).

Pure: reads the settings object it is given (SGLang's ``get_disagg()``).
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import ConfigError, Reason


def refuse_unsupported(disagg: Any, *, decode: bool) -> None:
    """Raise :class:`ConfigError` naming every setting of ``disagg`` this backend cannot serve."""
    found = []
    if decode and float(getattr(disagg, "disaggregation_decode_host_receive_threshold", 1.0)) < 1:
        found.append(
            "--disaggregation-decode-host-receive-threshold "
            f"{disagg.disaggregation_decode_host_receive_threshold}: SGLang then picks the host "
            "(HiCache) pool or the device pool as each request's destination, and a pd-transfer "
            "rank registers one destination for all its requests"
        )
    if decode and bool(getattr(disagg, "disaggregation_decode_enable_radix_cache", False)):
        found.append(
            "--disaggregation-decode-enable-radix-cache: a decode-side prefix hit "
            "(decode_prefix_len > 0) has decode keep the first pages of a request, and "
            "pd-transfer moves a room's whole page list"
        )
    if found:
        raise ConfigError(
            "pd-transfer's SGLang backend does not support "
            + ("; ".join(found) if len(found) == 1 else "\n  - " + "\n  - ".join(found)),
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="start decode without these settings, or use SGLang's mooncake or nixl backend",
        )
