"""Element types the layout layer knows, by their torch names.

Pure data: the layout layer never touches torch; it only needs each dtype's
size in bytes to turn element strides into byte strides.
"""

from __future__ import annotations

from pd_transfer.errors import ConfigError

ITEMSIZE_BY_DTYPE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name such as ``bfloat16``)."""
    try:
        return ITEMSIZE_BY_DTYPE[dtype]
    except KeyError:
        known = ", ".join(sorted(ITEMSIZE_BY_DTYPE))
        raise ConfigError(f"unknown dtype {dtype!r}; known dtypes: {known}") from None
