"""Dtype sizes and byte formatting.

Bytes are the internal unit everywhere in gpulab. On display we use binary units
(KiB = 1024 B, MiB = 1024**2 B, GiB = 1024**3 B): these are what nvidia-smi and
``torch.cuda.memory_summary()`` print (nvidia-smi writes "MiB"). Decimal units
(KB = 1000 B, MB, GB) appear only where a lesson compares the two, and every
formatted number carries its unit, so the two can never be confused.

Importing this module does not import torch (the CLI checks its arguments before torch loads):
``DTYPES`` is built from torch on first use, and the functions that take a ``torch.dtype``
import it when called.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # torch is imported where it is used: ``import gpulab.units`` stays torch-free
    import torch

__all__ = [
    "DTYPES", "DtypeInfo", "GB", "GiB", "KB", "KiB", "MB", "MiB", "dtype_bytes", "dtype_name",
    "MODEL_DTYPES", "check_model_dtype_name", "format_bytes", "format_delta", "mib", "model_dtype", "parse_dtype", "round_up"
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
KB = 1000
MB = 1000**2
GB = 1000**3

_BINARY = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_DECIMAL = (("GB", GB), ("MB", MB), ("KB", KB))


@dataclass(frozen=True)
class DtypeInfo:
    """One torch dtype and what an element of it costs."""

    name: str          # canonical name without the "torch." prefix, e.g. "float32"
    dtype: torch.dtype
    bits: int          # bits per element (bool is stored as one byte: 8 bits)
    kind: str          # "float", "float8", "complex", "int", "uint", "bool", "quantized", "other"

    @property
    def bytes(self) -> int:
        return self.bits // 8


def _kind(dtype: torch.dtype, name: str) -> str:
    if str(dtype) == "torch.bool":
        return "bool"
    if name.startswith("float8") or name.startswith("float4"):
        return "float8"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    if name.startswith("q"):
        return "quantized"
    if name.startswith("uint"):
        return "uint"
    if name.startswith("int"):
        return "int"
    return "other"


def _installed_dtypes() -> dict[str, DtypeInfo]:
    """Every dtype this torch build defines, keyed by canonical name.

    Sizes come from ``torch.dtype.itemsize`` (the element size torch itself uses for
    storage), so the table is right for whatever torch is installed, including dtypes
    added after gpulab was written. Sub-byte packed dtypes (``uint1``...``uint7``,
    ``int1``...``int7``, ``float4_e2m1fn_x2``, ``bits*``, and the packed quantized
    ``quint4x2`` / ``quint2x4``, whose storage holds 2 or 4 values per byte) are skipped:
    their itemsize describes a packed container, which is not what a lesson on element
    sizes wants.
    """
    import torch
    table: dict[str, DtypeInfo] = {}
    for attr in dir(torch):
        obj = getattr(torch, attr, None)
        if not isinstance(obj, torch.dtype):
            continue
        name = str(obj).removeprefix("torch.")
        if name in table:
            continue  # aliases such as torch.float / torch.float32 share one entry
        if name.startswith("bits") or name.endswith("_x2") or name in {
            f"{p}{n}" for p in ("uint", "int") for n in range(1, 8)
        } | {"quint4x2", "quint2x4"}:
            continue
        table[name] = DtypeInfo(name=name, dtype=obj, bits=8 * obj.itemsize, kind=_kind(obj, name))
    return table


def _dtypes() -> dict[str, DtypeInfo]:
    table = globals().get("DTYPES")
    if table is None:
        table = globals()["DTYPES"] = _installed_dtypes()
    return table


def __getattr__(name: str) -> Any:
    """``DTYPES``: every dtype this torch build defines, keyed by canonical name (built, and
    torch imported, on first use; PEP 562)."""
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Short names people type, mapped to canonical names.
_ALIASES = {
    "fp64": "float64", "double": "float64",
    "fp32": "float32", "float": "float32",
    "fp16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2",
    "long": "int64", "int": "int32", "short": "int16",
    "cfloat": "complex64", "cdouble": "complex128",
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Turn ``"fp16"``, ``"torch.bfloat16"`` or a ``torch.dtype`` into a ``torch.dtype``.

    Raises ``ValueError`` naming the accepted spellings when the name is unknown.
    """
    import torch
    if isinstance(value, torch.dtype):
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    dtypes = _dtypes()
    if key in dtypes:
        return dtypes[key].dtype
    valid = ", ".join(sorted(set(dtypes) | set(_ALIASES)))
    raise ValueError(f"unknown dtype {value!r}; valid dtypes: {valid}")


def model_dtype(name: str | None) -> torch.dtype:
    """A recipe's model dtype (``gpulab.Recipe.dtype``) as a ``torch.dtype``: ``parse_dtype(name)``, and
    float32 where it is None (the model's own, as ``gpulab.step`` and ``gpulab.fit`` build it)."""
    return parse_dtype("float32" if name is None else name)


# the dtypes a model is built in (torch.set_default_dtype takes only these: models.registry)
MODEL_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_model_dtype_name(text: str) -> str:
    """The canonical name of a model's dtype typed as ``text`` ("bf16", "torch.float32" ...),
    checked without importing torch; ``ValueError`` naming the valid spellings otherwise."""
    key = str(text).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key in MODEL_DTYPES:
        return key
    valid = ", ".join(f"{n} ({', '.join(a for a, c in _ALIASES.items() if c == n)})" for n in MODEL_DTYPES)
    raise ValueError(f"unknown dtype {text!r} for a model; valid dtypes: {valid} (models are built in a "
                     f"floating-point dtype)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype (bool: 1)."""
    return parse_dtype(dtype).itemsize


def format_bytes(nbytes: float, system: str = "binary", digits: int = 1) -> str:
    """``format_bytes(3 * 2**20) == '3.0 MiB'``; ``system='decimal'`` gives MB/GB.

    Always labelled; values under one kilo-unit are shown in bytes ("512 B").
    """
    if system not in ("binary", "decimal"):
        raise ValueError(f"system must be 'binary' or 'decimal', not {system!r}")
    units = _BINARY if system == "binary" else _DECIMAL
    base = units[-1][1]  # 1024 or 1000: one step up the ladder
    sign = "-" if nbytes < 0 else ""
    n = abs(float(nbytes))
    # Pick the largest unit the value reaches, then step up once more if rounding to
    # ``digits`` would print a full step of it (1048575 B is "1.0 MiB", not "1024.0 KiB").
    for i, (label, size) in enumerate(units):
        if n >= size:
            if i > 0 and round(n / size, digits) >= base:
                label, size = units[i - 1]
            return f"{sign}{n / size:.{digits}f} {label}"
    if round(n) >= base:
        label, size = units[-1]
        return f"{sign}{n / size:.{digits}f} {label}"
    return f"{sign}{int(round(n))} B"


def format_delta(nbytes: int) -> str:
    """A change in bytes, signed: ``'+3.0 MiB'``, ``'-512 B'``, ``'0 B'``."""
    return "0 B" if nbytes == 0 else ("+" if nbytes > 0 else "") + format_bytes(nbytes)


def mib(nbytes: float) -> float:
    return nbytes / MiB


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n (0 stays 0)."""
    return int(math.ceil(n / multiple)) * multiple if n > 0 else 0
