"""Data-parallel groups: which prefill sidecars hold a request, and what is refused at start.

An SGLang server with several DP groups (``--dp-size N`` replicas, or
``--attn-dp-size N`` / ``--dp-size N --enable-dp-attention``: N attention
groups inside one TP group) runs one scheduler per group, each with its own
KV pool; a request lives in exactly one group. With pd-transfer every
prefill DP group is its own pd-transfer prefill instance: the sidecar of the
group's attention-TP rank 0 serves its bootstrap on the base port plus the
group's number (``8998``, ``8999``, ... for SGLang's default
``--disaggregation-bootstrap-port``). A decode rank reaches the group SGLang
names for the request::

    prefill DP group d  ->  tcp://BOOTSTRAP_HOST:(base port + d)

SGLang's decode queue finds ``d`` as its own backends let it: the request's
``disagg_prefill_dp_rank`` when the router set one, else ``bootstrap_room %
dp_size`` (prefill's ``follow_bootstrap_room`` load balancing, its PD
default). ``dp_size`` of the prefill instances comes from
``PD_TRANSFER_SGLANG_PREFILL_DP_SIZE``: pd-transfer serves no ``/route``
or ``/query_dp_ranks``, so prefill settings that need them are refused at
start, by name, with the reason.

Pure: reads the SGLang parallel state it is handed.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import ConfigError
from pd_transfer.layout.geometry import Role

# what SGLang's DP controller does with a request that names no DP rank, per method
_ROOM_FOLLOWING = ("follow_bootstrap_room", "auto")  # "auto" resolves to it on a prefill server


def dp_group(parallel: Any) -> tuple[int, int]:
    """``(group, groups)``: this rank's DP group and how many the server has, as SGLang's
    bootstrap counts them (system DP replicas, else attention-DP groups)."""
    system_size = _int(parallel, "dp_size", 1)
    if system_size > 1:
        return _int(parallel, "dp_rank", 0), system_size
    return _int(parallel, "attn_dp_rank", 0), _int(parallel, "attn_dp_size", 1)


def refuse_unsupported(parallel: Any, role: Role, environ_force_query: bool) -> None:
    """Raise :class:`ConfigError` naming the first setting this backend cannot serve.

    ``parallel`` is SGLang's published parallel configuration (``get_parallel()``:
    the resolved ``--dp-size``, ``--attn-dp-size``, ``--load-balance-method``, ...).
    """
    system_dp, attn_dp = _int(parallel, "dp_size", 1), _int(parallel, "attn_dp_size", 1)
    if getattr(parallel, "enable_dp_attention", False) and system_dp > 1:
        system_dp, attn_dp = 1, system_dp  # the deprecated spelling of --attn-dp-size
    if system_dp > 1 and attn_dp > 1:
        raise ConfigError(
            f"--dp-size {system_dp} with --attn-dp-size {attn_dp}: pd-transfer's SGLang backend "
            f"addresses one level of DP groups, not attention-DP groups inside DP replicas",
            hint="use either --dp-size or --attn-dp-size (--enable-dp-attention)",
        )
    cp_size = _int(parallel, "attn_cp_size", 1)
    for flag, used in (
        (f"--attn-cp-size {cp_size}", cp_size > 1),
        ("--enable-kv-cache-sharding", bool(getattr(parallel, "enable_kv_cache_sharding", False))),
    ):
        if used:
            raise ConfigError(
                f"{flag}: pd-transfer's SGLang backend registers each rank's whole KV pages per "
                f"attention-TP rank; pages split across context-parallel ranks are not described to it",
                hint="run without attention context parallelism, or use SGLang's mooncake backend",
            )
    method = str(getattr(parallel, "load_balance_method", "auto") or "auto")
    if role is Role.PREFILL and max(system_dp, attn_dp) > 1 and method not in _ROOM_FOLLOWING:
        raise ConfigError(
            f"--load-balance-method {method} with {max(system_dp, attn_dp)} DP groups: a request "
            f"that names no DP rank would land in a group decode cannot find (pd-transfer "
            f"serves no /query_dp_ranks; decode takes bootstrap_room % dp_size)",
            hint="use --load-balance-method follow_bootstrap_room (SGLang's prefill default); "
            "requests routed with routed_dp_rank / disagg_prefill_dp_rank stay supported",
        )
    if role is Role.DECODE and environ_force_query:
        raise ConfigError(
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK is set: pd-transfer serves no "
            "/query_dp_ranks to ask",
            hint="unset it; decode finds the prefill DP group from disagg_prefill_dp_rank or "
            "bootstrap_room % PD_TRANSFER_SGLANG_PREFILL_DP_SIZE",
        )


def bootstrap_address(sglang_addr: str, base_port: int, prefill_dp_rank: int) -> str:
    """pd-transfer's bootstrap address of prefill DP group ``prefill_dp_rank`` behind
    SGLang's ``host:port`` (``base_port`` 0: SGLang's port)."""
    host, _, port = sglang_addr.rpartition(":")
    return f"tcp://{host}:{(base_port or int(port)) + prefill_dp_rank}"


def _int(holder: Any, name: str, default: int) -> int:
    try:
        value = getattr(holder, name)
    except AttributeError:
        return default
    return default if value is None else int(value)
