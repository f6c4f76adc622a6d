"""Lessons 03 and 08's slow panels made faster give the answers they gave (#47 item 9): lesson 03's
modelsize panel keeps its rows and its forward hooks read the live bytes without building a result,
lesson 08's memory guard predicts nothing for a run that ``auto`` sends to the fake engine. Latencies
are the benchmark's (``benchmarks/panel_latency.py``), never asserted here."""
import dataclasses
from collections import OrderedDict

import pytest

from gpulab.course.modelsize import modelsize_output_shapes, modelsize_vs_saved
from gpulab.record.runs import activations as A


def test_forward_hooks_read_the_live_bytes_the_result_would_give(monkeypatch):
    """``live`` (after every layer of a traced forward) asks ``MemoryTracker.live_by_category``: at every
    layer, on the cpu and the fake engine, in float32 and bfloat16, what ``result().final_by_category`` gives."""
    seen = []

    def both(ctx):
        fast = ctx.tracker.live_by_category(str(ctx.device))
        seen.append((fast, dict(ctx.tracker.result(device=str(ctx.device)).final_by_category)))
        return fast
    monkeypatch.setattr(A, "live", both)
    modelsize_vs_saved(("cnn",), 2, "float32", "cpu")
    modelsize_vs_saved(("cnn",), 2, "bfloat16", "fake")
    assert len(seen) > 20 and any(f.get("activations") for f, _ in seen)
    assert all(fast == slow for fast, slow in seen)


def test_modelsize_rows_kept_by_a_panel_equal_a_fresh_measurement():
    """``modelsize_vs_saved(kept=)``: a setting met again gives the rows it gave (the same objects), equal
    to a fresh measurement; another dtype is measured; the output shapes traced once come back as fresh lists."""
    kept = OrderedDict()
    first = modelsize_vs_saved(("mlp", "cnn"), 2, "float32", "cpu", kept=kept)
    again = modelsize_vs_saved(("mlp", "cnn"), 2, "float32", "cpu", kept=kept)
    fresh = modelsize_vs_saved(("mlp",), 2, "float32", "cpu")
    assert all(a is b for a, b in zip(again.rows, first.rows)) and again.rows[:1] == fresh.rows
    other = modelsize_vs_saved(("mlp",), 2, "bfloat16", "cpu", kept=kept)
    assert other.rows[0] is not first.rows[0] and other.rows[0].saved < first.rows[0].saved and len(kept) == 3
    shapes = modelsize_output_shapes("cnn", 2)
    shapes[0].append(99)
    assert modelsize_output_shapes("cnn", 2)[0][-1] != 99 and modelsize_output_shapes("cnn", 2)[0][0] == 2


def test_precision_guard_predicts_nothing_for_a_run_auto_sends_to_the_fake_engine(monkeypatch):
    """Lesson 08's guard asks ``precision_engine``, the choice ``precision_step`` makes: a large run that
    ``auto`` sends to the fake engine is let through without a fake prediction; a small one on the cpu
    engine is still predicted, and refused when it would not fit."""
    import torch

    from gpulab.course import precision as P
    from gpulab.course.precision import precision_engine, precision_step
    from gpulab.widgets.guard import memory_guard
    from gpulab.widgets.precision import precision_engine_name
    if torch.cuda.is_available():
        pytest.skip("auto picks the cuda engine on a GPU machine")
    big = dict(model="vgg16", batch=8, image_size=224, optimizer="adam", low="bfloat16", engine="auto")
    small = dict(model="mlp", batch=2, image_size=32, optimizer="adam", low="bfloat16", engine="auto")
    assert precision_engine_name(big) == "fake" and precision_engine_name(small) == "cpu"
    ran = []   # the engine precision_step runs its modes on (the runs themselves: tests/test_panels_06_08.py)
    monkeypatch.setattr(P, "run_precision_modes", lambda *args: ran.append(args[5]) or {})
    for p in (big, small):
        r = precision_step(p["model"], p["batch"], p["image_size"], "adam", "bfloat16", "auto")
        choice = precision_engine(p["model"], p["batch"], p["image_size"], "bfloat16", "auto")
        assert (r.engine, r.engine_reason, ran[-1]) == (choice.name, choice.reason, choice.name)
    asked = []
    guard = memory_guard(lambda p: asked.append(p["model"]) or 1 << 60, resolve=precision_engine_name)
    assert guard(big).ok and asked == []
    assert not guard(small).ok and asked == ["mlp"]
    with pytest.raises(ValueError, match="batch"):
        precision_engine_name(dict(small, batch=0))


def test_the_engine_prediction_worked_out_once_equals_the_breakdown():
    """``course.activations._predicted`` keeps its formula per model, batch, size and dtype: the numbers of
    ``breakdown`` itself and the dtype they are computed in, in a dict the caller may change."""
    import torch

    from gpulab.course.activations import _predicted
    from gpulab.models.registry import resolve_model
    from gpulab.predict.breakdown import breakdown
    spec = resolve_model("cnn")
    bd = breakdown(spec, 3, 32, torch.bfloat16)
    first = _predicted(spec, 3, 32, torch.bfloat16)
    assert first == {"predicted_bytes": bd.param_bytes + bd.total_output_bytes, "predicted_flops": bd.forward_flops,
                     "dtype": torch.bfloat16}
    first["predicted_flops"] = 0
    assert _predicted(spec, 3, 32, torch.bfloat16)["predicted_flops"] == bd.forward_flops > 0


def _everything(m):
    """A cpu-engine forward's whole answer: the tracker's events, records and series, and the traced rows."""
    t, v = m.tracking, m.value
    if "end" not in v:   # forward_table_experiment's
        v = dict(v, end=None, saved=None, backward_peak=None)
    return ([(e.index, e.kind, e.sid, e.nbytes, e.delta, e.phase, e.module) for e in t.events],
            sorted((r.nbytes, r.dtype, r.shape, str(r.category), r.module, r.phase, r.op) for r in t.records.values()),
            t.series, t.peak_bytes, t.peak_by_category, v["end"], v["saved"], v["backward_peak"],
            [dataclasses.astuple(r) for r in v["rows"]])


def test_a_cpu_run_on_copied_weights_answers_as_on_freshly_drawn_ones(monkeypatch):
    """``cpu_model`` (a real run's model, its values copied from a template drawn once): the tracker sees
    what it saw with ``build_model`` drawing them (every event, record and layer row), with grad and
    backward, under no_grad, and the layer table's forward, a first run (the template drawn, the tracker paused) and a later one;
    the copy holds the template's values in storages of its own; a template of other settings is refused."""
    import torch

    from gpulab.measure.engines import run
    from gpulab.models.registry import build_model, build_model_from, resolve_model
    spec = resolve_model("cnn")   # BatchNorm: buffers copied too
    monkeypatch.setattr(A, "_templates", OrderedDict())
    templated = A.cpu_model
    experiments = [lambda: A.forward_experiment(spec, 2, 32, torch.bfloat16, True, True),
                   lambda: A.forward_experiment(spec, 2, 32, torch.bfloat16, False),
                   lambda: A.forward_table_experiment(spec, 2, 32, torch.bfloat16)]
    for experiment in experiments:
        answers = []
        for way in ("drawn", "template drawn now", "template kept"):
            monkeypatch.setattr(A, "cpu_model", (lambda s, z, d, ctx=None: build_model(s, z, "cpu", d))
                                if way == "drawn" else templated)
            if way == "template drawn now":
                A._templates.clear()
            answers.append(_everything(run(experiment(), "cpu")))
        assert answers[0] == answers[1] == answers[2] and len(answers[0][0]) > 20
    template = A._templates[(spec, 32, torch.bfloat16)]
    copy = build_model_from(template, spec, 32, "cpu", torch.bfloat16)
    pairs = list(zip([*copy.parameters(), *copy.buffers()], [*template.parameters(), *template.buffers()]))
    assert len(pairs) == 18 and all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in pairs)
    assert any(b.float().std() > 0 for _, b in pairs)   # drawn values, not zeros
    with pytest.raises(ValueError, match="not a cnn built with these settings"):
        build_model_from(template, spec, 32, "cpu", torch.float32)
