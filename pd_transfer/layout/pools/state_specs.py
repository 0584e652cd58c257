"""Per-request state of linear-attention layers: which tensors, which shapes.

A Mamba2, GDN or KDA layer keeps a fixed-size state per request (one *slot*),
not per token. Each spec here lists the tensors of one layer's slot as
:class:`StateTensor` records for one TP rank, with their axes, local shape,
shard and dtype (shapes as in SGLang ``configs/mamba_utils.py``):

    Mamba2 (Nemotron-H)  conv     (conv_dim/tp, K-1)  conv_dim = d_inner + 2*n_groups*d_state,
                                                      groups (d_inner, n_groups*d_state, n_groups*d_state)
                         ssm      (heads/tp, head_dim, d_state)
    GDN (Qwen3-Next)     conv     (conv_dim/tp, K-1)  groups (key_dim, key_dim, value_dim)
                         temporal (value_heads/tp, value_head_dim, key_head_dim)
    KDA (Kimi-Linear)    conv     (K-1, conv_dim/tp)  taps in front, groups (q, k, v)
                         temporal (heads/tp, head_dim, head_dim)

A :class:`SideStateSpec` is an extra replicated per-layer tensor (no shard).
The slot axis is added by the pool builder (:mod:`.state`).

Pure; imports the layout data modules only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pd_transfer.errors import ConfigError
from pd_transfer.layout.dtypes import itemsize
from pd_transfer.layout.pools.checks import (
    grouped_shard_for_rank,
    require_dtype,
    require_positive,
    shard_for_rank,
)
from pd_transfer.layout.views import Axis, AxisRole, ShardSpec

CONV = "conv"
SSM = "ssm"
TEMPORAL = "temporal"
STATE_TENSOR_NAMES = (CONV, SSM, TEMPORAL)


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one layer's slot on one rank (slot axis excluded)."""

    name: str
    axes: tuple[Axis, ...]
    shape: tuple[int, ...]
    shard: ShardSpec | None
    dtype: str

    @property
    def item_nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Mamba2Spec:
    num_heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    state_size: int  # ssm_state_size
    n_groups: int
    conv_kernel: int
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "n_groups"):
            require_positive(f"mamba2.{name}", getattr(self, name))
        _check_kernel("mamba2", self.conv_kernel)
        require_dtype("mamba2.conv_dtype", self.conv_dtype)
        require_dtype("mamba2.ssm_dtype", self.ssm_dtype)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    def state_tensors(self, tp_size: int, tp_rank: int) -> tuple[StateTensor, ...]:
        # groups split by whole groups: Nemotron-H n_groups 8 over tp 16 would cut a group
        shard_for_rank("mamba2.n_groups", self.n_groups, tp_size, tp_rank)
        bc = self.n_groups * self.state_size
        conv_shard = grouped_shard_for_rank(
            (
                ("mamba2.d_inner (num_heads*head_dim)", self.d_inner),
                ("mamba2.n_groups*state_size", bc),
                ("mamba2.n_groups*state_size", bc),
            ),
            tp_size,
            tp_rank,
        )
        head_shard = shard_for_rank("mamba2.num_heads", self.num_heads, tp_size, tp_rank)
        return (
            _channel_conv(conv_shard, self.conv_kernel, self.conv_dtype),
            StateTensor(
                SSM,
                (_HEAD, Axis("head_dim", AxisRole.INNER), Axis("state", AxisRole.INNER)),
                (head_shard.local_extent, self.head_dim, self.state_size),
                head_shard,
                self.ssm_dtype,
            ),
        )


@dataclass(frozen=True)
class GdnSpec:
    num_key_heads: int  # linear_num_key_heads
    key_head_dim: int  # linear_key_head_dim
    num_value_heads: int  # linear_num_value_heads
    value_head_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "key_head_dim", "num_value_heads", "value_head_dim"):
            require_positive(f"gdn.{name}", getattr(self, name))
        _check_kernel("gdn", self.conv_kernel)
        require_dtype("gdn.conv_dtype", self.conv_dtype)
        require_dtype("gdn.temporal_dtype", self.temporal_dtype)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # Qwen3-Next: 2048 + 2048 + 4096 = 8192

    def state_tensors(self, tp_size: int, tp_rank: int) -> tuple[StateTensor, ...]:
        # whole heads per rank: checking heads is stricter than checking channels
        shard_for_rank("gdn.num_key_heads", self.num_key_heads, tp_size, tp_rank)
        head_shard = shard_for_rank("gdn.num_value_heads", self.num_value_heads, tp_size, tp_rank)
        conv_shard = grouped_shard_for_rank(
            (("gdn.key_dim", self.key_dim), ("gdn.key_dim", self.key_dim), ("gdn.value_dim", self.value_dim)),
            tp_size,
            tp_rank,
        )
        return (
            _channel_conv(conv_shard, self.conv_kernel, self.conv_dtype),
            _temporal(head_shard, self.value_head_dim, self.key_head_dim, self.temporal_dtype),
        )


@dataclass(frozen=True)
class KdaSpec:
    num_heads: int
    head_dim: int
    conv_kernel: int  # short_conv_kernel_size
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"

    def __post_init__(self) -> None:
        require_positive("kda.num_heads", self.num_heads)
        require_positive("kda.head_dim", self.head_dim)
        _check_kernel("kda", self.conv_kernel)
        require_dtype("kda.conv_dtype", self.conv_dtype)
        require_dtype("kda.temporal_dtype", self.temporal_dtype)

    @property
    def projection_dim(self) -> int:
        return self.num_heads * self.head_dim

    def state_tensors(self, tp_size: int, tp_rank: int) -> tuple[StateTensor, ...]:
        head_shard = shard_for_rank("kda.num_heads", self.num_heads, tp_size, tp_rank)
        proj = ("kda.num_heads*head_dim", self.projection_dim)
        conv_shard = grouped_shard_for_rank((proj, proj, proj), tp_size, tp_rank)
        taps = self.conv_kernel - 1
        conv = StateTensor(
            CONV,
            (Axis("tap", AxisRole.OUTER), _CHANNEL),
            (taps, conv_shard.local_extent),
            conv_shard,
            self.conv_dtype,
        )
        return (conv, _temporal(head_shard, self.head_dim, self.head_dim, self.temporal_dtype))


@dataclass(frozen=True)
class SideStateSpec:
    """A replicated per-layer side tensor of ``num_elems`` elements."""

    name: str
    num_elems: int
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"side state name must be an identifier, got {self.name!r}")
        if self.name in STATE_TENSOR_NAMES:
            raise ConfigError(
                f"side state name {self.name!r} collides with a state tensor "
                f"name; reserved: {list(STATE_TENSOR_NAMES)}"
            )
        require_positive(f"side_states.{self.name}.num_elems", self.num_elems)
        require_dtype(f"side_states.{self.name}.dtype", self.dtype)

    def state_tensor(self) -> StateTensor:
        return StateTensor(self.name, (Axis("elem", AxisRole.INNER),), (self.num_elems,), None, self.dtype)


LinearSpec = Mamba2Spec | GdnSpec | KdaSpec

_HEAD = Axis("head", AxisRole.SHARD)
_CHANNEL = Axis("channel", AxisRole.SHARD)


def _channel_conv(shard: ShardSpec, conv_kernel: int, dtype: str) -> StateTensor:
    return StateTensor(
        CONV, (_CHANNEL, Axis("tap", AxisRole.INNER)), (shard.local_extent, conv_kernel - 1), shard, dtype
    )


def _temporal(head_shard: ShardSpec, value_dim: int, key_dim: int, dtype: str) -> StateTensor:
    axes = (_HEAD, Axis("value_dim", AxisRole.INNER), Axis("key_dim", AxisRole.INNER))
    return StateTensor(TEMPORAL, axes, (head_shard.local_extent, value_dim, key_dim), head_shard, dtype)


def _check_kernel(section: str, conv_kernel: int) -> None:
    require_positive(f"{section}.conv_kernel", conv_kernel)
    if conv_kernel < 2:
        raise ConfigError(
            f"{section}.conv_kernel must be at least 2 (the state keeps "
            f"conv_kernel - 1 taps), got {conv_kernel}"
        )
