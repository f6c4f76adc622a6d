"""benchmarks/practitioner_validation.py (issue 33, item 3), without a GPU: the command refuses to
run without one; under the CUDA stand-in (tests/cuda_standin.py) its --quick run goes end to end
(the fake prediction, a plain untracked step, the fit check on an emulated card with b + 1 out of
memory caught), says in its first line that no GPU measured anything, and writes its JSON and its
section; a missed target is a MISS with its size, an out-of-memory or an error is that case's
result and the run goes on, the time limits stop cases and say so."""
import importlib.util
import json
import sys
import time

import pytest
import torch
from cuda_standin import STANDIN_NAME

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "practitioner_validation.py"
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def pv():
    spec = importlib.util.spec_from_file_location("practitioner_validation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["practitioner_validation"] = mod      # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("practitioner_validation", None)


def _standin(mp, **kwargs):
    """The stand-in, with ``set_per_process_memory_fraction`` limiting its simulated allocator as
    the real one limits the caching allocator (fraction × the device's total)."""
    from cuda_standin import standin_gpu
    cm = standin_gpu(mp, **kwargs)
    gpu = cm.__enter__()
    full = gpu.sim.capacity_bytes

    def set_fraction(fraction, device=None):
        gpu.sim.capacity_bytes = min(full, int(fraction * gpu.total_bytes))
    mp.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction, raising=False)
    return cm, gpu


# --- no GPU: exit 2, one line ----------------------------------------------------------------------

def test_without_a_gpu_it_exits_2_with_one_line(pv, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pv.main(["--out", str(tmp_path / "v"), "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "needs a CUDA GPU" in err
    assert not (tmp_path / "v").exists()


def test_the_gpu_command_is_at_the_top_of_the_docstring(pv):
    head = "\n".join(pv.__doc__.split("\n\n")[1:3])
    assert "PYTHONPATH=. python benchmarks/practitioner_validation.py --out" in head and "--time-limit 520" in head
    assert pv.DEFAULT_TIME_LIMIT_S <= 540 - 20     # the script fits 9 minutes on an H100, its setup included
    assert len(pv.CASES) >= 30 and len({c.name for c in pv.CASES}) == len(pv.CASES)
    assert sum(len(c.fit_cards) for c in pv.CASES) >= 12
    assert sum(len(c.fit_cards) for c in pv.CASES if not c.needs) >= 12   # without bitsandbytes too
    assert {"T4", "24GiB", "40GiB", "H100"} <= {x for c in pv.CASES for x in c.fit_cards}
    # issue 48's cases: a mixture of experts, a sliding-window model, paged 8-bit AdamW, activation offload,
    # generate() at batch 4, QLoRA without double quantization, an interleaved pipeline's rank, FSDP2 on one rank
    assert {c.model for c in pv.CASES} >= {"mixtral-small", "gemma3-small"}   # (their configs: the extended test)
    by = {c.name: c for c in pv.CASES}
    assert any(c.optimizer == "paged_adamw8bit" for c in pv.CASES)
    assert any(c.options.get("offload_activations") for c in pv.CASES)
    assert any(c.kind == "generate" and c.batch == 4 for c in pv.CASES)
    assert any(c.options.get("quantize") == "nf4" and c.options.get("double_quant") is False for c in pv.CASES)
    assert any(c.options.get("schedule") == "interleaved" and c.options.get("virtual_stages", 1) > 1 for c in pv.CASES)
    assert any(c.kind == "fsdp2" and c.world > 1 for c in pv.CASES)
    for opt in ("accumulate", "clip_grad_norm", "grad_scaler", "optimizer_in_backward", "set_to_none",
                "implementation", "chunked_loss", "checkpointing"):
        assert any(opt in c.options for c in pv.CASES), opt
    assert by["gpt2-t4-kernels-bf16"].trace and by["gpt2-bf16"].trace and pv.TRACE_PAIR == ("gpt2-t4-kernels-bf16", "gpt2-bf16")
    assert by["gpt2-bf16"].dtype == by["gpt2-t4-kernels-bf16"].dtype and not by["gpt2-bf16"].kernels_of
    assert [c.name for c in pv.CASES][:3] == ["gpt2-fp32-adamw", "gpt2-t4-kernels-bf16", "gpt2-bf16"]


# --- the --quick command under the stand-in --------------------------------------------------------

QUICK = "gpt2-fp32-adamw,llama1b-generate-b4,llama1b-qlora,resnet50-fp32-momentum"


@pytest.fixture(scope="module")
def quick_run(pv, tmp_path_factory):
    """The command itself (main), --quick on four cases: one with a fit check, one needing
    bitsandbytes' CUDA kernels, an image model, generate(); --md into a file with other content."""
    out = tmp_path_factory.mktemp("practitioner")
    md = out / "docs" / "gpu-validation.md"
    md.parent.mkdir()
    md.write_text("# GPU validation\n\nThe other script's report.\n")
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        cm, gpu = _standin(mp)
        try:
            rc = pv.main(["--out", str(out), "--md", str(md), "--quick", "--cases", QUICK, "--commit", "0123abc"])
            left = gpu.sim.memory_allocated()
        finally:
            cm.__exit__(None, None, None)
    return rc, out, md, time.monotonic() - t0, left


def test_quick_run_under_the_standin_goes_end_to_end(pv, quick_run):
    rc, out, md, seconds, left = quick_run
    assert rc == 1          # the stand-in is no GPU: its plain steps differ from CUDA's (MISS)
    assert seconds < 120
    raw = json.loads((out / pv.JSON_NAME).read_text())
    assert raw["quick"] is True and raw["device"]["gpu_name"] == STANDIN_NAME
    assert raw["device"]["gpulab_commit"] == "0123abc"
    assert [c["name"] for c in raw["cases"]] == QUICK.split(",")
    gpt2, gen, qlora, cnn = raw["cases"]
    assert gpt2["status"] == "ran" and gpt2["model"].startswith("tiny GPT-2")
    for key in ("predicted_tensors", "predicted_allocated", "predicted_reserved", "real_allocated", "real_reserved",
                "baseline_allocated", "baseline_reserved", "free_bytes", "nvml_used", "predicted_process", "context_assumed",
                "seeded_allocated", "seeded_reserved", "predict_seconds", "run_seconds"):
        assert gpt2[key] is not None, key
    assert gpt2["real_allocated"] > 0 and gpt2["baseline_allocated"] > 0    # the warm-up's workspace
    assert gpt2["predicted_process"] == gpt2["baseline_reserved"] + gpt2["predicted_reserved"] + gpt2["context_assumed"]
    assert qlora["status"] == "skipped: bitsandbytes CUDA kernels absent" and qlora["real_allocated"] is None
    # the stand-in's "allocator" is gpulab's simulator: on the lessons' CNN the plain step is the prediction
    assert cnn["status"] == "ran" and cnn["predicted_allocated"] == cnn["real_allocated"]
    assert cnn["predicted_reserved"] == cnn["real_reserved"]
    assert gen["status"] != "not run" and gen["predicted_allocated"] is not None
    # the time column: predicted by the time model, not measured on the stand-in (and said so)
    assert 0 < gpt2["predicted_step_s"] < 1 and gpt2["real_step_s"] is None
    assert "predicted (roofline, H100" in gpt2["time_note"] and "not measured on a GPU" in gpt2["time_note"]
    assert gen["predicted_step_s"] is None and "no time model for generate()" in gen["time_note"]
    # the traced case: a snapshot pickle with its provenance, the blocks alive at its peak
    import pickle
    tr = gen["trace"]
    snap = pickle.loads((out / tr["file"]).read_bytes())
    assert snap["device_traces"][0] and tr["events"] == len(snap["device_traces"][0])
    prov = json.loads((out / tr["provenance"]).read_text())
    assert prov["gpu_name"] == STANDIN_NAME and prov["case"] == "llama1b-generate-b4" and "generate()" in prov["what"]
    assert 0 < tr["peak_bytes"] and tr["largest"][0]["bytes"] >= tr["largest"][-1]["bytes"] > 0
    assert all("cuda_standin" not in x["where"] and x["where"] != "no frames" for x in tr["largest"])
    assert gpt2["trace"] is None
    # the T4 case on the CPU: in the report, every run
    assert raw["t4_cpu"]["fake_t4_excess_per_element"] == 0.0 and raw["t4_cpu"]["cpu_excess_per_element"] == 3.0
    assert raw["workspaces"] == []          # --cases picks cases: no cuDNN workspace sweep
    # the fit check: an emulated card, the allocator limited, b and b + 1 tried, an OOM caught
    (fit,) = gpt2["fit"]
    assert fit["card"] == "context+100MiB" and fit["card_bytes"] == 600 * MiB and fit["context_bytes"] == 500 * MiB
    assert fit["limit_bytes"] == 100 * MiB and fit["fit_batch"] >= 1
    assert str(fit["fit_batch"]) in fit["tried"] and "OOM" in fit["tried"].values()
    assert fit["baseline_reserved"] == 20 * MiB        # the stand-in's cuBLAS-like workspace segment
    assert fit["fit_workspace_bytes"] > 0 and "CUDA kernels of" in fit["kernels"]
    assert raw["kernels"].startswith("gpulab's default")   # the stand-in is no card gpulab knows
    b = str(fit["fit_batch"])
    assert fit["predicted_fits"][b] is True and fit["predicted_fits"][str(fit["fit_batch"] + 1)] is False
    assert 0 < fit["predicted_reserved"][b] <= fit["limit_bytes"]
    assert all(fit["real_reserved"][n] > 0 for n, t in fit["tried"].items() if t == "ran")
    assert fit["verdict"].startswith(("PASS", "MISS"))
    assert left <= raw["cases"][-1]["baseline_allocated"]       # every case's memory was given back


def test_quick_report_says_first_that_no_gpu_measured_anything(pv, quick_run):
    _, out, md, _, _ = quick_run
    text = (out / pv.MD_NAME).read_text()
    first = text.splitlines()[0]
    assert first.startswith("## ") and "NO GPU MEASURED ANYTHING" in first
    assert "NVIDIA" not in text and "No GPU measured any figure" in text
    assert "| check | target | result |" in text and "within ±1%" in text and "within ±3%" in text
    assert "within ±5%" in text and "exact in ≥90%, never one too many" in text
    assert "| llama1b-qlora |" in text and "skipped: bitsandbytes CUDA kernels absent" in text
    assert "### Fit on emulated cards" in text and "| gpt2-fp32-adamw | context+100MiB | 600.00 MiB |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| gpt2-fp32-adamw |"))
    assert "not measured on a GPU" in row and "Under the stand-in no time was measured on a GPU" in text
    assert "| the time model's step time vs CUDA events (steps 3–10) | within ±25% in ≥80% | not measured" in text
    assert "### The allocator's trace" in text and "**llama1b-generate-b4** (`traces/llama1b-generate-b4.pickle`" in text
    assert "### The T4 case on the CPU" in text and "288.00 MiB a layer" in text
    # the section went into --md under its own heading, the file's own content kept
    doc = md.read_text()
    assert doc.startswith("# GPU validation\n\nThe other script's report.\n")
    assert pv.MARK_START in doc and pv.MARK_END in doc and text.strip() in doc


def test_a_missed_target_is_a_miss_with_its_size(pv, quick_run):
    _, out, _, _, _ = quick_run
    rep = json.loads((out / pv.JSON_NAME).read_text())
    gpt2 = pv.CaseRun(**{k: v for k, v in rep["cases"][0].items() if k != "fit"})
    check = pv.allocated_check(gpt2)
    diff = gpt2.predicted_allocated - gpt2.real_allocated
    assert diff != 0 and not check.passed       # the stand-in's for-loop AdamW is not CUDA's foreach
    text = (out / pv.MD_NAME).read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| gpt2-fp32-adamw |"))   # the cases' table
    assert f"MISS by {pv.gv._pct(check.difference)} ({pv.gv._signed_bytes(diff)})" in row
    assert any(r.startswith("fake prediction") for r in pv.missed(_report(pv, rep)))


def _report(pv, raw):
    cases = []
    for c in raw["cases"]:
        fits = [pv.FitCheck(**f) for f in c["fit"]]
        cases.append(pv.CaseRun(**{**c, "fit": fits}))
    return pv.Report(**{**raw, "cases": cases})


def test_the_plain_step_allocates_what_the_one_loop_allocates(pv):
    """The plain step (no tracker) is the one loop's step: under the stand-in, where both run on
    the same kernels, its allocator peaks equal the cuda engine's run of ``gpulab.step`` to the byte."""
    cases = {c.name: c for c in pv.quick_cases()}
    for name in ("llama1b-lora",):   # LoRA built as the prediction builds it (recipe_workload)
        engine, plain = _engine_and_plain_peaks(pv, cases[name])
        assert engine == plain and plain[0] > 0, name


def _engine_and_plain_peaks(pv, c):
    """Case ``c`` under the stand-in, twice: ``gpulab.step`` on the cuda engine, then the plain step;
    each one's (allocated, reserved) peak above what was there before it."""
    import gpulab
    with pytest.MonkeyPatch.context() as mp:
        cm, _ = _standin(mp)
        try:
            pv.warm_up()
            _, model = pv.model_arg(c)
            a = gpulab.step(model, batch=c.batch, seq_len=c.seq_len, optimizer=c.optimizer, steps=pv.STEPS,
                            engine="cuda", dtype=c.dtype, guard=False, **c.options).measurement.allocator
            pv.free_memory()
            base, rbase = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            pv.plain_run(c, model, c.batch, True)
            plain = (torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved() - rbase)
            pv.free_memory()
        finally:
            cm.__exit__(None, None, None)
    return (a["peak_allocated_delta"], a["peak_reserved_delta"]), plain


# --- out of memory, errors, time limits ------------------------------------------------------------

def test_an_out_of_memory_case_is_caught_and_the_run_goes_on(pv, tmp_path):
    """A batch the (1 GiB) stand-in cannot hold: the plain step raises torch.OutOfMemoryError,
    which is that case's result; its memory is given back and the next case runs."""
    huge = pv.Case("huge-batch", "tiny-gpt2", 2048, seq_len=256)
    small = pv.Case("small-cnn", "cnn", 8, optimizer="momentum")
    with pytest.MonkeyPatch.context() as mp:
        cm, gpu = _standin(mp, total_bytes=GiB, context_bytes=100 * MiB)
        try:
            rep = pv.validate(tmp_path, cases=[huge, small])
            left = gpu.sim.memory_allocated()
        finally:
            cm.__exit__(None, None, None)
    first, second = rep.cases
    assert first.status.startswith("out of memory: OutOfMemoryError") and "CUDA out of memory" in first.error
    assert first.predicted_allocated > GiB and first.real_allocated is None
    assert second.status == "ran" and second.real_allocated > 0
    assert left == second.baseline_allocated
    text = (tmp_path / pv.MD_NAME).read_text()
    assert "| huge-batch |" in text and "out of memory: OutOfMemoryError" in text
    assert "MISS: 1 ran, 0 skipped, 1 failed (huge-batch: out of memory" in text


def test_time_limits_stop_cases_and_say_so(pv, tmp_path):
    with pytest.raises(pv.CaseTimeout):
        with pv.time_limit(0.2):
            time.sleep(5)
    with pytest.MonkeyPatch.context() as mp:
        cm, _ = _standin(mp)
        try:
            rep = pv.validate(tmp_path, quick=True, names=["gpt2-fp32-adamw", "resnet50-fp32-momentum"],
                              time_limit_s=0)
            slow = pv.measure_case(pv.quick_cases()[0], stand_in=True, context_assumed=0, case_limit=0.05)
        finally:
            cm.__exit__(None, None, None)
    assert rep.cases == [] and rep.not_run == ["gpt2-fp32-adamw: time limit reached",
                                               "resnet50-fp32-momentum: time limit reached"]
    assert pv.missed(rep)[-1] == "cases"
    assert slow.status == "timed out" and "time limit" in slow.error


# --- the renderer on hand-made data ----------------------------------------------------------------

def _device():
    return {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_total_bytes": 85 * 10**9, "driver": "570.1",
            "cuda_runtime": "12.8", "cudnn": 91000, "compute_capability": "9.0", "torch": "2.15.0",
            "torchvision": "0.29.2", "python": "3.12.3", "gpulab_version": "0.1.0", "gpulab_commit": "abc",
            "time_utc": "2026-11-27 10:00 UTC", "stand_in": False}


def _case(pv, name, predicted, real, **kw):
    fields = dict(status="ran", predicted_tensors=predicted, predicted_allocated=predicted, real_allocated=real,
                  predicted_reserved=real, real_reserved=real, predicted_process=real + GiB, nvml_used=real + GiB)
    fields.update(kw)
    return pv.CaseRun(name, "GPT-2", "adamw, float32", 8, 1024, **fields)


def test_renderer_judges_targets_and_fit(pv):
    base = 1000 * MiB
    ok = _case(pv, "ok", int(base * 1.009), base)
    bad = _case(pv, "bad", int(base * 1.011), base, predicted_reserved=int(base * 0.96))
    exact = pv.FitCheck("T4", fit_batch=5, real_largest=5, real_largest_exact=True, verdict="PASS",
                        tried={"5": "ran", "6": "OOM"})
    over = pv.FitCheck("24GiB", fit_batch=7, real_largest=6, real_largest_exact=True,
                       verdict="MISS: too many by 1 (batch 7 ran out of memory)", tried={"7": "OOM", "6": "ran"})
    ok.fit, bad.fit = [exact], [over]
    rep = pv.Report(_device(), "t", cases=[ok, bad])
    text = pv.render(rep)
    assert text.splitlines()[0] == pv.HEADING and "NOT A GPU" not in text
    bad_row = next(ln for ln in text.splitlines() if ln.startswith("| bad |"))
    assert f"MISS by +1.10% (+{(int(base * 1.011) - base) / MiB:,.2f} MiB)" in bad_row
    assert "MISS by −4.00%" in bad_row
    ok_row = next(ln for ln in text.splitlines() if ln.startswith("| ok |"))
    assert ok_row.count("PASS") == 3
    assert "MISS: 1 of 2 outside (bad)" in text
    assert "MISS: exact in 1/2 (50%); one batch too many or more in 24GiB" in text
    rows = pv.summary_rows(rep)
    assert rows[3][0].startswith("the time model's") and rows[3][2].startswith("not measured")   # no time here
    assert pv.missed(rep) == [r[0] for r in rows[:2]] + [rows[3][0], rows[5][0]]
    # all exact but one too few: 2/3 exact is below 90%
    few = pv.FitCheck("40GiB", fit_batch=3, real_largest=4, real_largest_exact=True, verdict="MISS: too few by 1")
    assert pv.fit_summary([exact, exact, few]).startswith("MISS: exact in 2/3 (67%)")
    assert pv.fit_summary([exact] * 9 + [pv.FitCheck("x", verdict="not emulated: larger")]).startswith(
        "PASS: exact in 9/9")
    # the compile gap: reported, no target
    gap = _case(pv, "gpt2-compile", int(base * 0.8), base, target=False, note="inductor vs aot_eager")
    text = pv.render(pv.Report(_device(), "t", cases=[gap]))
    assert "gap −20.00% (no target)" in text and "| gpt2-compile: inductor vs aot_eager | reported (no target) |" in text


def test_the_section_replaces_an_earlier_one_and_keeps_the_rest(pv):
    first = pv.insert_section("# Doc\n\nkept\n", "## A\n\nbody-1\n")
    assert first.startswith("# Doc\n\nkept\n\n" + pv.MARK_START)
    again = pv.insert_section(first + "\n## after\n", "## A\n\nbody-2\n")
    assert "body-1" not in again and "body-2" in again and again.count(pv.MARK_START) == 1
    assert pv.MARK_END + "\n\n## after" in again
    assert again.startswith("# Doc\n\nkept\n") and again.rstrip().endswith("## after")
    assert pv.insert_section("", "## A\n").startswith(pv.MARK_START)


def test_the_gpu_validation_keeps_the_section_when_it_rewrites_the_file(pv, tmp_path):
    """benchmarks/gpu_validation.py --md rewrites the same file: the practitioner section stays."""
    md = tmp_path / "gpu-validation.md"
    pv.write_report(pv.Report(_device(), "t", cases=[_case(pv, "ok", MiB, MiB)]), tmp_path / "p", md)
    section = md.read_text()
    gv = pv.gv
    text = gv.write_report(gv.Report(_device(), "t"), tmp_path / "g", md)
    doc = md.read_text()
    assert doc.startswith(text) and doc.endswith(section) and doc.count(pv.MARK_START) == 1
    pv.write_report(pv.Report(_device(), "t2", cases=[_case(pv, "again", MiB, MiB)]), tmp_path / "p", md)
    doc = md.read_text()
    assert doc.startswith(text) and "| again |" in doc and "| ok |" not in doc


def test_emulated_cards_have_this_devices_kernels(pv, monkeypatch):
    """On an H100, a T4 check asks fit about a T4's memory with the H100's kernels and cuBLAS
    workspaces (what the emulated run has); the H100 check is the device's own card."""
    from gpulab.predict.cards import parse_gpu
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    h100 = pv.device_card()
    assert h100 == parse_gpu("H100") and h100.capability == (9, 0)
    t4 = pv.emulated_card("T4", h100, 1200 * MiB)
    assert t4.reported_total_bytes == parse_gpu("T4").reported_total_bytes and t4.capability == (9, 0)
    assert t4.workspace_bytes() == h100.workspace_bytes() and "T4" in t4.name and "H100" in t4.name
    assert pv.emulated_card("H100", h100, 1200 * MiB) == h100
    quick = pv.emulated_card("context+60MiB", h100, 1200 * MiB)
    assert quick.reported_total_bytes == 1260 * MiB and quick.capability == (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: STANDIN_NAME)
    assert pv.device_card() is None and pv.emulated_card("T4", None, 0) == parse_gpu("T4")


def test_merge_keeps_an_earlier_runs_cases_of_the_same_gpu(pv):
    """``--merge``: a run of a few cases keeps the earlier report's other cases (same GPU), in the
    cases' order, says which run measured them, and stays the same when saved again; another
    GPU's report is not merged."""
    dev = {"gpu_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "gpulab_commit": "0123abcdef"}
    old = pv.Report(device=dev, started="2026-11-27T11:17:33+00:00",
                    cases=[pv.CaseRun(c.name, c.model, "r", c.batch, status="ran",
                                      fit=[pv.FitCheck("T4", fit_batch=7)] if i == 0 else [])
                           for i, c in enumerate(pv.CASES[:3])])
    back = pv.Report.from_dict(json.loads(json.dumps(old.as_dict())))
    assert back == old and isinstance(back.cases[0].fit[0], pv.FitCheck)
    new = pv.Report(device=dev, started="later", cases=[pv.CaseRun(pv.CASES[-1].name, "m", "r", 2, status="ran"),
                                                        pv.CaseRun(pv.CASES[1].name, "m", "again", 8, status="ran")])
    for _ in range(2):          # saved after every case: the same answer each time
        pv.merge_earlier(new, back)
        assert [c.name for c in new.cases] == [pv.CASES[0].name, pv.CASES[1].name, pv.CASES[2].name, pv.CASES[-1].name]
        assert new.cases[1].recipe == "again" and len(new.earlier) == 1
    assert new.earlier[0].startswith(f"{pv.CASES[0].name}, {pv.CASES[2].name}: run started 2026-11-27T11:17:33")
    assert "(commit 0123abc), 2.11.0+cu130" in new.earlier[0]
    assert "Merged (`--merge`) with an earlier run" in pv.render(new)
    other = pv.Report(device=dict(dev, gpu_name="NVIDIA H200"), started="x")
    pv.merge_earlier(other, back)
    assert other.cases == [] and "not merged: another device" in other.not_run[0]


# --- the time column, the trace, the T4 case on the CPU ----------------------------------------------

def test_time_summary_counts_within_and_orders_pairs(pv):
    """±25% and the order of every two timed cases, on hand-made times (seconds per step)."""
    def timed(name, pred, real):
        return _case(pv, name, MiB, MiB, predicted_step_s=pred, real_step_s=real)
    cases = [timed("a", 0.10, 0.11), timed("b", 0.30, 0.20), timed("c", 0.05, 0.30), timed("d", 0.5, None)]
    rep = pv.Report(_device(), "t", cases=cases)
    within, order = pv.time_summary(rep)
    # a: −9% in, b: +50% out, c: −83% out (d has no measured time); pairs: a<b right, a>c wrong, b<c wrong
    assert within == "MISS: 1 of 3 within ±25% (33%)" and order == "1 of 3 pairs (33%)"
    assert pv.time_verdict(cases[0]) == "PASS −9.09%" and pv.time_verdict(cases[1]) == "MISS by +50.00%"
    assert pv.time_verdict(cases[3]) == "—"
    text = pv.render(rep)
    assert "| the time model's step time vs CUDA events (steps 3–10) | within ±25% in ≥80% | MISS: 1 of 3" in text
    assert "| the order of two recipes by time (every pair of timed cases) | reported (no target) | 1 of 3 pairs" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| b |"))
    assert "| 300.0 ms | 200.0 ms | MISS by +50.00% |" in row
    good = pv.Report(_device(), "t", cases=[timed(n, x, x * 1.1) for n, x in zip("wxyz", (0.1, 0.2, 0.3, 0.4))])
    assert pv.time_summary(good) == ("PASS: 4 of 4 within ±25% (100%)", "6 of 6 pairs (100%)")


def _snap(events):
    return {"segments": [], "device_traces": [[{"action": a, "addr": addr, "size": size,
                                                 "frames": [{"filename": "/x/torch/nn/f.py", "line": 1, "name": "t"},
                                                            {"filename": f"/m/{where}.py", "line": 7, "name": "fwd"}]}
                                                for a, addr, size, where in events]]}


def test_trace_peak_names_the_blocks_alive_at_the_peak_and_their_difference(pv):
    """The trace replayed: the peak of the blocks alive, the largest there with the first frames
    outside torch; a second trace's difference by block size."""
    a = pv.trace_peak(_snap([("alloc", 1, 100, "w"), ("alloc", 2, 300, "mask"), ("alloc", 3, 200, "noise"),
                             ("free_completed", 2, 300, "mask"), ("alloc", 4, 50, "late"),
                             ("free_completed", 9, 999, "never")]))
    assert a["peak_bytes"] == 600 and a["alive_at_peak"] == 3 and a["events"] == 6
    assert [x["bytes"] for x in a["largest"]] == [300, 200, 100]
    assert a["largest"][0]["where"] == "mask.py:7 fwd"      # torch's own frame left out
    b = pv.trace_peak(_snap([("alloc", 1, 100, "w"), ("alloc", 2, 300, "mask"), ("alloc", 5, 20, "bool")]))
    assert pv.trace_difference(a, b) == [{"bytes": 200, "more": 1}, {"bytes": 20, "more": -1}]
    assert pv.trace_peak({"device_traces": []})["peak_bytes"] == 0


def test_the_t4_case_reproduced_on_the_cpu(pv):
    """The math kernel's attention with dropout: the real CPU run saves an s×s float32 noise tensor
    (``_dropout_impl``), where CUDA's ``native_dropout`` saves a bool mask, as gpulab's fake engine for a
    T4 now does (``fake_cuda._cuda_dropout_op``) and its own ``F.dropout`` swap did: 3 bytes an element,
    288 MiB a GPT-2 layer at 8 × 12 heads × 1024²; with the bf16 reduction allowed the math path stays in
    bf16."""
    t = pv.t4_dropout_on_cpu(batch=2, heads=2, seq=32, head_dim=8)
    n = 2 * 2 * 32 * 32
    four_d = {key: [(x["dtype"], x["bytes"]) for x in t[f"{key}_square"] if len(x["shape"]) == 4]
              for key in ("cpu", "fake_t4")}
    assert four_d["cpu"] == [("float32", 4 * n), ("float32", 4 * n)] and t["cpu_excess_per_element"] == 3.0
    assert four_d["fake_t4"] == [("float32", 4 * n), ("bool", n)] and t["fake_t4_excess_per_element"] == 0.0
    assert [(x["dtype"], x["bytes"]) for x in t["fake_f_dropout"]] == [("bool", n)]
    assert {x["dtype"] for x in t["cpu_reduction_allowed"]} == {"bfloat16"}
    assert t["excess_per_layer_at_full_bytes"] == 8 * 12 * 1024 * 1024 * 3
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()     # the setting put back


def test_the_cudnn_workspace_sweep_under_the_standin(pv):
    """One setting of the sweep (a channels-last ResNet on the cuda engine): its figures, each from
    the run (the stand-in's allocator holds tensors only: nothing beyond them), and the report's table;
    the sweep is bounded: ResNet-50 and VGG-16 settings only, the ResNet-50 case's own first."""
    setting = pv.QUICK_SWEEP[0]
    assert setting.channels_last and setting.amp is None
    with pytest.MonkeyPatch.context() as mp:
        cm, gpu = _standin(mp)
        try:
            pv.warm_up()
            r = pv.workspace_setting_run(setting)
            left = gpu.sim.memory_allocated()
        finally:
            cm.__exit__(None, None, None)
    assert "error" not in r, r.get("error")
    assert r["name"] == setting.name and r["tensors_peak"] > 0 and r["reserved_peak"] > 0
    assert r["allocated_peak"] == r["tensors_peak"] + r["beyond_tensors"] and r["beyond_tensors"] == 0
    assert r["tensors_reserved"] > 0 and 0 < r["seconds"]
    assert left == gpu.sim.memory_allocated() and left <= 20 * MiB    # given back: the workspace-like segment only
    text = "\n".join(pv.workspace_lines([r, {"name": "broken", "error": "RuntimeError: boom\nframes"}]))
    assert f"| {setting.name} | {r['tensors_peak'] / MiB:,.2f} MiB |" in text
    assert "| broken | error: RuntimeError: boom |" in text
    assert [s.model for s in pv.WORKSPACE_SWEEP][0] == "resnet50" and pv.WORKSPACE_SWEEP[0].batch == 64
    assert {s.model for s in pv.WORKSPACE_SWEEP} == {"resnet50", "vgg16"} and len(pv.WORKSPACE_SWEEP) <= 8
    assert {(s.amp, s.channels_last) for s in pv.WORKSPACE_SWEEP} == {(None, False), (None, True), ("bf16", False),
                                                                       ("bf16", True)}


# --- every case under the stand-in (extended) -----------------------------------------------------

@pytest.mark.extended
@pytest.mark.timeout(1800)   # 33 cases and 13 fit checks: 13 min on this 2-core machine under load
def test_every_case_runs_under_the_standin(pv, tmp_path):
    """All cases, --quick, fit checks included: each runs or is skipped with its reason (no error),
    every fit check tried b and b + 1, the traced cases wrote their snapshots, the T4 pair is compared."""
    with pytest.MonkeyPatch.context() as mp:
        cm, _ = _standin(mp)
        try:
            rep = pv.validate(tmp_path, quick=True, time_limit_s=3000, case_limit=900)
        finally:
            cm.__exit__(None, None, None)
    assert [r.name for r in rep.cases] == [c.name for c in pv.CASES] and not rep.not_run
    assert [w["name"] for w in rep.workspaces] == [s.name for s in pv.QUICK_SWEEP]      # the sweep, after the cases
    assert all("error" not in w and w["tensors_peak"] > 0 for w in rep.workspaces), rep.workspaces
    moe, sliding = (pv.MODELS[k][1]() for k in ("mixtral-small", "gemma3-small"))
    assert type(moe).__name__ == "MixtralConfig" and moe.num_local_experts > moe.num_experts_per_tok
    assert sliding.sliding_window < 2048 and "sliding_attention" in sliding.layer_types   # the case's 2048 positions
    for r in rep.cases:
        assert r.ran or r.status.startswith("skipped: "), (r.name, r.status, r.error)
        if r.ran and r.name != "llama1b-generate-b4" and "generate" not in r.name:
            assert r.predicted_step_s and r.predicted_step_s > 0, r.name
    fits = [f for r in rep.cases for f in r.fit]
    assert len(fits) >= 12 and all(f.verdict.startswith(("PASS", "MISS")) for f in fits), [f.verdict for f in fits]
    traced = {r.name: r.trace for r in rep.cases if r.trace}
    assert {"gpt2-t4-kernels-bf16", "gpt2-bf16", "llama1b-bf16-adamw", "llama1b-generate-b4"} <= set(traced)
    assert all((tmp_path / t["file"]).exists() and (tmp_path / t["provenance"]).exists() for t in traced.values())
    text = (tmp_path / pv.MD_NAME).read_text()
    assert "Alive at the peak in gpt2-t4-kernels-bf16 beyond gpt2-bf16" in text


# (the interleaved pipeline's rank is not here: under the stand-in its plain step holds one layer's
# activations more at its peak than the loop's run_in_flight, 129 KiB on the tiny model, which the
# allocator's trace shows and whose cause is not found)
NEW_RECIPES = ("gpt2-fp16-gradscaler", "gpt2-accumulate4-clip", "gpt2-opt-in-backward", "gpt2-keep-grads",
               "gpt2-adamw-for-loop", "qwen-offload", "mixtral-moe-bf16", "gemma3-sliding-bf16", "qwen-ckpt-every2",
               "gpt2-bf16")


@pytest.mark.extended
@pytest.mark.parametrize("name", NEW_RECIPES)
def test_each_new_plain_step_allocates_what_the_one_loop_allocates(pv, name):
    """The plain steps of issue 48's recipes (written as PyTorch's documentation writes each option)
    against gpulab's cuda engine on the same (stand-in) kernels: equal to the byte."""
    engine, plain = _engine_and_plain_peaks(pv, {c.name: c for c in pv.quick_cases()}[name])
    assert engine == plain and plain[0] > 0


@pytest.mark.extended
def test_the_fsdp2_case_shards_in_the_fake_process_group_on_the_cpu(pv):
    """The FSDP2 case's plain step (which the stand-in cannot run: its mesh needs a CUDA device) on the
    CPU: rank 0 of 4 in PyTorch's fake process group trains its steps holding a quarter of every
    parameter (each dim 0 split 4 ways evenly here), and the process group is gone after."""
    import torch.distributed as dist
    c = {c.name: c for c in pv.quick_cases()}["llama1b-fsdp2-rank0of4"]
    _, model = pv.model_arg(c)
    built = []
    got = pv.plain_fsdp2(c, model, c.batch, lambda: built.append(True), device="cpu")
    assert built == [True] and got["local"] * 4 == got["whole"] > 0
    assert not dist.is_initialized()
