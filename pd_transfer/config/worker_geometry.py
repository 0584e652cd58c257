"""Worker geometry configs: what a worker registers, read from a TOML file.

A worker config names a model (a preset from ``configs/models/`` or an inline
``[model]`` table) and how the worker runs it: role, attention TP and PP
sizes, page size, KV layout and dtype, pool capacities. ``pd-transfer check``
builds every rank's registration from two such files and reconciles them
offline, exactly as the sidecars would online.

Every bad field is reported at once, each with its path and the accepted
values, as one :class:`ConfigError`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.errors import ConfigError, PdTransferError, Reason
from pd_transfer.layout.dtypes import ITEMSIZE_BY_DTYPE
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.presets import ModelSpec, load_preset, model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import KV_LAYOUTS, Layout

_FIELDS: dict[str, tuple[type, Any]] = {
    # name: (type, default); default None means required
    "role": (str, None),
    "model": (str, ""),
    "attn_tp_size": (int, None),
    "pp_size": (int, 1),
    "pp_layers": (list, []),  # layers per stage, first to last; [] splits evenly
    "page_size": (int, 16),
    "kv_layout": (str, "nhd"),
    "kv_dtype": (str, ""),
    "num_pages": (int, 1024),
    "num_slots": (int, 8),
    "num_aux_rows": (int, 8),
}


@dataclass(frozen=True)
class WorkerConfig:
    source: str
    role: Role
    model: ModelSpec
    attn_tp_size: int
    pp_size: int
    pp_layers: tuple[int, ...] | None
    page_size: int
    kv_layout: Layout
    kv_dtype: str | None
    num_pages: int
    num_slots: int
    num_aux_rows: int

    def describe(self) -> str:
        dtype = self.kv_dtype or "model default"
        split = "" if self.pp_layers is None else f" pp_layers={list(self.pp_layers)}"
        return (
            f"{self.model.name} attn_tp={self.attn_tp_size} pp={self.pp_size}{split} "
            f"page_size={self.page_size} kv_layout={self.kv_layout.value} kv_dtype={dtype}"
        )

    def build_ranks(self) -> list[RankGeometry]:
        return build_instance(
            self.model,
            self.role,
            self.attn_tp_size,
            self.pp_size,
            page_size=self.page_size,
            kv_layout=self.kv_layout,
            num_pages=self.num_pages,
            num_swa_pages=self.num_pages,
            num_slots=self.num_slots,
            num_aux_rows=self.num_aux_rows,
            kv_dtype=self.kv_dtype or None,
            pp_layers=self.pp_layers,
        )


def load_worker_config(path: str | Path) -> WorkerConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read worker config: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return worker_config_from_table(data, str(path))


def worker_config_from_table(data: dict[str, Any], source: str) -> WorkerConfig:
    problems: list[str] = []
    worker = data.get("worker")
    if not isinstance(worker, dict):
        raise ConfigError(f"{source}: missing [worker] table (keys: {', '.join(_FIELDS)})")
    unknown = sorted(set(worker) - set(_FIELDS))
    if unknown:
        problems.append(f"worker: unknown key(s) {unknown}; accepted: {', '.join(_FIELDS)}")
    values: dict[str, Any] = {}
    for name, (kind, default) in _FIELDS.items():
        value = worker.get(name, default)
        if value is None:
            problems.append(f"worker.{name}: required")
        elif not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"worker.{name}: expected {kind.__name__}, got {value!r}")
        else:
            values[name] = value
    problems += _check_values(values)
    model = None
    if not problems:
        try:
            model = _model(values.get("model", ""), data.get("model"), source)
        except PdTransferError as err:
            problems.append(err.message)
    if problems or model is None:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{source}: invalid worker config: {len(problems)} problem(s)\n{lines}")
    return WorkerConfig(
        source=source,
        role=Role(values["role"]),
        model=model,
        attn_tp_size=values["attn_tp_size"],
        pp_size=values["pp_size"],
        pp_layers=tuple(values["pp_layers"]) or None,
        page_size=values["page_size"],
        kv_layout=Layout(values["kv_layout"]),
        kv_dtype=values["kv_dtype"] or None,
        num_pages=values["num_pages"],
        num_slots=values["num_slots"],
        num_aux_rows=values["num_aux_rows"],
    )


def _check_values(values: dict[str, Any]) -> list[str]:
    problems = []
    roles = [r.value for r in Role]
    if "role" in values and values["role"] not in roles:
        problems.append(f"worker.role: {values['role']!r} is not one of {roles}")
    layouts = [layout.value for layout in KV_LAYOUTS]
    if "kv_layout" in values and values["kv_layout"] not in layouts:
        problems.append(f"worker.kv_layout: {values['kv_layout']!r} is not one of {layouts}")
    if values.get("kv_dtype") and values["kv_dtype"] not in ITEMSIZE_BY_DTYPE:
        problems.append(f"worker.kv_dtype: {values['kv_dtype']!r} is not one of {sorted(ITEMSIZE_BY_DTYPE)}")
    for name in ("attn_tp_size", "pp_size", "page_size", "num_pages", "num_slots", "num_aux_rows"):
        if name in values and values[name] <= 0:
            problems.append(f"worker.{name}: must be a positive integer, got {values[name]}")
    layers = values.get("pp_layers", [])
    if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in layers):
        problems.append(f"worker.pp_layers: must be positive layer counts, one per stage, got {layers}")
    elif layers and len(layers) != values.get("pp_size", len(layers)):
        problems.append(f"worker.pp_layers: {len(layers)} counts for pp_size {values.get('pp_size')}")
    return problems


def _model(preset: str, table: Any, source: str) -> ModelSpec:
    if table is not None and preset:
        raise ConfigError(
            "worker.model and a [model] table are both given; use one", code=Reason.INVALID_CONFIG
        )
    if table is not None:
        if not isinstance(table, dict):
            raise ConfigError("model: expected a table")
        return model_from_table(table, source)
    if not preset:
        raise ConfigError("worker.model: required (a preset name) unless a [model] table is given")
    try:
        return load_preset(preset)
    except ConfigError as err:
        raise ConfigError(f"worker.model: {err.message}", code=err.code, hint=err.hint) from None
