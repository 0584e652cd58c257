"""The SGLang backend's settings, from the environment.

:class:`BackendSettings` reads pd-transfer's ``PD_TRANSFER_SGLANG_*``
variables; :func:`deferred_release_enabled` reads SGLang's own switch for
deferred release of decode's KV. A bad value is a
:class:`~pd_transfer.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ConfigError


@dataclass(frozen=True)
class BackendSettings:
    """The backend's settings, from ``PD_TRANSFER_SGLANG_*`` variables.

    ``worker_endpoint`` is this rank's sidecar; ``{gpu_id}``, ``{tp_rank}``,
    ``{pp_rank}`` and ``{dp_rank}`` (its DP group) are filled in per rank.
    ``bootstrap_port`` (0: SGLang's ``--disaggregation-bootstrap-port``) is
    where prefill rank 0's sidecar serves its bootstrap (DP group ``d``'s: that
    port plus ``d``); ``prefill_dp_size`` (decode) is how many DP groups the
    prefill instances have. The client's shared
    secret comes from ``PD_TRANSFER_SECRET_FILE`` / ``PD_TRANSFER_SECRET``.
    """

    worker_endpoint: str = "unix:///run/pd-transfer/gpu{gpu_id}/worker.sock"
    bootstrap_port: int = 0
    call_timeout_s: float = 10.0
    register_timeout_s: float = 60.0
    bootstrap_timeout_s: float = 300.0
    prefill_dp_size: int = 1

    @classmethod
    def from_environ(cls, environ: Any = None) -> BackendSettings:
        environ = os.environ if environ is None else environ
        prefix = "PD_TRANSFER_SGLANG_"
        values: dict[str, Any] = {}
        names = {prefix + name.upper() for name in cls.__dataclass_fields__}
        unknown = sorted(v for v in environ if v.startswith(prefix) and v not in names)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(names), n=1)
            raise ConfigError(
                f"{unknown[0]}: not a setting of the SGLang backend"
                + (f" (did you mean {close[0]}?)" if close else "")
                + f"; its settings are {', '.join(sorted(names))}"
            )
        for name, default in cls.__dataclass_fields__.items():
            raw = environ.get(prefix + name.upper())
            if raw is None:
                continue
            kind: type[Any] = type(default.default)  # every field has a default: int or str
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ConfigError(f"{prefix}{name.upper()}={raw!r}: expected {kind.__name__}") from None
            if kind is not str and values[name] < 0:
                raise ConfigError(f"{prefix}{name.upper()}={raw!r}: must not be negative")
        if values.get("prefill_dp_size", 1) < 1:
            raise ConfigError(f"{prefix}PREFILL_DP_SIZE={values['prefill_dp_size']}: must be at least 1")
        return cls(**values)

    def endpoint_for(self, kv_args: Any, dp_rank: int = 0) -> str:
        return self.worker_endpoint.format(
            gpu_id=getattr(kv_args, "gpu_id", 0),
            tp_rank=kv_args.engine_rank,
            pp_rank=kv_args.pp_rank,
            dp_rank=dp_rank,
        )


def deferred_release_enabled() -> bool:
    """SGLang's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` (False where unknown)."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())
    except (ImportError, AttributeError):
        return False


def force_query_prefill_dp_rank() -> bool:
    """SGLang's ``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`` (False where unknown)."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get())
    except (ImportError, AttributeError):
        return False
