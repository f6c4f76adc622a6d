"""The table ``gpulab record`` dispatches through: each lesson core in ``record/runs/`` registers
how one kind of record entry runs on the GPU (``@record_kind("tensor bytes")``); ``kinds()`` loads
every core once and returns the filled table."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

__all__ = ["KindRunner", "head", "kinds", "record_kind"]

KindRunner = Callable[[dict[str, Any]], dict[str, Any]]
_TABLE: dict[str, KindRunner] = {}


def record_kind(*names: str) -> Callable[[KindRunner], KindRunner]:
    """Register ``fn(params) -> JSON-able dict`` as the runner of the record kinds ``names``."""
    def register(fn: KindRunner) -> KindRunner:
        for name in names:
            if name in _TABLE and _TABLE[name] is not fn:
                raise ValueError(f"record kind {name!r} is registered twice ({_TABLE[name].__module__}, {fn.__module__})")
            _TABLE[name] = fn
        return fn
    return register


def kinds() -> dict[str, KindRunner]:
    """Every record kind and its runner (the ``runs/`` modules imported once, which fills the table)."""
    from gpulab.record import runs
    for info in pkgutil.iter_modules(runs.__path__):
        importlib.import_module(f"{runs.__name__}.{info.name}")
    return dict(_TABLE)


def head(m: Any) -> dict[str, Any]:
    """Where a run happened, as every record entry states it: engine, device, label."""
    return {"engine": m.engine, "device": m.device, "label": m.label}
