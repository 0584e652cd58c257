"""Which of vLLM's KV-cache groups the connector moves, and the spec of every layer it registers.

vLLM splits a hybrid model's layers into KV-cache groups of one kind each
(full attention or MLA, sliding window, Mamba/GDN state), and a kind with
many more layers than another into several groups of equal size:
Qwen3-Next's 36 gated-delta-net and 12 full-attention layers become one
attention group and three GDN groups of 12 layers, each GDN group with its
own state block per request.

With one page size for every layer (vLLM pads the state pages to the
attention page), vLLM 0.33 overlays all groups on ONE backing allocation
from byte 0 (``get_kv_cache_config_from_groups``: "Groups alias from byte
0"): layer ``i`` of every group starts at the same byte, ``i`` times the
layer stride, and a block id belongs to one group at a time (one
``BlockPool`` for all groups). So layer ``i`` of state group ``g`` at block
``b`` is the same memory as layer ``i`` of state group 1 at block ``b``.
The connector therefore registers the state layers of ONE group, the one
with the most layers (vLLM's first: it assigns ``layers[g::groups]``), and
a room's state slots are the request's state block of every state group,
in group order: each registered state view at position ``i`` then carries
layer ``i`` of every group, each from its own block. Prefill and decode
list the same groups in the same order (the grouping depends on the
model's layers only), so slot ``g`` on one side is slot ``g`` on the other.
A state group with fewer layers than the registered one has no layer at
the last positions: the copy of its block there moves bytes no layer uses
(that block belongs to that group, which has no layer there), into a block
no layer on decode uses either.

This holds only for that overlay: each worker checks it at registration
(:meth:`CacheGroups.check_state_aliases`: every other state group's layer
``i`` is the registered layer ``i``'s tensor, same address, shape, strides
and dtype), and the groups of one kind must have the same spec; otherwise
the instance is refused at start naming the groups. Several full-attention
or sliding-window groups are refused by name: their pages are token-paged
lists, one per group, and a room carries one list per pool.

Imports vLLM: loaded only through the connector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from pd_transfer.errors import ConfigError
from pd_transfer.integrations.vllm.memory import LayerSpec
from pd_transfer.integrations.vllm.states import StateSpec
from pd_transfer.layout.views import Pool

_KINDS = {Pool.KV: "full-attention or MLA", Pool.SWA: "sliding-window", Pool.MAMBA: "Mamba/GDN state"}


@dataclass(frozen=True)
class CacheGroups:
    """The groups of one vLLM instance the connector moves (see the module docstring).

    ``pools``: each pool's group ids in vLLM's order (one for KV and SWA,
    every state group for MAMBA); ``specs``: the registered layers' specs
    (attention, sliding window, and the state layers of group
    ``state_group``); ``state_layers``: those state layers in group order;
    ``state_aliases``: every other state group's id and layer names.
    """

    pools: dict[Pool, tuple[int, ...]]
    specs: dict[str, LayerSpec | StateSpec]
    state_group: int | None = None
    state_layers: tuple[str, ...] = ()
    state_aliases: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def first(self, pool: Pool) -> int | None:
        groups = self.pools.get(pool)
        return groups[0] if groups else None

    @property
    def kv_group(self) -> int:
        """The full-attention or MLA group (every accepted model has one)."""
        return self.pools[Pool.KV][0]

    def ids(self, per_group, pool: Pool) -> list[int]:
        """One KV or SWA pool's block ids out of vLLM's per-group tuple (empty without either)."""
        group = self.first(pool)
        return list(per_group[group]) if per_group and group is not None else []

    def state_ids(self, per_group) -> list[list[int]]:
        """Every state group's block ids, in group order (empty without a tuple)."""
        if not per_group:
            return []
        return [list(per_group[g]) for g in self.pools.get(Pool.MAMBA, ())]

    def check_state_aliases(self, kv_caches: Mapping) -> None:
        """Refuse unless every other state group's layer ``i`` is the registered layer ``i``'s memory."""
        for group, names in self.state_aliases:
            for i, name in enumerate(names):
                mine, theirs = self.state_layers[i], name
                why = _alias_mismatch(kv_caches.get(mine), kv_caches.get(theirs))
                if why:
                    raise ConfigError(
                        f"vLLM layer {theirs!r} (KV-cache group {group}, position {i}) is not the "
                        f"memory of layer {mine!r} (KV-cache group {self.state_group}, position {i}): "
                        f"{why}. "
                        f"The pd-transfer connector moves several state groups through group "
                        f"{self.state_group}'s layers, which needs vLLM's overlaid KV cache (layer i "
                        f"of every group at the same bytes, block ids unique across groups)"
                    )


def _alias_mismatch(mine, theirs) -> str:
    """Why ``theirs`` is not the very tensor ``mine`` is ('' when it is)."""
    if mine is None or theirs is None:
        return "one of them has no KV-cache tensor"
    if mine.device != theirs.device:
        return f"it is on {theirs.device}, the other on {mine.device}"
    if mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr():
        return "it lies in another allocation"
    if mine.data_ptr() != theirs.data_ptr():
        return f"it starts {theirs.data_ptr() - mine.data_ptr():+d} bytes from the other in their allocation"
    for what, a, b in (
        ("shape", list(mine.shape), list(theirs.shape)),
        ("strides", list(mine.stride()), list(theirs.stride())),
        ("dtype", mine.dtype, theirs.dtype),
    ):
        if a != b:
            return f"its {what} is {b}, the other's {a}"
    return ""


def cache_groups(kv_cache_config, tp_size: int) -> CacheGroups:
    """Each pool's KV-cache groups and every registered layer's spec; refuses what a room cannot carry."""
    pools: dict[Pool, list[int]] = {}
    specs: dict[str, LayerSpec | StateSpec] = {}
    refused = []
    groups = kv_cache_config.kv_cache_groups
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        pool, layer = _layer_spec(spec, tp_size)
        what = _name(i, group)
        mode = _refuse_mamba_cache_mode(spec, what) if pool is Pool.MAMBA else ""
        if pool is None or layer is None:
            refused.append(f"{what} is not supported")
        elif mode:
            refused.append(mode)
        elif pool in pools and pool is not Pool.MAMBA:
            refused.append(_second_group(pool, what, pools[pool][0]))
        elif pool is Pool.MAMBA and pool in pools and spec != groups[pools[pool][0]].kv_cache_spec:
            first = pools[pool][0]
            refused.append(
                f"{what} has another spec than state group {first} "
                f"({_spec_difference(groups[first].kv_cache_spec, spec)}): several state groups "
                f"are moved through one group's layers, which needs one spec for all"
            )
        else:
            pools.setdefault(pool, []).append(i)
            if pool is not Pool.MAMBA:
                specs.update((name, layer) for name in group.layer_names)
    if Pool.KV not in pools and not refused:
        refused.append("no full-attention or MLA group")
    if refused:
        raise ConfigError(
            "the pd-transfer vLLM connector moves one full-attention or MLA group, at most one "
            "sliding-window group and any number of Mamba/GDN state groups of one spec; this "
            "model's KV-cache groups: " + "; ".join(refused)
        )
    return _with_state_groups({p: tuple(g) for p, g in pools.items()}, specs, groups, tp_size)


def _with_state_groups(pools, specs, groups, tp_size: int) -> CacheGroups:
    """Register the state group with the most layers; the others alias its layers position by position."""
    state = pools.get(Pool.MAMBA, ())
    if not state:
        return CacheGroups(pools, specs)
    main = max(state, key=lambda g: (len(groups[g].layer_names), -g))
    names = tuple(groups[main].layer_names)
    layer = mamba_state_spec(groups[main].kv_cache_spec, tp_size)
    specs.update((name, layer) for name in names)
    aliases = tuple((g, tuple(groups[g].layer_names)) for g in state if g != main)
    return CacheGroups(pools, specs, main, names, aliases)


def _spec_difference(first, other) -> str:
    """The fields two specs differ in: ``block_size 4096 against 2048``."""
    if type(first) is not type(other) or not dataclasses.is_dataclass(first):
        return f"{type(other).__name__} against {type(first).__name__}"
    return ", ".join(
        f"{f.name} {getattr(other, f.name)!r} against {getattr(first, f.name)!r}"
        for f in dataclasses.fields(first)
        if getattr(first, f.name) != getattr(other, f.name)
    )


def _name(i: int, group) -> str:
    return f"group {i} ({type(group.kv_cache_spec).__name__}: {', '.join(group.layer_names[:3])})"


def _second_group(pool: Pool, what: str, first: int) -> str:
    return (
        f"{what} is a second {_KINDS[pool]} group (group {first} is the first): each such group "
        f"holds its own token pages per request, and a room carries one {pool.value} page list "
        f"(several {_KINDS[pool]} groups, e.g. Gemma-style window groups, are not supported)"
    )


def _refuse_mamba_cache_mode(spec, what: str) -> str:
    """Why a Mamba group's ``mamba_cache_mode`` is refused ('' when it is not).

    With ``"align"`` (vLLM's prefix caching of a hybrid model) a request's
    Mamba group holds a state block per cached block boundary and moves the
    running state between them; the connector moves one state block per
    request and group (``"none"``).
    """
    if spec.mamba_cache_mode == "none":
        return ""
    return (
        f"{what} has cache_config.mamba_cache_mode={spec.mamba_cache_mode!r} (prefix caching of a "
        f"hybrid model): the connector moves one state block per request, as with 'none'"
    )


def _layer_spec(spec, tp_size: int) -> tuple[Pool | None, LayerSpec | StateSpec | None]:
    if isinstance(spec, FullAttentionSpec):
        return Pool.KV, LayerSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            mla=isinstance(spec, MLAAttentionSpec),
        )
    if isinstance(spec, SlidingWindowSpec) and not isinstance(spec, SlidingWindowMLASpec):
        return Pool.SWA, LayerSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            pool=Pool.SWA,
        )
    if isinstance(spec, MambaSpec):
        return Pool.MAMBA, mamba_state_spec(spec, tp_size)
    return None, None


def mamba_state_spec(spec: MambaSpec, tp_size: int) -> StateSpec:
    """A ``MambaSpec`` as a :class:`StateSpec`, with the global split of its conv channels.

    GDN's conv channels are ``q | k | v`` (key, key, value dims) and
    Mamba2's ``x | B | C``; vLLM's spec holds only this rank's shapes, so the
    groups are rebuilt from them: the temporal state gives the value (GDN:
    v_heads x v_dim) or x (Mamba2: heads x head_dim) share, the rest of the
    conv channels split evenly in two. A Mamba2 model whose ``n_groups`` TP
    does not divide has its B/C groups replicated by vLLM, so the rebuilt
    groups are not the model's: such a model across TP sizes is not supported.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    dim_first = is_conv_state_dim_first()
    groups = None
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if kind in ("GDN_ATTN", "MAMBA2") and len(spec.shapes) >= 2 and not spec.tp_replicated:
        conv, temporal = spec.shapes[0], spec.shapes[1]
        channels = conv[0] if dim_first else conv[-1]
        first = temporal[0] * temporal[1]  # GDN: value dim; Mamba2: x (d_inner)
        rest = channels - first
        if rest <= 0 or rest % 2:
            raise ConfigError(
                f"MambaSpec {kind}: {channels} conv channels on this rank do not split into "
                f"{first} (from the temporal state {list(temporal)}) and two equal groups"
            )
        groups = (
            (rest // 2 * tp_size,) * 2 + (first * tp_size,)
            if kind == "GDN_ATTN"
            else (first * tp_size,) + (rest // 2 * tp_size,) * 2
        )
    return StateSpec(
        shapes=tuple(tuple(s) for s in spec.shapes),
        dtypes=tuple(spec.dtypes),
        conv_groups=groups,
        conv_dim_first=dim_first,
        tp_replicated=spec.tp_replicated,
    )
