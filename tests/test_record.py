"""``gpulab record`` and recorded runs (issue 16): the command, the validator that keeps stand-in
and incomplete records out of the package, ``find_record`` and its messages, and the step panel
showing a record (fixtures made here, in tmp_path: never shipped)."""
import copy
import json

import pytest
from cuda_standin import STANDIN_NAME

from gpulab import cli
from gpulab import record as R


def test_record_without_a_gpu_exits_2_with_one_line(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["record", "--out", "unused"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


def test_the_record_set_is_documented_data():
    kinds = {e.kind for e in R.EXPERIMENTS}
    assert kinds == {"step", "fragmentation"}
    steps = {(e.params["model"], e.params["optimizer"]) for e in R.EXPERIMENTS if e.kind == "step"}
    for model in ("vgg16", "alexnet", "resnet18", "cnn", "mlp"):
        for opt in ("sgd", "momentum", "adam"):
            assert (model, opt) in steps
    assert all(e.serves for e in R.EXPERIMENTS)
    keys = [(e.kind, tuple(sorted(e.params.items()))) for e in R.EXPERIMENTS]
    assert len(keys) == len(set(keys))
    quick = R.experiment_set(quick=True)
    assert 0 < len(quick) < len(R.EXPERIMENTS)
    assert {e.params.get("model") for e in quick if e.kind == "step"} <= {"cnn", "mlp"}


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
    assert set(R.PROVENANCE_FIELDS) <= prov.keys()
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
    problems = R.validate_record(data)
    assert any("stand-in" in p for p in problems)
    assert R.load_records(standin_record.parent) == []
    _, refused = R.scan_records(standin_record.parent)
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
    assert R.validate_record(data) == []
    for f in R.PROVENANCE_FIELDS:
        broken = copy.deepcopy(data)
        del broken["provenance"][f]
        assert any(f in p for p in R.validate_record(broken)), f
    assert R.validate_record({"experiments": []})


def test_shipped_records_are_real_gpu_records():
    """gpulab/recorded/ holds only what `gpulab record` wrote on a real GPU (see its README)."""
    assert (R.PACKAGE_DIR / "README.md").is_file()
    files = sorted(R.PACKAGE_DIR.glob("*.json"))
    good, refused = R.scan_records(R.PACKAGE_DIR)
    assert refused == {}, refused
    assert len(good) == len(files)
    for rec in good:
        assert not R.is_stand_in(rec.provenance["gpu_name"]) and rec.provenance["stand_in"] is False
        assert not rec.data.get("quick"), f"{rec.path.name}: a --quick record does not ship"
        assert rec.path.name == R.slug(rec.provenance["gpu_name"]) + ".json"


def test_find_record_match_and_mismatch(tmp_path, standin_record):
    _fixture_record(tmp_path, standin_record)
    hit = R.find_record("step", tmp_path, model="cnn", batch=32, image_size=32, optimizer="sgd", dtype="float32")
    assert hit and hit.result["model"] == "cnn" and hit.result["batch"] == 32
    assert hit.label == "recorded on Fixture GPU 24GB (test harness), 2026-01-02, torch 2.9.0"

    miss = R.find_record("step", tmp_path, model="cnn", batch=64, image_size=32, optimizer="sgd")
    assert not miss and miss.result is None
    assert miss.reason == ("no record for these settings (batch 64): recorded batch sizes for model cnn are 32")
    miss = R.find_record("step", tmp_path, model="vgg16")
    assert "recorded models are cnn, mlp" in miss.reason
    assert "no checkpoint experiment" in R.find_record("checkpoint", tmp_path).reason
    assert R.find_record("step", tmp_path / "empty", model="cnn").reason == R.NO_RECORDS


def test_the_loader_follows_the_environment_variable(tmp_path, standin_record, monkeypatch):
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(R.ENV_DIR, str(tmp_path))
    assert [r.path.parent for r in R.load_records()] == [tmp_path]
    assert R.find_record("step", model="mlp", batch=32)


# --- the step panel (lesson 04) ---------------------------------------------------------------------

def _html(panel) -> str:
    """What the panel renders beside its result (the HTML items of its render)."""
    from IPython.display import HTML
    assert panel.error is None, panel.error
    return "\n".join(item.data for item in panel._render(panel.result) if isinstance(item, HTML))


def test_step_panel_shows_the_recorded_gpu_figures_beside_the_live_run(tmp_path, standin_record, monkeypatch):
    from gpulab.widgets import step_panel
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(R.ENV_DIR, str(tmp_path))
    panel = step_panel(model="cnn", batch=32, optimizer="sgd", engine="fake")
    panel.run()
    assert panel.error is None, panel.error
    html = _html(panel)
    assert "recorded on Fixture GPU 24GB (test harness), 2026-01-02, torch 2.9.0" in html
    assert "max_memory_allocated" in html


def test_step_panel_says_when_no_record_matches(tmp_path, standin_record, monkeypatch):
    from gpulab.widgets import step_panel
    _fixture_record(tmp_path, standin_record)
    monkeypatch.setenv(R.ENV_DIR, str(tmp_path))
    panel = step_panel(model="cnn", batch=4, optimizer="sgd", engine="fake")
    panel.run()
    html = _html(panel)
    assert "no recorded GPU run matches these settings" in html and "recorded batch sizes" in html
    assert "recorded on" not in html
    monkeypatch.setenv(R.ENV_DIR, str(tmp_path / "none"))
    panel.run()
    assert R.NO_RECORDS in _html(panel)


# --- on a real GPU -----------------------------------------------------------------------------------

def test_record_quick_on_a_real_gpu_is_valid(tmp_path):
    import torch
    from conftest import cuda
    if not torch.cuda.is_available():
        pytest.skip(cuda.kwargs["reason"])
    assert cli.main(["record", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert R.validate_record(data) == [], R.validate_record(data)
    assert data["provenance"]["gpu_name"] == torch.cuda.get_device_name(0)
    assert R.load_records(tmp_path) and R.find_record("step", tmp_path, model="mlp", optimizer="sgd")
