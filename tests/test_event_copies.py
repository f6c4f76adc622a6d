"""Events copied field by field (``Event.with_bytes``, used where a deep timeline's every event is
remade: ``predict.sharding.per_rank``, fit's batch extrapolation) equal ``dataclasses.replace``'s,
and ``TrackingResult.build`` reads each storage's category as it did: the speed-ups change no byte."""
import dataclasses

from gpulab.categories import Category
from gpulab.measure.records import Event, StorageRecord, TrackingResult
from gpulab.predict import sharding as S


def test_with_bytes_is_replace_field_for_field():
    # with_bytes names Event's fields in order: a new field must be added there too (this fails first)
    assert [f.name for f in dataclasses.fields(Event)] == ["index", "kind", "sid", "nbytes", "delta", "device",
                                                           "phase", "module", "time"]
    e = Event(7, "resize", 3, 1024, 512, "cuda:0", "backward", "model.layers.1.mlp", 0.25)
    assert e.with_bytes(4096, -17) == dataclasses.replace(e, nbytes=4096, delta=-17)
    assert e.with_bytes(4096, -17) != e


def _timeline() -> TrackingResult:
    """A small two-step-like timeline: parameters, gradients, optimizer state, activations."""
    cats = [Category.PARAMETERS, Category.PARAMETERS, Category.ACTIVATIONS, Category.GRADIENTS,
            Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.OPTIMIZER_STATE, Category.TEMPORARIES]
    phases = ["setup", "setup", "forward", "backward", "backward", "optimizer", "optimizer", "optimizer"]
    records, events = {}, []
    for sid, (cat, phase) in enumerate(zip(cats, phases)):
        n = 1000 * (sid + 1) + 3
        records[sid] = StorageRecord(sid, n, "cuda:0", "bfloat16", (n,), cat, "m", phase, "op", len(events))
        events.append(Event(len(events), "alloc", sid, n, n, "cuda:0", phase, "m", 0.0))
        if cat in (Category.ACTIVATIONS, Category.TEMPORARIES):
            events.append(Event(len(events), "free", sid, n, -n, "cuda:0", phase, "m", 0.0))
    return TrackingResult.build(records, events, "cuda:0", True)


def test_per_rank_equals_its_replace_version(monkeypatch):
    t = _timeline()
    layers = S.Layers(total=10_000, largest_layer=2_000, largest_unit=3_000)
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        for offload in (False, True) if strategy != "ddp" else (False,):
            sh = S.Sharding(4, strategy, offload)
            got = S.per_rank(t, sh, layers, 2)
            with monkeypatch.context() as m:   # the reference: every copy by dataclasses.replace
                m.setattr(Event, "with_bytes", lambda e, nbytes, delta: dataclasses.replace(e, nbytes=nbytes,
                                                                                          delta=delta))
                want = S.per_rank(t, sh, layers, 2)
            assert [dataclasses.astuple(e) for e in got.events] == [dataclasses.astuple(e) for e in want.events]
            assert (got.peak_bytes, got.peak_by_category, got.series) == (want.peak_bytes, want.peak_by_category,
                                                                          want.series)
            assert got.peak_bytes < t.peak_bytes or strategy == "ddp"   # it did shard something


def test_build_reads_categories_as_before():
    t = _timeline()
    # the reference: every event's category from its record, as build read it before
    current = {c: 0 for c in t.peak_by_category}
    peak, sizes = 0, {}
    from gpulab.formulas import cuda_rounded_bytes
    for e in t.events:
        new = 0 if e.kind == "free" else cuda_rounded_bytes(e.nbytes)
        current[t.records[e.sid].category.value] += new - sizes.get(e.sid, 0)
        sizes[e.sid] = new
        peak = max(peak, sum(current.values()))
    assert t.peak_bytes == peak and t.final_by_category == current
    assert sum(t.series[-1].values()) == t.final_bytes
