"""Reading a ``[model]`` config table into a :class:`ModelSpec`.

The table comes from a preset TOML file or a daemon config. Every problem is
collected and reported together, each naming its path and what is accepted:

    invalid model table in configs/prefill.toml: 2 problem(s)
      - model.attention.num_kv_heads: must be a positive integer, got 0
      - model.layer_cycle[1]: unknown layer kind 'ssm'; accepted: attention, ...

Layers are given by exactly one of ``layer_kinds`` (one kind per layer),
``layer_cycle`` (kinds repeated until ``num_layers``) or ``layer_pattern`` (a
Nemotron-H ``hybrid_override_pattern`` string: ``M`` mamba2, ``*``
attention, ``-`` and ``E`` no state).

Pure; imports the layout data modules and ``pd_transfer.errors`` only.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import ConfigError
from pd_transfer.layout.dtypes import ITEMSIZE_BY_DTYPE
from pd_transfer.layout.model_spec import LayerKind, ModelSpec
from pd_transfer.layout.pools.attention import AttentionSpec, MlaSpec
from pd_transfer.layout.pools.state_specs import GdnSpec, KdaSpec, Mamba2Spec, SideStateSpec

PATTERN_LEGEND: dict[str, LayerKind] = {
    "M": LayerKind.MAMBA2,
    "*": LayerKind.ATTENTION,
    "-": LayerKind.NONE,
    "E": LayerKind.NONE,
}
LAYER_KEYS = ("layer_kinds", "layer_cycle", "layer_pattern")
TOP_KEYS = ("name", "num_layers", "kv_dtype", "illustrative", "side_states") + LAYER_KEYS

# section -> (spec class, required int fields (name, minimum), optional fields)
_INT, _DTYPE = "int", "dtype"
SECTIONS: dict[str, tuple[type, dict[str, tuple[str, int]], dict[str, str]]] = {
    "attention": (AttentionSpec, {"num_kv_heads": (_INT, 1), "head_dim": (_INT, 1)}, {"v_head_dim": _INT}),
    "sliding_attention": (
        AttentionSpec,
        {"num_kv_heads": (_INT, 1), "head_dim": (_INT, 1), "window_tokens": (_INT, 1)},
        {"v_head_dim": _INT},
    ),
    "mla": (MlaSpec, {"kv_lora_rank": (_INT, 1), "qk_rope_head_dim": (_INT, 1)}, {}),
    "mamba2": (
        Mamba2Spec,
        {
            "num_heads": (_INT, 1),
            "head_dim": (_INT, 1),
            "state_size": (_INT, 1),
            "n_groups": (_INT, 1),
            "conv_kernel": (_INT, 2),
        },
        {"conv_dtype": _DTYPE, "ssm_dtype": _DTYPE},
    ),
    "gdn": (
        GdnSpec,
        {
            "num_key_heads": (_INT, 1),
            "key_head_dim": (_INT, 1),
            "num_value_heads": (_INT, 1),
            "value_head_dim": (_INT, 1),
            "conv_kernel": (_INT, 2),
        },
        {"conv_dtype": _DTYPE, "temporal_dtype": _DTYPE},
    ),
    "kda": (
        KdaSpec,
        {"num_heads": (_INT, 1), "head_dim": (_INT, 1), "conv_kernel": (_INT, 2)},
        {"conv_dtype": _DTYPE, "temporal_dtype": _DTYPE},
    ),
}


class _Reader:
    """Reads typed fields of one table, collecting problems instead of raising."""

    def __init__(self, path: str, table: Any, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        self.table = table if isinstance(table, dict) else {}
        if not isinstance(table, dict):
            problems.append(f"{path}: must be a table, got {type(table).__name__}")

    def has(self, key: str) -> bool:
        return key in self.table

    def missing(self, key: str) -> None:
        self.problems.append(f"{self.path}.{key}: missing (required)")

    def int(self, key: str, minimum: int = 1, required: bool = True) -> int | None:
        if key not in self.table:
            if required:
                self.missing(key)
            return None
        value = self.table[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{self.path}.{key}: must be an integer >= {minimum}, got {value!r}")
            return None
        return value

    def dtype(self, key: str) -> str | None:
        if key not in self.table:
            return None
        value = self.table[key]
        if value not in ITEMSIZE_BY_DTYPE:
            known = ", ".join(sorted(ITEMSIZE_BY_DTYPE))
            self.problems.append(f"{self.path}.{key}: must be one of [{known}], got {value!r}")
            return None
        return value

    def string(self, key: str, required: bool = True) -> str | None:
        if key not in self.table:
            if required:
                self.missing(key)
            return None
        value = self.table[key]
        if not isinstance(value, str) or not value:
            self.problems.append(f"{self.path}.{key}: must be a non-empty string, got {value!r}")
            return None
        return value

    def reject_unknown(self, accepted: tuple[str, ...]) -> None:
        for key in self.table:
            if key not in accepted:
                self.problems.append(f"{self.path}.{key}: unknown key; accepted keys: {', '.join(accepted)}")


def model_from_table(table: dict, source: str) -> ModelSpec:
    """A :class:`ModelSpec` from the contents of a ``[model]`` table.

    ``source`` names where the table came from (a file path) for messages.
    Raises :class:`ConfigError` listing every problem, each with its path.
    """
    problems: list[str] = []
    top = _Reader("model", table, problems)
    top.reject_unknown(TOP_KEYS + tuple(SECTIONS))
    name = top.string("name")
    num_layers = top.int("num_layers")
    kv_dtype = top.dtype("kv_dtype") if top.has("kv_dtype") else "bfloat16"
    illustrative = top.table.get("illustrative", False)
    if not isinstance(illustrative, bool):
        problems.append(f"model.illustrative: must be true or false, got {illustrative!r}")
    kinds = _layer_kinds(top, num_layers)
    specs = {section: _section_spec(top, section) for section in SECTIONS if top.has(section)}
    side_states = _side_states(top)
    if problems or name is None or kv_dtype is None:  # a missing name or dtype is a problem
        raise _error(source, problems)
    try:
        return ModelSpec(
            name=name,
            layer_kinds=kinds,
            kv_dtype=kv_dtype,
            side_states=side_states,
            source=source,
            illustrative=illustrative,
            **specs,
        )
    except ConfigError as exc:
        raise _error(source, [exc.message]) from None


def _error(source: str, problems: list[str]) -> ConfigError:
    lines = [f"invalid model table in {source}: {len(problems)} problem(s)"]
    lines += [f"  - {p}" for p in problems]
    return ConfigError("\n".join(lines))


def _section_spec(top: _Reader, section: str) -> Any:
    spec_class, required, optional = SECTIONS[section]
    before = len(top.problems)
    reader = _Reader(f"model.{section}", top.table[section], top.problems)
    if len(top.problems) > before:
        return None  # not a table: its fields would only repeat the problem
    reader.reject_unknown(tuple(required) + tuple(optional))
    values: dict[str, int | str | None] = {
        key: reader.int(key, minimum) for key, (_, minimum) in required.items()
    }
    for key, kind in optional.items():
        value = reader.int(key, 1, required=False) if kind == _INT else reader.dtype(key)
        if value is not None:
            values[key] = value
    if len(top.problems) > before:
        return None
    try:
        return spec_class(**values)
    except ConfigError as exc:
        top.problems.append(f"model.{section}: {exc.message}")
        return None


def _layer_kinds(top: _Reader, num_layers: int | None) -> tuple[LayerKind, ...]:
    given = [key for key in LAYER_KEYS if top.has(key)]
    if len(given) != 1:
        top.problems.append(
            f"model: give exactly one of {', '.join(LAYER_KEYS)}"
            + (f" (got {', '.join(given)})" if given else "")
        )
        return ()
    key = given[0]
    if key == "layer_pattern":
        kinds = _pattern_kinds(top, top.table[key])
    else:
        kinds = _listed_kinds(top, key, top.table[key])
    if key == "layer_cycle" and kinds and num_layers:
        kinds = tuple(kinds[i % len(kinds)] for i in range(num_layers))
    if num_layers is not None and kinds and len(kinds) != num_layers:
        top.problems.append(f"model.{key}: gives {len(kinds)} layers but model.num_layers is {num_layers}")
    return kinds


def _listed_kinds(top: _Reader, key: str, value: Any) -> tuple[LayerKind, ...]:
    accepted = ", ".join(k.value for k in LayerKind)
    if not isinstance(value, list) or not value:
        top.problems.append(f"model.{key}: must be a non-empty list of layer kinds ({accepted})")
        return ()
    kinds = []
    for i, item in enumerate(value):
        try:
            kinds.append(LayerKind(item))
        except ValueError:
            top.problems.append(f"model.{key}[{i}]: unknown layer kind {item!r}; accepted: {accepted}")
    return tuple(kinds) if len(kinds) == len(value) else ()


def _pattern_kinds(top: _Reader, value: Any) -> tuple[LayerKind, ...]:
    legend = ", ".join(f"{c!r}={k.value}" for c, k in PATTERN_LEGEND.items())
    if not isinstance(value, str) or not value:
        top.problems.append(f"model.layer_pattern: must be a non-empty string over {legend}")
        return ()
    bad = sorted({c for c in value if c not in PATTERN_LEGEND})
    if bad:
        top.problems.append(f"model.layer_pattern: unknown characters {bad}; accepted: {legend}")
        return ()
    return tuple(PATTERN_LEGEND[c] for c in value)


def _side_states(top: _Reader) -> tuple[SideStateSpec, ...]:
    if not top.has("side_states"):
        return ()
    items = top.table["side_states"]
    if not isinstance(items, list):
        top.problems.append("model.side_states: must be an array of tables")
        return ()
    states = []
    for i, item in enumerate(items):
        reader = _Reader(f"model.side_states[{i}]", item, top.problems)
        reader.reject_unknown(("name", "num_elems", "dtype"))
        name, num_elems = reader.string("name"), reader.int("num_elems")
        dtype = reader.dtype("dtype") if reader.has("dtype") else None
        if dtype is None and not reader.has("dtype"):
            reader.missing("dtype")
        if name is not None and num_elems is not None and dtype is not None:
            try:
                states.append(SideStateSpec(name, num_elems, dtype))
            except ConfigError as exc:
                top.problems.append(f"model.side_states[{i}]: {exc.message}")
    return tuple(states)
