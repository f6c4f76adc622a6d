"""Fake runs measured once per process: what one answer measured, the next reuses.

``gpulab.fit`` runs the same step at batches 2 and 3, then the answer's batch; ``what_fits``
runs the asked recipe and its candidates at one batch; a notebook asks the same question twice.
A fake run's timeline depends only on what was run, so each is kept, in this process, under a key
naming all of it: the workload (its name, kind, inputs, sizes and a transformer's whole config),
the recipe (every field), the dtype, the batch, the card and target whose kernels were followed,
and the versions of gpulab and torch. A workload of the user's own (an ``nn.Module``, a builder,
their inputs or loss) has no key and is always run: gpulab cannot tell when it changes.

A run made with a timer (``predict.run_ops``) keeps its step's ops beside its timeline (``keep_ops``,
``kept_ops``), under the same key and forgotten with it: a timeline is the same whether or not a timer
watched its run, so a timed question reuses a timeline only where its ops were kept too.

The layouts ``predict.layer_repeat`` learns (where a model's layers repeat) are kept too, per kind of model
(its config less its sizes: ``predict.fake_runs._SIZES``) and recipe, without the sequence length or batch
(``layouts``): a run of another size or sequence length takes one only where it rebuilds that run's (k+1)-layer timeline exactly, as
a run at another batch does.

The cache holds at most ``MAX_ENTRIES`` timelines and ``MAX_EVENTS`` events in all (about 470 bytes
each with their records and series: some 100 MB; the least recently used goes first, the newest
always stays) and hands out copies, so a caller that changes what it got changes nothing kept here.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable

from gpulab.measure.tracking import TrackingResult

__all__ = ["MAX_ENTRIES", "MAX_EVENTS", "clear", "info", "keep_ops", "kept_ops", "kept_ops_by_batch", "layouts", "measured",
           "run_key", "workload_key"]

MAX_ENTRIES = 64
MAX_EVENTS = 200_000     # an 8B transformer's two-step timeline: some 15,000 events

_kept: OrderedDict[tuple, TrackingResult] = OrderedDict()
_ops: dict[tuple, Any] = {}   # a timed run's ops (predict.run_ops.RunOps: frozen), by the key of its timeline
_counts = {"hits": 0, "runs": 0}
_layouts: OrderedDict[tuple, list] = OrderedDict()   # layer_repeat's learned layouts, by model and recipe


def workload_key(model: Any, w: Any, *, own_parts: bool) -> tuple | None:
    """What makes two workloads the same fake step, or None when it cannot be told: ``model`` as
    the caller gave it (a registered name or a transformers config), ``w`` the workload made from
    it; ``own_parts``: the caller gave inputs, an input shape or a loss of their own. A transformers
    config is told by the workload made from it holding it (no second look at the config)."""
    if own_parts or not (isinstance(model, str) or model is not None and model is w.config):
        return None
    config = w.config.to_json_string(use_diff=False) if w.config is not None else None
    return (w.name, w.kind, w.input_text, w.image_size, w.seq_len, w.source, config)


def run_key(workload: tuple | None, recipe: Any, dtype: Any, batch: int, target: tuple) -> tuple | None:
    """The whole key of one fake run (None: not kept). ``target``: the card and the kernels
    followed, e.g. ``("cuda", "H100")``."""
    if workload is None:
        return None
    import torch

    from gpulab import __version__
    fields = tuple((f.name, repr(getattr(recipe, f.name))) for f in dataclasses.fields(recipe))
    return (workload, type(recipe).__name__, fields, str(dtype), int(batch), tuple(target),
            __version__, torch.__version__)


def measured(key: tuple | None, run: Callable[[], TrackingResult], *,
             fresh: bool = False) -> tuple[TrackingResult, bool]:
    """(a copy of the timeline kept under ``key``, or of ``run()``'s, now kept; whether it was
    reused). ``fresh``: run again and keep the new timeline (a process's first build can differ)."""
    if key is not None and not fresh and key in _kept:
        _kept.move_to_end(key)
        _counts["hits"] += 1
        return _copied(_kept[key]), True
    if key is not None:
        _ops.pop(key, None)   # a run made again keeps only its own ops (``run`` may keep them: ``keep_ops``)
    t = run()
    _counts["runs"] += 1
    if key is not None:
        _kept[key] = _copied(t)
        _kept.move_to_end(key)
        while len(_kept) > 1 and (len(_kept) > MAX_ENTRIES or sum(len(k.events) for k in _kept.values()) > MAX_EVENTS):
            _ops.pop(_kept.popitem(last=False)[0], None)
    return t, False


def keep_ops(key: tuple | None, ops: Any) -> None:
    """Keep a timed run's ops under ``key`` (its timeline's: ``measured`` keeps that), replacing any."""
    if key is not None:
        _ops[key] = ops


def kept_ops(key: tuple | None) -> Any:
    """The ops kept under ``key`` where its timeline is kept too, else None."""
    return _ops.get(key) if key is not None and key in _kept else None


def kept_ops_by_batch(key: tuple | None) -> dict[int, Any]:
    """{batch: ops} kept for the run ``key`` names at every batch (``run_key``'s fields but the batch alike)."""
    if key is None:
        return {}
    return {k[4]: ops for k, ops in _ops.items() if k[:4] == key[:4] and k[5:] == key[5:] and k in _kept}


def layouts(key: tuple) -> list:
    """The list of layouts (``predict.layer_repeat.DepthLayout``) learned in this process for the kind of
    model and recipe ``key`` names (``run_key`` with the model's type for the model and the sequence length and
    batch left out: ``predict.fake_runs``), shared by every run of them: a layout learned at one setting is kept
    for the next, which takes it only where it rebuilds that setting's runs exactly. At most ``MAX_ENTRIES``
    keys (the least recently used goes first)."""
    kept = _layouts.setdefault(key, [])
    _layouts.move_to_end(key)
    while len(_layouts) > MAX_ENTRIES:
        _layouts.popitem(last=False)
    return kept


def clear() -> None:
    """Forget every kept timeline and layout (and the counts)."""
    _kept.clear()
    _ops.clear()
    _layouts.clear()
    _counts.update(hits=0, runs=0)


def info() -> dict[str, int]:
    """{"entries", "hits", "runs"}: timelines kept, reuses, and fake runs made through the cache."""
    return {"entries": len(_kept), **_counts}


def _copied(t: TrackingResult) -> TrackingResult:
    """A copy that shares nothing mutable with ``t`` (events are frozen and shared)."""
    return dataclasses.replace(
        t, records={sid: r.copied() for sid, r in t.records.items()}, events=list(t.events),
        series=[dict(s) for s in t.series], peak_by_category=dict(t.peak_by_category),
        final_by_category=dict(t.final_by_category))
