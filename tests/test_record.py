"""``gpulab record`` and recorded runs (issue 16): the command, the validator that keeps stand-in
and incomplete records out of the package, ``find_record`` and its messages, and the step panel
showing a record (fixtures made here, in tmp_path: never shipped)."""
import copy
import dataclasses
import functools
import json
import pathlib

import pytest
from conftest import cuda
from cuda_standin import STANDIN_NAME

from gpulab import cli
from gpulab.record import lookup as L, runner as R

# one worker runs this module: its module-scoped fixture (a minute of stand-in or CLI runs) is built once
pytestmark = pytest.mark.xdist_group("record")


def test_record_without_a_gpu_exits_2_with_one_line(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["record", "--out", "unused"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


@functools.lru_cache(maxsize=1)
def _lesson_code() -> tuple[str, ...]:
    import nbformat
    from conftest import ROOT
    return tuple(c.source for path in sorted((ROOT / "lessons").glob("0*.ipynb"))
                 for c in nbformat.read(path, 4).cells if c.cell_type == "code")


def _defaults(fn) -> dict:
    """A panel's settings as its lesson opens it: the signature's defaults, updated with the
    keyword arguments of the first lesson cell that calls it (lessons/0*.ipynb, read with ast)."""
    import ast
    import inspect
    out = {k: v.default for k, v in inspect.signature(fn).parameters.items()
           if v.default is not inspect.Parameter.empty}
    calls = [{k.arg: ast.literal_eval(k.value) for k in node.keywords}
             for source in _lesson_code() if fn.__name__ + "(" in source
             for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == fn.__name__]
    assert calls, f"no lesson opens {fn.__name__}"
    return {**out, **calls[0]}


def test_the_record_set_is_documented_data():
    kinds = {e.kind for e in R.EXPERIMENTS}
    assert kinds == {"step", "fragmentation", "allocator timeline", "rounding", "tensor bytes", "model build",
                     "layer build", "implementations", "modelsize", "depthwise", "forward table",
                     "inference vs training", "inplace", "grad modes", "lifetimes", "checkpoint", "precision",
                     "throughput", "checkpoint cost"}
    steps = {(e.params["model"], e.params["optimizer"]) for e in R.EXPERIMENTS if e.kind == "step"}
    for model in ("vgg16", "alexnet", "resnet18", "cnn", "mlp"):
        for opt in ("sgd", "momentum", "adam"):
            assert (model, opt) in steps
    assert all(e.serves for e in R.EXPERIMENTS)
    keys = [(e.kind, json.dumps(e.params, sort_keys=True)) for e in R.EXPERIMENTS]
    assert len(keys) == len(set(keys))
    json.dumps([e.params for e in R.EXPERIMENTS])
    quick = R.experiment_set(quick=True)
    assert 0 < len(quick) <= 4 < len(R.EXPERIMENTS)
    assert {e.params.get("model") for e in quick if e.kind == "step"} <= {"cnn", "mlp"}
    assert {e.kind for e in quick} <= {"step", "fragmentation", "allocator timeline"}   # --quick stays quick
    for kind in kinds:                                   # the docstring documents every kind
        assert f"``{kind}``" in R.__doc__, kind
    for lesson in ("01", "02", "03", "04", "05", "06", "07", "08", "09"):
        assert f"lesson {lesson}" in R.__doc__.split("NB:")[0], lesson


def test_the_record_set_holds_each_panels_default():
    """The lesson 01 to 09 key panels' defaults (as their lessons open them) are recorded."""
    from gpulab.widgets import allocator_panel, checkpoint_panel, precision_panel
    by_kind = {e.kind: e.params for e in R.EXPERIMENTS if e.kind in ("checkpoint", "precision", "allocator timeline")}
    ck = _defaults(checkpoint_panel)
    assert {k: by_kind["checkpoint"][k] for k in ("n_blocks", "width", "batch", "segments", "repeats")} == \
        {k: ck[k] for k in ("n_blocks", "width", "batch", "segments", "repeats")}
    pr = _defaults(precision_panel)
    assert {k: by_kind["precision"][k] for k in ("model", "batch", "optimizer", "low")} == \
        {k: pr[k] for k in ("model", "batch", "optimizer", "low")}
    from gpulab.training.optimizers import OPTIMIZERS
    from gpulab.widgets import optimizer_panel, rounding_panel, sweep_panel
    from gpulab.widgets.sweep import sweep_batches
    sw = _defaults(sweep_panel)
    swept = {e.params["batch"] for e in R.EXPERIMENTS if e.kind == "step" and e.params["steps"] == 2
             and (e.params["model"], e.params["optimizer"]) == (sw["model"], sw["optimizer"])}
    assert swept == set(sweep_batches(sw["largest"]))
    op = _defaults(optimizer_panel)
    assert {e.params["optimizer"] for e in R.EXPERIMENTS if e.kind == "step" and e.params["steps"] == 1
            and (e.params["model"], e.params["batch"]) == (op["model"], op["batch"])} == set(OPTIMIZERS)
    from gpulab.widgets import inplace_panel
    ip = _defaults(inplace_panel)
    (inplace,) = [e.params for e in R.EXPERIMENTS if e.kind == "inplace"]
    assert inplace == {k: ip[k] for k in inplace}
    from gpulab.widgets import (
        forward_table_panel,
        grad_modes_panel,
        inference_panel,
        lifetimes_panel,
    )
    for kind, panel in (("grad modes", grad_modes_panel), ("lifetimes", lifetimes_panel),
                        ("forward table", forward_table_panel), ("inference vs training", inference_panel)):
        (params,) = [e.params for e in R.EXPERIMENTS if e.kind == kind]
        settings = _defaults(panel)
        assert params == {k: settings[k] for k in params}, kind
    from gpulab.widgets import parameters_panel
    built = {(e.params["model"], e.params["dtype"]) for e in R.EXPERIMENTS if e.kind == "model build"}
    pp = _defaults(parameters_panel)
    assert (pp["model"], pp["dtype"]) in built and ("alexnet", "float32") in built   # lesson 02 opens both
    from gpulab.widgets import tensor_bytes_panel
    tb = _defaults(tensor_bytes_panel)
    (tensor,) = [e.params for e in R.EXPERIMENTS if e.kind == "tensor bytes"]
    assert tensor == {k: tb[k] for k in tensor}
    from gpulab.widgets import implementation_panel
    im = _defaults(implementation_panel)
    (impl,) = [e.params for e in R.EXPERIMENTS if e.kind == "implementations"]
    assert {k: impl[k] for k in ("model", "optimizer", "batch")} == {k: im[k] for k in ("model", "optimizer", "batch")}
    from gpulab.models.registry import MODELS
    from gpulab.widgets import modelsize_panel
    ms = _defaults(modelsize_panel)
    (size,) = [e.params for e in R.EXPERIMENTS if e.kind == "modelsize"]
    assert size == {"models": list(MODELS), "batch": ms["batch"], "dtype": ms["dtype"]}
    from gpulab.widgets import layer_panel
    lp = _defaults(layer_panel)
    (layer,) = [e.params for e in R.EXPERIMENTS if e.kind == "layer build"]
    assert {k: v for k, v in layer.items() if k != "layer"} == {k: lp[k] for k in layer if k != "layer"}
    from gpulab.widgets import depthwise_panel
    dw = _defaults(depthwise_panel)
    (depth,) = [e.params for e in R.EXPERIMENTS if e.kind == "depthwise"]
    assert depth == {k: dw[k] for k in depth}
    ro = _defaults(rounding_panel)
    assert {(e.params["dtype"], e.params["max_elements"]) for e in R.EXPERIMENTS if e.kind == "rounding"} == \
        {(ro["dtype"], ro["max_elements"])}
    al = _defaults(allocator_panel)
    assert by_kind["allocator timeline"]["workload"] == al["workload_name"]
    assert (by_kind["allocator timeline"]["model"], by_kind["allocator timeline"]["batch"]) == (al["model"], al["batch"])
    assert by_kind["allocator timeline"]["expandable_segments"] is al["expandable_segments"] is False


@pytest.fixture(scope="module")
def standin_record(tmp_path_factory):
    """What ``gpulab record --quick`` writes under the stand-in GPU (made once for this module)."""
    from cuda_standin import standin_gpu as install
    out = tmp_path_factory.mktemp("rec")
    with pytest.MonkeyPatch.context() as mp, install(mp):
        rc = cli.main(["record", "--quick", "--out", str(out), "--json"])
    assert rc == 0
    (path,) = out.glob("*.json")
    return path


def test_record_under_the_stand_in_writes_full_provenance_and_is_refused(standin_record):
    data = json.loads(standin_record.read_text())
    prov = data["provenance"]
    assert set(L.PROVENANCE_FIELDS) <= prov.keys()
    assert prov["gpu_name"] == STANDIN_NAME and prov["stand_in"] is True
    assert prov["gpulab_version"] and prov["torch"] and prov["date"]
    assert prov["command"].startswith("gpulab record --quick")
    assert standin_record.name == R.slug(STANDIN_NAME) + ".json"
    assert len(data["experiments"]) == len(R.experiment_set(quick=True))
    assert "cuda_context_estimate" in data["device"]
    for e in data["experiments"]:
        res = e["result"]
        assert res["engine"] == "cuda"
        a = res["allocator"]
        for k in ("baseline_allocated", "baseline_reserved", "max_memory_allocated", "max_memory_reserved",
                  "peak_allocated_delta", "peak_reserved_delta", "nvml_used"):
            assert k in a
        if e["kind"] == "step":
            assert res["peak_by_category"] and res["seconds"] >= 0
    problems = L.validate_record(data)
    assert any("stand-in" in p for p in problems)
    assert L.load_records(standin_record.parent) == []
    _, refused = L.scan_records(standin_record.parent)
    assert standin_record.name in refused


def _fixture_record(tmp_path, standin_record, gpu="Fixture GPU 24GB (test harness)"):
    """A record as if a real GPU wrote it: the stand-in's, renamed. Test data only."""
    data = json.loads(standin_record.read_text())
    data["provenance"].update(gpu_name=gpu, stand_in=False, date="2026-01-02", torch="2.9.0")
    path = tmp_path / f"{R.slug(gpu)}.json"
    path.write_text(json.dumps(data))
    return data


def test_the_validator_wants_every_provenance_field(tmp_path, standin_record):
    data = _fixture_record(tmp_path, standin_record)
    assert L.validate_record(data) == []
    for f in L.PROVENANCE_FIELDS:
        broken = copy.deepcopy(data)
        del broken["provenance"][f]
        assert any(f in p for p in L.validate_record(broken)), f
    assert L.validate_record({"experiments": []})


def test_shipped_records_are_real_gpu_records():
    """gpulab/recorded/ holds only what `gpulab record` wrote on a real GPU (see its README)."""
    assert (L.PACKAGE_DIR / "README.md").is_file()
    files = sorted(L.PACKAGE_DIR.glob("*.json"))
    good, refused = L.scan_records(L.PACKAGE_DIR)
    assert refused == {}, refused
    assert len(good) == len(files)
    for rec in good:
        assert not L.is_stand_in(rec.provenance["gpu_name"]) and rec.provenance["stand_in"] is False
        assert not rec.data.get("quick"), f"{rec.path.name}: a --quick record does not ship"
        assert rec.path.name == R.slug(rec.provenance["gpu_name"]) + ".json"


def test_find_record_match_and_mismatch(tmp_path, standin_record):
    _fixture_record(tmp_path, standin_record)
    hit = L.find_record("step", tmp_path, model="cnn", batch=32, image_size=32, optimizer="sgd", dtype="float32")
    assert hit and hit.result["model"] == "cnn" and hit.result["batch"] == 32
    assert hit.label == "recorded on Fixture GPU 24GB (test harness), 2026-01-02, torch 2.9.0"

    miss = L.find_record("step", tmp_path, model="cnn", batch=64, image_size=32, optimizer="sgd")
    assert not miss and miss.result is None
    assert miss.reason == ("no record for these settings (batch 64): recorded batch sizes for model cnn are 32")
    miss = L.find_record("step", tmp_path, model="vgg16")
    assert "recorded models are cnn, mlp" in miss.reason
    assert "no checkpoint experiment" in L.find_record("checkpoint", tmp_path).reason
    assert L.find_record("step", tmp_path / "empty", model="cnn").reason == L.NO_RECORDS


def test_the_loader_follows_the_environment_variable(tmp_path, standin_record, monkeypatch):
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path))
    assert [r.path.parent for r in L.load_records()] == [tmp_path]
    assert L.find_record("step", model="mlp", batch=32)


# --- the step panel (lesson 04) ---------------------------------------------------------------------

def _html(panel) -> str:
    """What the panel renders beside its result (the HTML items of its render)."""
    from IPython.display import HTML
    assert panel.error is None, panel.error
    return "\n".join(item.data for item in panel._render(panel.result) if isinstance(item, HTML))


def test_step_panel_shows_the_recorded_gpu_figures_beside_the_live_run(tmp_path, standin_record, monkeypatch):
    from gpulab.widgets import step_panel
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path))
    panel = step_panel(model="cnn", batch=32, optimizer="sgd", engine="fake")
    panel.run()
    assert panel.error is None, panel.error
    html = _html(panel)
    assert "recorded on Fixture GPU 24GB (test harness), 2026-01-02, torch 2.9.0" in html
    assert "max_memory_allocated" in html


def test_step_panel_says_when_no_record_matches(tmp_path, standin_record, monkeypatch):
    from gpulab.widgets import step_panel
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path))
    panel = step_panel(model="cnn", batch=4, optimizer="sgd", engine="fake")
    panel.run()
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded batch sizes" in html
    assert "recorded on" not in html
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path / "none"))
    panel.run()
    assert L.NO_RECORDS in _html(panel)


# --- the lesson 07/08/09 entries, and the panels that show them --------------------------------------

@pytest.fixture(scope="module")
def lesson_entries(standin_record):
    """The entries of the lesson 01 to 08 panels (not in --quick) run under the
    stand-in GPU, added to the --quick record (which holds lesson 09's). Made once."""
    from cuda_standin import standin_gpu as install
    data = json.loads(standin_record.read_text())
    for exp in R.EXPERIMENTS:
        if exp.kind in ("checkpoint", "precision", "rounding", "inplace", "grad modes", "lifetimes", "forward table",
                        "inference vs training", "model build", "layer build", "tensor bytes", "implementations",
                        "modelsize", "depthwise") or exp.name in ("sweep panel", "optimizer panel"):
            if exp.kind == "checkpoint":
                # one timed round per segment count, not the record's 7: the stand-in times meta
                # tensors (no compute), and the entry, its lookup (N, width, batch) and its panel are
                # the same; the 7 rounds were 23 of this fixture's 45 CPU seconds
                exp = dataclasses.replace(exp, params={**exp.params, "repeats": 1})
            with pytest.MonkeyPatch.context() as mp, install(mp):
                result = R.run_experiment(exp)
            data["experiments"].append({"name": exp.name, "kind": exp.kind, "params": dict(exp.params),
                                        "serves": exp.serves, "result": json.loads(json.dumps(result))})
    return data


@pytest.fixture
def lesson_records(tmp_path, lesson_entries, monkeypatch):
    """``lesson_entries`` as if a real GPU wrote them, in tmp_path, which the loader now reads."""
    data = copy.deepcopy(lesson_entries)
    data["provenance"].update(gpu_name="Fixture GPU 24GB (test harness)", stand_in=False, date="2026-01-02",
                              torch="2.9.0")
    (tmp_path / "fixture-gpu.json").write_text(json.dumps(data))
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path))
    return data


LABEL = "recorded on Fixture GPU 24GB (test harness), 2026-01-02, torch 2.9.0"


def _entry(data, kind):
    (e,) = [e for e in data["experiments"] if e["kind"] == kind]
    return e["result"]


def test_the_new_entries_run_under_the_stand_in(lesson_records):
    assert L.validate_record(lesson_records) == []
    ck = _entry(lesson_records, "checkpoint")
    assert ck["engine"] == "cuda" and [p["segments"] for p in ck["points"]] == list(range(1, 17))
    first, sqrt_n = ck["points"][0], ck["points"][3]
    assert first["peak_bytes"] > sqrt_n["peak_bytes"] > 0      # k = 4 = √N keeps fewer maps than k = 1
    assert all(p["median_s"] is not None and p["allocator"]["peak_allocated_delta"] > 0 for p in ck["points"])
    pr = _entry(lesson_records, "precision")
    assert set(pr["runs"]) == {"fp32", "autocast bfloat16", "pure bfloat16"}
    assert pr["runs"]["pure bfloat16"]["peak_bytes"] < pr["runs"]["fp32"]["peak_bytes"]
    assert pr["runs"]["fp32"]["saving_percent"] == 0
    tl = _entry(lesson_records, "allocator timeline")
    t = tl["timeline"]
    assert 0 < len(t["index"]) <= 2000 and len(t["index"]) == len(t["reserved"]) == len(t["allocated"])
    # the sampled series peaks where the allocator's own peak counters say (the stand-in's counters)
    assert max(t["reserved"]) == tl["allocator"]["peak_reserved_delta"]
    assert max(t["allocated"]) == tl["allocator"]["peak_allocated_delta"]
    assert tl["simulated_peak_reserved"] > 0 and tl["simulated_peak_allocated"] > 0


def test_downsample_keeps_the_peaks_of_every_series():
    from gpulab.measure.real_timeline import downsample
    a = [i % 97 for i in range(10_000)]
    b = [(i * 7919) % 1013 for i in range(10_000)]
    idx = downsample(a, b, max_points=500)
    assert len(idx) <= 500 and idx[0] == 0 and idx[-1] == 9999 and idx == sorted(set(idx))
    assert max(a[i] for i in idx) == max(a) and max(b[i] for i in idx) == max(b)
    assert downsample([1, 2, 3]) == [0, 1, 2]


def test_the_shared_view_shows_a_table_or_one_line():
    from gpulab.record.views import NOTE_PREFIX, recorded_html
    hit = L.RecordLookup({"x": 3}, "recorded on G, 2026-01-01, torch 2.9")
    out = recorded_html(hit, lambda r: [["x", r["x"]]])
    assert "The same settings on a real GPU" in out and "recorded on G, 2026-01-01, torch 2.9" in out
    miss = L.RecordLookup(None, reason="no record for these settings (batch 4): recorded batch sizes are 32",
                          mismatch="(batch 4): recorded batch sizes are 32")
    note = recorded_html(miss, lambda r: pytest.fail("rows of a missing record"))
    assert note.startswith("<div") and NOTE_PREFIX in note and "recorded batch sizes are 32" in note
    assert "\n" not in note and "<table" not in note


def test_checkpoint_panel_shows_the_recorded_sweep(lesson_records):
    from gpulab.widgets import checkpoint_panel
    panel = checkpoint_panel(engine="fake", segments="divisors of N")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "max_memory_allocated" in html
    assert html.count("<tr") - 1 == len(panel.result.points) == 5   # the recorded k of the live run: 1, 2, 4, 8, 16
    panel.set(n_blocks=4)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded block counts N are 16" in html
    assert "recorded on" not in html


def test_precision_panel_shows_the_recorded_run(lesson_records):
    from gpulab.widgets import precision_panel
    panel = precision_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "pure bfloat16" in html and "bytes/param" in html
    panel.set(low="float16")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded 16-bit dtypes" in html
    assert "recorded on" not in html


def test_allocator_panel_shows_the_recorded_run_and_timeline(lesson_records):
    from matplotlib.figure import Figure

    from gpulab.widgets import allocator_panel
    panel = allocator_panel()
    panel.run()
    html = _html(panel)
    assert LABEL in html and "reserved peak of the simulator, same run" in html
    figs = [f for f in panel._render(panel.result) if isinstance(f, Figure)]
    assert len(figs) == 3                     # allocated vs reserved, segment map, simulated vs recorded
    labels = [t.get_text() for t in figs[-1].legends[0].get_texts()]
    assert any(LABEL in t for t in labels) and any("simulated allocator" in t for t in labels)
    panel.set(batch=16)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded batch sizes" in html
    panel.set(batch=32, workload_name="fragmentation")
    assert LABEL in _html(panel)
    panel.set(expandable_segments=True)
    assert "recorded with neither" in _html(panel)


def test_sweep_panel_shows_the_recorded_steps(lesson_records):
    from gpulab.widgets import sweep_panel
    panel = sweep_panel(model="cnn", optimizer="adam", largest=32, engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "max_memory_reserved" in html
    assert html.count("<tr") - 1 == 4                      # batch 4, 8, 16, 32
    panel.set(largest=64)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(batch 64)" in html


def test_optimizer_panel_shows_the_recorded_steps(lesson_records):
    from gpulab.widgets import optimizer_panel
    panel = optimizer_panel(model="mlp", batch=8, engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "optimizer state after step()" in html
    for opt in ("sgd", "adagrad"):
        assert f"<td>{opt}</td>" in html
    panel.set(batch=4)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(batch 4)" in html


def test_rounding_panel_shows_the_recorded_blocks(lesson_records):
    from gpulab.widgets import rounding_panel
    recorded = _entry(lesson_records, "rounding")
    assert recorded["memory_allocated"][:2] == [0, 512] and recorded["memory_allocated"][129] == 1024
    panel = rounding_panel(engine="cpu")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>1–128</td>" in html and "<td>129–256</td>" in html
    panel.set(dtype="float16")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded dtypes are float32" in html


def test_inplace_panel_shows_the_recorded_pair(lesson_records):
    from gpulab.widgets import inplace_panel
    recorded = _entry(lesson_records, "inplace")["runs"]
    on, off = recorded["inplace=True"], recorded["inplace=False"]
    assert on["saved_bytes"] == off["saved_bytes"] > 0          # ReLU saves its result either way (lesson 06)
    assert on["allocated_bytes"] < off["allocated_bytes"]        # but in place allocates no new output
    panel = inplace_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>inplace=True</td>" in html and "saved for backward" in html
    panel.set(channels=32)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(channels 32)" in html


def test_grad_modes_panel_shows_the_recorded_modes(lesson_records):
    from gpulab.widgets import grad_modes_panel
    recorded = _entry(lesson_records, "grad modes")["runs"]
    assert recorded["train() + grad"]["saved_bytes"] > 0 == recorded["eval() + no_grad"]["saved_bytes"]
    panel = grad_modes_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>eval() + inference_mode</td>" in html
    panel.set(batch=16)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(batch 16)" in html


def test_lifetimes_panel_shows_the_recorded_styles(lesson_records):
    from gpulab.widgets import lifetimes_panel
    recorded = _entry(lesson_records, "lifetimes")["runs"]
    assert recorded["del / reuse"]["forward_peak"] < recorded["names kept"]["forward_peak"]
    panel = lifetimes_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>del / reuse</td>" in html
    panel.set(grad_mode="train step")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(grad_mode train step)" in html
    assert "recorded modes are no_grad forward" in html


def test_lesson_03_panels_show_the_recorded_forwards(lesson_records):
    from gpulab.widgets import forward_table_panel, inference_panel
    pair = _entry(lesson_records, "inference vs training")["runs"]
    assert pair["forward with grad (train)"]["saved_bytes"] > pair["no_grad forward (eval)"]["saved_bytes"] == 0
    table = _entry(lesson_records, "forward table")
    assert table["forward_allocated"] > table["peak_non_param"] > 0   # no_grad frees each input as it goes
    for make, marker in ((forward_table_panel, "allocated by this forward"), (inference_panel, "saved for backward")):
        panel = make(model="vgg16", batch=1, image_size=224, engine="fake")
        panel.run()
        html = _html(panel)
        assert LABEL in html and marker in html, make.__name__
        panel.set(batch=2)
        html = _html(panel)
        assert "no recorded GPU run matches these settings" in html and "(batch 2)" in html, make.__name__


def test_parameters_panel_shows_the_recorded_build(lesson_records):
    from gpulab.widgets import parameters_panel
    vgg = next(e["result"] for e in lesson_records["experiments"]
               if e["kind"] == "model build" and e["params"]["model"] == "vgg16")
    assert vgg["live_by_category"]["parameters"] == 138_357_544 * 4     # VGG16's parameters, float32
    panel = parameters_panel(model="vgg16", engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "parameters, live once built" in html and "527.8 MiB" in html
    panel.set(dtype="bfloat16")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(dtype bfloat16)" in html


def test_tensor_bytes_panel_shows_the_recorded_run(lesson_records):
    from gpulab.widgets import tensor_bytes_panel
    recorded = _entry(lesson_records, "tensor bytes")
    x_bytes = 256 * 3 * 100 * 100 * 4
    two_mib = 2 * 2**20   # a request over 10 MiB gets its own segment rounded up to 2 MiB, kept whole
    block = -(-x_bytes // two_mib) * two_mib
    assert recorded["x_allocated"] == block and recorded["kept"] == x_bytes and recorded["shares"] is True
    panel = tensor_bytes_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and f"{block:,} B" in html and "kept alive by y" in html
    panel.set(operation="slice + clone")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(operation slice + clone)" in html


def test_implementation_panel_shows_the_recorded_implementations(lesson_records):
    from gpulab.widgets import implementation_panel
    recorded = _entry(lesson_records, "implementations")["implementations"]
    assert set(recorded) == {"for-loop", "foreach", "fused"}
    ran = [r for r in recorded.values() if "unsupported" not in r]
    assert ran and all(r["step_peak"] >= r["step_temporaries"] >= 0 and r["param_bytes"] > 0 for r in ran)
    panel = implementation_panel(model="mlp", optimizer="adam", batch=8, engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>foreach</td>" in html and "temporaries at the step() peak" in html
    panel.set(optimizer="adamw")
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(optimizer adamw)" in html


def test_modelsize_panel_shows_the_recorded_models(lesson_records):
    from gpulab.models.registry import MODELS
    from gpulab.widgets import modelsize_panel
    recorded = _entry(lesson_records, "modelsize")["models"]
    assert list(recorded) == list(MODELS)
    assert all(r["saved_with_input"] > r["saved"] > 0 and r["backward_peak"] > 0 for r in recorded.values())
    panel = modelsize_panel(batch=1, dtype="float32", engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and all(f"<td>{m}</td>" in html for m in MODELS)
    panel.set(batch=2)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(batch 2)" in html


def test_layer_panel_shows_the_recorded_layer(lesson_records):
    from gpulab.widgets import layer_panel
    recorded = _entry(lesson_records, "layer build")
    assert recorded["live_by_category"]["parameters"] == (64 * 128 * 9 + 128) * 4   # Conv2d(64, 128, 3), float32
    panel = layer_panel(kind="Conv2d", in_size=64, out_size=128, kernel=3, groups=1, bias=True, engine="cpu")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "288.5 KiB" in html
    panel.set(bias=False)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded layers are Conv2d(64, 128" in html


def test_depthwise_panel_shows_the_recorded_blocks(lesson_records):
    from gpulab.widgets import depthwise_panel
    blocks = _entry(lesson_records, "depthwise")["blocks"]
    assert blocks["separable"]["param_bytes"] < blocks["standard"]["param_bytes"]
    assert blocks["separable"]["saved"] > blocks["standard"]["saved"]      # fewer FLOPs, more saved (lesson 03)
    panel = depthwise_panel(engine="fake")
    panel.run()
    html = _html(panel)
    assert LABEL in html and "<td>separable</td>" in html
    panel.set(batch=4)
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "(batch 4)" in html


def test_panels_say_when_no_recordings_ship(tmp_path, monkeypatch):
    from gpulab.widgets import allocator_panel, precision_panel
    monkeypatch.setenv(L.ENV_DIR, str(tmp_path))
    for panel in (allocator_panel(), precision_panel(engine="fake")):
        panel.run()
        html = _html(panel)
        assert L.NO_RECORDS in html and "recorded on" not in html


def test_lesson_09_plots_the_recorded_reserved_next_to_the_simulators(lesson_records, tmp_path):
    from gpulab.plots import figure_png_bytes
    from gpulab.record.lookup import find_allocator_record
    from gpulab.record.views import reserved_timelines
    from gpulab.predict.replay import workload
    step = workload("training step", "cnn", 32, steps=2)
    hit = find_allocator_record(step)
    assert hit and hit.label == LABEL
    fig = reserved_timelines(step, hit)
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 2
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert LABEL in texts[1] and "simulated allocator" in texts[0]
    real = hit.result["timeline"]["reserved"]
    assert max(ax.get_lines()[1].get_ydata()) == pytest.approx(max(real) / 2**20)
    png = figure_png_bytes(fig)
    assert png[:4] == b"\x89PNG"
    (tmp_path / "lesson09_reserved.png").write_bytes(png)
    import os
    if os.environ.get("GPULAB_SAVE_PNG"):
        (pathlib.Path(os.environ["GPULAB_SAVE_PNG"]) / "lesson09_reserved.png").write_bytes(png)
    alone = reserved_timelines(step, find_allocator_record(step, tmp_path / "none"))
    assert len(alone.axes[0].get_lines()) == 1 and "no recorded GPU run" in alone.axes[0].get_title()


# --- on a real GPU -----------------------------------------------------------------------------------

@cuda
def test_record_quick_on_a_real_gpu_is_valid(tmp_path):
    import torch
    assert cli.main(["record", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert L.validate_record(data) == [], L.validate_record(data)
    assert data["provenance"]["gpu_name"] == torch.cuda.get_device_name(0)
    assert L.load_records(tmp_path) and L.find_record("step", tmp_path, model="mlp", optimizer="sgd")


@pytest.mark.extended
def test_the_llm_time_sweeps_run_under_the_stand_in():
    """Issue 48: throughput against the batch and checkpointing's time cost, plain steps timed, each
    with the allocator's peak; a batch the (1 GiB) device cannot hold is out of memory and the sweep
    goes on. The record set runs them on Qwen2.5-0.5B; here a tiny Llama, one timed step each."""
    from cuda_standin import standin_gpu as install
    from gpulab.record.runs.llm_time import POLICIES
    (tp,) = [e for e in R.EXPERIMENTS if e.kind == "throughput"]
    (cc,) = [e for e in R.EXPERIMENTS if e.kind == "checkpoint cost"]
    assert tp.params["batches"] == [1, 2, 4, 8, 16] and cc.params["policies"] == list(POLICIES) == ["none", "full", "selective"]
    small = {"model": "hf:tiny-llama", "seq_len": 64, "dtype": "bf16", "optimizer": "adamw", "warmup": 1, "repeats": 2}
    with pytest.MonkeyPatch.context() as mp, install(mp, total_bytes=1 << 30, context_bytes=100 << 20):
        sweep = R.run_experiment(R.RecordExperiment("t", "throughput", {**small, "batches": [1, 4, 100_000]}))
        cost = R.run_experiment(R.RecordExperiment("c", "checkpoint cost", {**small, "batch": 4,
                                                                             "policies": list(POLICIES)}))
    one, four, huge = sweep["points"]
    assert one["status"] == four["status"] == "ran" and huge["status"].startswith("out of memory")
    assert 0 < one["peak_allocated_bytes"] < four["peak_allocated_bytes"]
    assert len(four["samples_s"]) == 2 and four["tokens_per_s"] == pytest.approx(4 * 64 / four["median_s"])
    none, full, selective = cost["points"]
    assert [p["checkpointing"] for p in cost["points"]] == ["none", "full", "selective"]
    assert full["peak_allocated_bytes"] < none["peak_allocated_bytes"] and none["slowdown"] == 1.0
    assert full["slowdown"] > 0 and selective["status"] == "ran"
    json.dumps([sweep, cost])
