"""Issues 45 (item 6) and 46 (item 7): what makes a layout's ``fit`` and ``--what-fits`` answer sooner leaves
the answer as it was. Layer repeat's small runs (``predict.layer_pattern.BASE_BLOCKS``: runs of 1, 2 and 3
layers) against the full depth (``not_repeatable`` switched off) on a small pipeline whose stages are laid
out (the default suite's check of the same is ``tests/test_layer_repeat.py``: plain, recipe, tensor-parallel
and pipeline-stage steps laid out from those runs equal the full-depth run, and a 12-layer fit both ways);
on the issues' own commands (Llama-3.1-70B on 64 H100s as TP 8 × PP 4 with sequence parallelism;
Llama-3-8B's ``--what-fits`` on 24 GiB) against the runs of 2, 3 and 4 layers the layout was first made
with (extended: minutes each)."""
from __future__ import annotations

import pytest

import gpulab
from gpulab.models import hf_configs
from gpulab.predict import layer_pattern
from gpulab.predict import layer_repeat as L
from gpulab.predict import run_cache


def _memory(result) -> dict:
    """A fit answer's memory figures as data: all of it but the time, the seconds, the fake runs counted and how
    the depth ran."""
    d = result.as_dict()
    for key in ("time", "seconds", "runs", "layers", "time_note"):
        d.pop(key, None)
    return d


def _time(result) -> dict:
    """The predicted step's figures (floats), without the sentences naming the small runs' depths."""
    t = result.as_dict()["time"] or {}
    return {k: v for k, v in t.items() if isinstance(v, (int, float)) and k != "wall_s"}


@pytest.mark.extended   # 12-layer stages at full depth: 114 s measured on the shared 2-core machine, loaded
def test_a_pipeline_laid_out_from_one_layer_answers_as_the_full_depth(monkeypatch):
    """pp 2 over 24 layers: each stage's 12 layers laid out from runs of 1 and 2 layers (learned with 3) give
    the batch, every stage's row and every figure the full-depth stage runs give."""
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 96
    cfg.num_hidden_layers, cfg.vocab_size = 24, 256
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=16, context_bytes=0, pp=2, predict_time=False)
    run_cache.clear()
    laid = gpulab.fit(cfg, "40MiB", **kw)
    assert "12 layers laid out from fake runs of 1 and 2 layers" in laid.layers and laid.largest_batch > 3
    run_cache.clear()
    monkeypatch.setattr(L, "not_repeatable", lambda *a, **k: "switched off by the test")
    full = gpulab.fit(cfg, "40MiB", **kw)
    run_cache.clear()
    assert full.layers == "switched off by the test"
    assert _memory(laid) == _memory(full)


def _both_ways(monkeypatch, call):
    """``call()`` with the small runs of 1, 2 and 3 layers, then of 2, 3 and 4 (``BASE_BLOCKS`` 2)."""
    run_cache.clear()
    fast = call()
    run_cache.clear()
    monkeypatch.setattr(layer_pattern, "BASE_BLOCKS", 2)   # where Pattern.blocks reads it
    slow = call()
    run_cache.clear()
    return fast, slow


@pytest.mark.extended   # two 70B TP 8 x PP 4 fits: minutes on a 2-core machine
def test_the_70b_tp8_pp4_layout_answers_as_with_runs_of_two_to_four_layers(monkeypatch):
    fast, slow = _both_ways(monkeypatch, lambda: gpulab.fit(
        "hf:llama-3.1-70b", "H100", gpus=64, tp=8, pp=4, sequence_parallel=True, dtype="bf16", optimizer="adamw",
        seq_len=4096))
    assert "fake runs of 1 and 2 layers" in fast.layers and "fake runs of 2 and 3 layers" in slow.layers
    assert _memory(fast) == _memory(slow)
    # the time: the same formula laid out from other depths, equal but for the floats' last bits
    assert fast.time is not None and _time(fast).keys() == _time(slow).keys()
    for key, value in _time(slow).items():
        assert _time(fast)[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


@pytest.mark.extended   # two --what-fits answers for 8B on 24 GiB: minutes on a 2-core machine
def test_what_fits_for_8b_on_24gib_answers_as_with_runs_of_two_to_four_layers(monkeypatch):
    from gpulab.predict.what_fits import what_fits
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=4096)
    fast, slow = _both_ways(monkeypatch, lambda: (gpulab.fit("hf:llama-3-8b", "24GiB", **kw),
                                                  what_fits("hf:llama-3-8b", "24GiB", batch=1, **kw)))
    assert _memory(fast[0]) == _memory(slow[0])
    a, b = (dict(w.as_dict()) for w in (fast[1], slow[1]))
    a.pop("seconds"), b.pop("seconds")
    assert a == b and a["tried"]


@pytest.mark.extended   # four tiny pp 3 × tp 2 stage searches: ~35 s of CPU on the shared 2-core machine
def test_a_layout_learned_on_one_stage_serves_the_others_as_each_stage_learning_its_own(monkeypatch):
    """pp 3 × tp 2 with sequence parallelism over 36 layers: the first stage learns its layout (runs of 1, 2 and
    3 layers), the middle and last stages take it moved onto their own runs (``layer_repeat.transfer``: their
    runs of 1 and 2 layers rebuilt exactly) instead of a 3-layer run each; every stage's row and every figure
    as when each stage learns its own."""
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 2, 96
    cfg.num_hidden_layers, cfg.vocab_size = 36, 256
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=16, context_bytes=0, pp=3, tp=2, sequence_parallel=True,
              gpus=6, predict_time=False)
    moved = []
    transfer = L.transfer

    def counted(*args):
        out = transfer(*args)
        moved.append(out is not None)
        return out
    monkeypatch.setattr(L, "transfer", counted)
    run_cache.clear()
    shared = gpulab.fit(cfg, "24MiB", **kw)
    assert moved.count(True) == 2 and "12 layers laid out from fake runs of 1 and 2 layers" in shared.layers
    run_cache.clear()
    monkeypatch.setattr(L, "transfer", lambda *args: None)
    own = gpulab.fit(cfg, "24MiB", **kw)
    run_cache.clear()
    assert shared.runs == own.runs - 2 and shared.largest_batch > 3
    assert [r.stages for r in shared.ranks if r.peak_bytes is not None] == [(0,), (1,), (2,)]
    assert _memory(shared) == _memory(own)
