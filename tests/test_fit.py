"""gpulab.fit / `gpulab fit`: the largest batch that fits a card, checked against fake runs."""
from __future__ import annotations

import json

import pytest
import torch

import gpulab
from gpulab.predict.cards import parse_gpu
from gpulab.predict.fake_runs import fake_run as _run
from gpulab.predict.fit import _check, _Extrapolation
from gpulab.training.loop import LoopRecipe
from gpulab.units import MiB
from gpulab.models.workload import resolve_workload

from conftest import run_main


def test_extrapolation_equals_a_fake_run_event_for_event():
    """Every storage is a + b·c in the batch: batches 2 and 3 give batch 7 without running it."""
    w = resolve_workload("hf:tiny-llama", seq_len=32)
    two, three, seven = (_run(w, b, torch.float32, LoopRecipe("adam")).tracking for b in (2, 3, 7))
    line = _Extrapolation.make(two, three, 2)
    assert line is not None
    at7 = line.at(7)
    assert [e.nbytes for e in at7.events] == [e.nbytes for e in seven.events]
    assert at7.peak_bytes == seven.peak_bytes and at7.peak_by_category == seven.peak_by_category


def test_batch_one_is_not_a_base():
    """transformers' shifted labels are contiguous at batch 1 (a size-1 dimension), a copy from batch 2
    on: the timelines of batches 1 and 2 do not pair up, which is why the search starts at 2."""
    w = resolve_workload("hf:tiny-llama", seq_len=32)
    one, two = (_run(w, b, torch.float32, LoopRecipe("adam")).tracking for b in (1, 2))
    assert _Extrapolation.make(one, two, 1) is None


@pytest.mark.parametrize("model, gpu, kw", [("mlp", "1GiB", {}),
                                            ("hf:tiny-llama", "1GiB", {"seq_len": 64})])
def test_the_answer_fits_and_the_next_batch_does_not(model, gpu, kw):
    # a small card, for speed: the measured CUDA context (1.35 GiB, predict.context) would fill it, so a
    # smaller one is given; the card's cuBLAS workspaces are counted apart (predict.cards.Card.workspace_bytes)
    r = gpulab.fit(model, gpu, context_bytes=512 * MiB, **kw)
    usable = r.capacity_bytes - r.context_bytes - r.workspace_bytes
    w = resolve_workload(model, **kw)
    at = _check(_run(w, r.largest_batch, torch.float32, LoopRecipe("adam")).tracking, usable, r.largest_batch, "run")
    after = _check(_run(w, r.largest_batch + 1, torch.float32, LoopRecipe("adam")).tracking, usable,
                   r.largest_batch + 1, "run")
    assert at.fits and not after.fits
    assert r.peak_bytes == at.peak_bytes and r.runs == 3     # batches 2, 3 and the answer
    assert r.largest_batch <= r.largest_batch_live
    assert r.needed_bytes == r.reserved_bytes + r.context_bytes + r.workspace_bytes <= r.capacity_bytes
    assert r.margin_bytes == r.capacity_bytes - r.needed_bytes >= 0
    assert "largest batch" in r._repr_html_()


def test_batch_one_does_not_fit_levers_as_formulas():
    r = gpulab.fit("hf:tiny-llama", "3MiB", context_bytes=0, seq_len=64)
    assert r.largest_batch == 0 and r.margin_bytes < 0 and r.runs == 2    # batches 2 and 1
    names = " ".join(lv.name for lv in r.levers)
    for word in ("bf16", "8-bit", "checkpointing", "LoRA", "QLoRA", "sharding"):
        assert word in names, word
    assert all(lv.label.startswith("formula") and lv.peak_bytes <= r.peak_bytes for lv in r.levers)
    assert sum(lv.peak_bytes < r.peak_bytes for lv in r.levers) >= 4
    assert r.levers[0].peak_bytes == r.peak_bytes // 2       # bf16: every fp32 tensor halves


def test_context_allowance_must_leave_room():
    with pytest.raises(ValueError, match=r"the CUDA context given \(--context / context_bytes\) 300.0 MiB is the "
                                         r"whole of 256 MiB's 256.0 MiB or more"):
        gpulab.fit("mlp", "256MiB", context_bytes=300 * MiB)


def test_cli_fit_json_fields(capsys):
    code, out, err = run_main(["fit", "mlp", "--gpu", "T4", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    for key in ("model", "capacity_bytes", "largest_batch", "peak_bytes", "peak_by_category", "engine", "label",
                "reserved_bytes", "allocator_overhead_bytes", "context_bytes", "margin_bytes", "checks"):
        assert key in d, key
    # a T4 plans with the 14.74 GiB CUDA reports, not the advertised 16 GB
    assert d["capacity_bytes"] == parse_gpu("T4").reported_total_bytes < parse_gpu("T4").memory_bytes
    assert "14.74 GiB" in d["capacity_note"] and d["engine"] == "fake"
    code, out, _ = run_main(["fit", "mlp", "--gpu", "T4"], capsys)
    assert code == 0 and "largest batch that fits" in out and "margin" in out


@pytest.mark.parametrize("argv, words", [
    (["fit", "mlp", "--gpu", "H1000"], ["cannot read --gpu", "24GiB", "H100"]),
    (["fit", "mlp"], ["--gpu"]),
    (["fit", "hf:llama3", "--gpu", "H100"], ["unknown transformer config", "llama-3-8b"]),
    (["step", "hf:tiny-gpt2", "--seq-len", "100000"], ["longer than"]),
    (["step", "mlp", "--amp", "fp8"], ["--amp", "fp16", "bf16"]),
])
def test_cli_errors_are_one_line_exit_2(argv, words, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert all(w in err for w in words), err


def test_cli_step_any_model_and_breakdown(capsys):
    code, out, err = run_main(["step", "hf:tiny-gpt2", "--engine", "fake", "--seq-len", "16", "--batch", "2",
                               "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["kind"] == "tokens" and len(d["step_peaks"]) == 2 and d["steps"] == 2
    code, out, _ = run_main(["breakdown", "torchvision:resnet50"], capsys)
    assert code == 0 and "total params 25,557,032" in out


@pytest.mark.slow
def test_llama_3_8b_on_a_24_gib_card_needs_a_lever():
    r = gpulab.fit("hf:llama-3-8b", "RTX4090", dtype="bf16", optimizer="adamw", seq_len=2048)
    assert r.largest_batch == 0 and r.peak_by_category["parameters"] >= 8_030_261_248 * 2
    assert any(lv.fits for lv in r.levers)


def _calls_into_hf_configs(run) -> "collections.Counter[str]":
    """How many times ``run()`` calls each function of models/hf_configs.py from outside that module."""
    import collections
    import sys

    from gpulab.models import hf_configs
    calls: collections.Counter[str] = collections.Counter()

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == hf_configs.__file__ \
                and frame.f_back is not None and frame.f_back.f_code.co_filename != hf_configs.__file__:
            calls[frame.f_code.co_name] += 1
    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_a_fit_resolves_the_config_once():
    """One ``hf_configs.resolve`` turns ``model`` into a workload; every later reader takes the facts it
    carries (``Workload.facts``). Before: six trips for the name (names_local_config, hf_entry,
    make_config, check_settings, max_positions, vocab_size), and task_of, is_config and config_summary
    again for a config object with chunked loss and levers."""
    calls = _calls_into_hf_configs(lambda: gpulab.fit("hf:tiny-llama", "24GiB"))
    assert calls["resolve"] == 1 and set(calls) <= {"resolve", "build_model"}, calls
    from gpulab.models.hf_configs import make_config
    config = make_config("tiny-llama")
    result = []
    calls = _calls_into_hf_configs(lambda: result.append(gpulab.fit(config, "1400MiB", chunked_loss=4)))
    assert result[0].levers and calls["resolve"] == 1, calls   # levers listed: the summary read off the facts
    assert not set(calls) & {"is_config", "check_settings", "config_summary", "task_of", "max_positions",
                             "vocab_size", "per_layer_lists"}, calls
