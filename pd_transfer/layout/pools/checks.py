"""Checks on user-supplied numbers of the pool builders, raising ConfigError.

A pool builder takes its geometry from a preset, a config file or a test; a
bad value must be refused with a message naming the field, never with an
``assert`` or a confusing GeometryError deep inside a TensorView. This module
holds those checks, and the one TP split rule with a user-facing message
(:func:`shard_for_rank`).

Pure; imports only ``pd_transfer.errors`` and ``pd_transfer.layout.views``.
"""

from __future__ import annotations

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.dtypes import ITEMSIZE_BY_DTYPE
from pd_transfer.layout.views import ShardSpec


def require_positive(field_path: str, value: object) -> int:
    """``value`` as an int > 0, or ConfigError naming ``field_path``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field_path} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{field_path} must be a positive integer, got {value}")
    return value


def require_dtype(field_path: str, value: object) -> str:
    """``value`` as a known dtype name, or ConfigError listing the known ones."""
    if not isinstance(value, str) or value not in ITEMSIZE_BY_DTYPE:
        known = ", ".join(sorted(ITEMSIZE_BY_DTYPE))
        raise ConfigError(f"{field_path} must be one of [{known}], got {value!r}")
    return value


def require_tp_position(tp_size: int, tp_rank: int) -> None:
    require_positive("attn_tp_size", tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ConfigError(
            f"tp_rank must be in [0, {tp_size}) for attn_tp_size {tp_size}, got {tp_rank!r}",
            code=Reason.SHARD_RANGE_INVALID,
        )


def shard_for_rank(
    field_path: str, extent: int, tp_size: int, tp_rank: int, *, allow_replication: bool = False
) -> ShardSpec:
    """The canonical range of ``tp_rank`` on a plain sharded axis.

    The extent must divide by ``tp_size``. With ``allow_replication`` (KV heads
    only) an extent smaller than ``tp_size`` is replicated instead:
    ``num_kv_heads`` 2 over attn_tp_size 8 gives every rank one head, ranks
    0-3 head 0 and ranks 4-7 head 1.
    """
    require_tp_position(tp_size, tp_rank)
    _require_split(field_path, extent, tp_size, allow_replication)
    return ShardSpec.for_rank(extent, tp_size, tp_rank)


def grouped_shard_for_rank(groups: tuple[tuple[str, int], ...], tp_size: int, tp_rank: int) -> ShardSpec:
    """The shard of a concatenated axis whose ``groups`` split independently.

    ``groups`` are ``(field name, full size)`` pairs in axis order, e.g. GDN
    conv ``(("key_dim", 2048), ("key_dim", 2048), ("value_dim", 4096))``;
    every group must divide by ``tp_size``.
    """
    require_tp_position(tp_size, tp_rank)
    for name, size in groups:
        _require_split(name, size, tp_size, allow_replication=False)
    sizes = tuple(size for _, size in groups)
    return ShardSpec.for_rank(sum(sizes), tp_size, tp_rank, groups=sizes)


def _require_split(field_path: str, extent: int, tp_size: int, allow_replication: bool) -> None:
    if extent < tp_size and allow_replication:
        if tp_size % extent:
            raise ConfigError(
                f"attn_tp_size {tp_size} is not a multiple of {field_path} "
                f"{extent}: {extent} heads cannot be replicated evenly over "
                f"{tp_size} ranks",
                code=Reason.SHARD_NOT_DIVISIBLE,
            )
        return
    if extent % tp_size:
        raise ConfigError(
            f"{field_path} {extent} is not divisible by attn_tp_size {tp_size}",
            code=Reason.SHARD_NOT_DIVISIBLE,
            hint=f"use an attn_tp_size that divides {extent}",
        )
