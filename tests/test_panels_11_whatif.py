"""Lesson 11's what-if panel, headless: the formula side against gpulab's formulas computed a second
way, the panel's formula on every move, the measured side on its worker (superseded measurements
dropped, never queued), the sequence slider held to what the model takes, and the panels' run-only
look and engine choices (#47 items 8 and 9). tiny-llama keeps the fake runs to about a second."""
import threading

import pytest
import torch

from gpulab import formulas as F
from gpulab.course import whatif as WI
from gpulab.course.transformer_activations import korthikanti_bytes
from gpulab.course.transformer_params import counted_params
from gpulab.models import hf_configs
from gpulab.predict.sharding import DS_STATE_BYTES
from gpulab.widgets import base, whatif_panel
from gpulab.widgets import whatif as W


def _gpt2():
    s = hf_configs.config_summary(hf_configs.make_config("hf:gpt2"))
    return s["hidden_size"], s["num_heads"], s["num_layers"], s["vocab_size"]


def test_parameters_are_the_built_models_count():
    for model in ("hf:gpt2", "hf:tiny-llama"):
        f = WI.whatif_formula(model, seq_len=128)
        assert f.n_params == counted_params(model)[0]                      # built on the meta device
        assert f.parameters == f.gradients == 2 * f.n_params                # bf16
        assert f.optimizer_state == 2 * f.parameters                        # AdamW: two states
    f = WI.whatif_formula("hf:gpt2", seq_len=128, precision="amp-bf16", optimizer="momentum")
    assert f.parameters == 4 * f.n_params and f.optimizer_state == f.parameters   # fp32 weights, one state


@pytest.mark.parametrize("zero,dp", [(0, 1), (1, 8), (2, 8), (2, 3), (3, 64)])
def test_zero_division_is_the_papers(zero, dp):
    f = WI.whatif_formula("hf:llama-3-8b", seq_len=128, zero=zero, dp=dp)
    n = f.n_params
    if zero == 0:   # plain data parallelism with the run's own bytes: (2 + 2 + 4)·Ψ for bf16 AdamW
        assert f.parameters + f.gradients + f.optimizer_state == F.zero_bytes_per_device(n, dp, 0, 2, 2, 4)
    elif zero < 3:  # the ZeRO paper's P_os / P_os+g with DeepSpeed's K = 16 bytes of fp32 state
        assert f.parameters + f.gradients + f.optimizer_state == F.zero_bytes_per_device(n, dp, zero, 2, 2,
                                                                                         DS_STATE_BYTES)
    else:           # DeepSpeed's ZeRO-3 keeps no 16-bit gradients: (2 + 16)·Ψ/N, one Ψ/N less than the paper
        paper = F.zero_bytes_per_device(n, dp, 3, 2, 2, DS_STATE_BYTES)
        assert f.parameters + f.gradients + f.optimizer_state == paper - 2 * -(-n // dp)
        assert f.gradients == 0


def test_activations_are_korthikantis():
    h, a, layers, vocab = _gpt2()
    s, b = 512, 2
    logits = s * b * vocab * (2 + 4)   # bf16 logits and the loss's fp32 copy
    none = WI.whatif_formula("hf:gpt2", seq_len=s, batch=b)
    assert none.activations == layers * korthikanti_bytes(s, b, h, a) + logits    # GPT-2 has dropout: eq. 1 whole
    assert none.scores_bytes == layers * 5 * a * s * s * b
    sel = WI.whatif_formula("hf:gpt2", seq_len=s, batch=b, recompute="selective")
    assert sel.activations == layers * korthikanti_bytes(s, b, h, a, quadratic=False) + logits
    full = WI.whatif_formula("hf:gpt2", seq_len=s, batch=b, recompute="full")
    assert full.activations == layers * 2 * s * b * h + korthikanti_bytes(s, b, h, a) + logits
    t = 4   # Table 2, tensor parallel without sequence parallelism: s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tp = WI.whatif_formula("hf:gpt2", seq_len=s, batch=b, tp=t)
    assert tp.activations == layers * (s * b * h * 10 + s * b * h * 24 // t + 5 * a * s * s * b // t) + s * b * -(-vocab // t) * 6
    assert tp.parameters == 2 * -(-none.n_params // t)


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match="at most 256 positions"):
        WI.whatif_formula("hf:tiny-llama", seq_len=512)
    with pytest.raises(ValueError, match="must divide"):
        WI.whatif_formula("hf:gpt2", seq_len=128, tp=8)     # 12 heads
    with pytest.raises(ValueError, match="offers"):
        WI.whatif_formula("hf:gpt3", seq_len=128)


def test_panel_formula_follows_every_move_and_measures_the_newest(monkeypatch):
    panel = whatif_panel(model="hf:tiny-llama", seq_len=128, batch=2, debounce_s=0.05)
    first = panel.measure_now()
    assert first is not None and panel.error is None
    # the measured side is the fake run's: parameters as the built model holds them, bf16, each
    # tensor rounded to CUDA's 512 bytes
    with torch.device("meta"):
        net = hf_configs.build_causal_lm(hf_configs.make_config("hf:tiny-llama", use_cache=False))
    assert first.by_category["parameters"] == sum(F.cuda_rounded_bytes(2 * p.numel()) for p in net.parameters())
    assert "error" in panel.formula_html.value and "measured" in panel.formula_html.value
    # a measurement that the student moves past while it runs is dropped; the newest is measured next
    started, go = threading.Event(), threading.Event()
    real = W.whatif_measured

    def held(**args):
        started.set()
        go.wait(30)
        return real(**args)
    monkeypatch.setattr(W, "whatif_measured", held)
    panel.set(batch=4)
    assert started.wait(30)
    assert panel.formula.batch == 4 and "measuring…" in panel.formula_html.value and panel.progress.layout.visibility == "visible"
    panel.set(batch=8)
    panel.set(seq_len=64)                     # two more moves while the first measurement runs
    assert panel.formula.batch == 8 and panel.formula.seq_len == 64       # the formula side at once
    go.set()
    assert panel.wait(120)
    assert panel.dropped == 1 and panel.runs == 2    # kept: the first and the newest; one dropped; no queue
    assert panel.measured.settings["batch"] == 8 and panel.measured.settings["seq_len"] == 64
    assert panel.progress.layout.visibility == "hidden" and "measured in" in panel.status.value
    assert "measuring…" not in panel.formula_html.value


def test_panel_sequence_slider_holds_to_the_model():
    panel = whatif_panel(model="hf:gpt2", seq_len=1024, auto_measure=False)   # the formula side alone
    panel.set(model="hf:tiny-llama")
    assert panel.controls["seq_len"].value == 256 == panel.formula.seq_len
    assert max(panel.controls["seq_len"].options) == 256
    with pytest.raises(ValueError, match="64, 128, 256"):
        panel.set(seq_len=1024)
    panel.set(model="hf:llama-3-8b")
    assert panel.controls["seq_len"].value == 256 and max(panel.controls["seq_len"].options) == 8192
    assert panel._worker is None and panel.measured is None


def test_panels_say_which_kind_they_are_and_what_is_stale():
    controls = {"x": base.slider("x", 1, 1, 4), "engine": base.engine_dropdown("auto")}
    run_only = base.Panel("squares", controls, lambda x, engine: x * x, lambda r: [str(r)])
    assert "run-only" in run_only.widget.children[0].value and "needed after a change" in run_only.run_button.description
    assert run_only.run() == 1 and not run_only.stale
    run_only.controls["x"].value = 3
    assert run_only.stale and "stale" in run_only.status.value and run_only.run_button.button_style == "warning"
    assert run_only.result == 1                       # still the old result, marked, until Run
    assert run_only.run() == 9 and not run_only.stale and run_only.run_button.button_style == "primary"
    live = base.Panel("squares", {"x": base.slider("x", 1, 1, 4)}, lambda x: x * x, lambda r: [str(r)], auto_run=True)
    assert "live" in live.widget.children[0].value and "run-only" not in live.widget.children[0].value
    live.controls["x"].value = 2
    assert live.result == 4 and not live.stale
    if not torch.cuda.is_available():
        assert "cuda" not in base.engine_choices() and "cuda" not in run_only.controls["engine"].options
        assert "not offered" in run_only.widget.children[0].value
        with pytest.raises(ValueError, match="needs a GPU"):
            run_only.set(engine="cuda")


def test_timings_say_only_what_their_spread_supports():
    """Lesson 07: a difference between k and k = 1 is stated only when the interquartile ranges do not
    overlap; a checkpointed step measured faster is the machine's load, never a finding."""
    import dataclasses

    from gpulab.course.checkpointing import checkpoint_sweep
    from gpulab.record.runs.checkpoint import Timing
    r = checkpoint_sweep(4, 8, 4, "divisors of N", "fake")   # memory only: the timings are set below

    def timed(*ms):
        return Timing([m / 1e3 for m in ms], 1, "cpu")

    def with_times(base, other):
        pts = [dataclasses.replace(p, timing=base if p.segments == 1 else other) for p in r.points]
        return dataclasses.replace(r, points=pts)
    def verdict(result):
        return result.timing_verdict(result.points[-1])
    slower = with_times(timed(10, 10, 11, 11, 12), timed(14, 15, 15, 16, 16))
    assert "slower" in verdict(slower) and "×1.36" in verdict(slower)
    overlap = with_times(timed(10, 10, 11, 14, 20), timed(12, 13, 13, 14, 15))
    assert "cannot tell" in verdict(overlap) and "slower" not in verdict(overlap)
    faster = with_times(timed(20, 21, 22, 23, 24), timed(10, 10, 11, 11, 12))
    assert "load" in verdict(faster) and "faster than without" in verdict(faster)


def test_the_scores_sentence_names_a_fused_kernel_only_where_the_run_chose_one():
    """The explanation says the run's attention kernel never stores the s×s scores only when the
    measured label names a fused kernel (flash, memory-efficient, cuDNN); a T4's bf16 run follows the
    math kernel, which saves them, and gets no such sentence. Planted measurements: no run."""
    f = WI.whatif_formula()
    assert f.scores_bytes > 0
    cats = {"activations": f.activations // 2}

    def measured(kernels: str) -> WI.WhatIfMeasured:
        return WI.WhatIfMeasured({}, cats, 1, 1, f"fake tensors (H100; CUDA kernels of an H100 (sm90): {kernels})", 0.0)

    fused = WI.explain(f, measured("flash attention (saves the output and a float32 softmax statistic per row)"))
    math = WI.explain(f, measured("math attention (q, k, v upcast to float32 and the s×s attention weights saved)"))
    assert any("never stores" in line for line in fused)
    assert not any("never stores" in line for line in math)
    assert any("logits" in line for line in math)
