"""Lesson 14's course module (gpulab.course.capstone) against independent computations: the
decision table's savings against two separate ``gpulab.step`` runs, its batches against
``gpulab.fit``, its FLOPs against ``FlopCounterMode`` over a real training step written here, and
checkpointing's extra FLOPs against the blocks' own forward; bad input gives a ValueError that
says what to do."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gpulab
from gpulab.course.capstone import (LABEL_ACCUMULATION, LABEL_FLOPS, TECHNIQUES, available_techniques, decision_table,
                                    exercise_batch_gain, exercise_flops_ratio, step_flops, technique, your_model)
from gpulab.predict.fit import LABEL_FIT

MODEL, CARD, SEQ = "hf:tiny-gpt2", "2GiB", 128   # 2 GiB: room for the measured CUDA context (1.35 GiB)


@pytest.fixture(scope="module")
def table():
    you = your_model(MODEL, CARD, seq_len=SEQ)
    return decision_table(you, ("bf16 autocast", "checkpointing"), target_batch=1000)


def _step(batch: int, **options) -> int:
    """The peak of gpulab.step, called on its own (the public API, not the course module)."""
    return gpulab.step(MODEL, batch=batch, seq_len=SEQ, engine="fake", optimizer="adamw", use_cache=False,
                       gpu=CARD, **options).peak_bytes


def test_savings_equal_the_difference_of_two_separate_step_runs(table):
    assert table.you.base_options == {"use_cache": False}   # GPT2Config keeps use_cache=True; a step needs none
    b = table.batch
    base = _step(b)
    assert table.baseline.peak_bytes == base
    assert table.saved_bytes("bf16 autocast") == base - _step(b, amp="bf16")
    assert table.saved_bytes("checkpointing") == base - _step(b, checkpointing=True)
    assert table.saved_bytes("checkpointing") > 0


def test_the_fixed_batch_peak_follows_the_cards_kernels_as_the_fit_does():
    """bf16 attention on a T4 (sm75) runs the math kernel, in float32: the table's saving at the fixed
    batch must come from the T4's kernels, as its largest batch does, not from a fused kernel's."""
    from gpulab.course.capstone import measure_recipe
    you = your_model(MODEL, "T4", seq_len=SEQ)
    on_t4 = measure_recipe(you, 2, {"amp": "bf16"})
    assert on_t4.peak_bytes == gpulab.step(MODEL, batch=2, seq_len=SEQ, engine="fake", optimizer="adamw",
                                           use_cache=False, amp="bf16", gpu="T4").peak_bytes
    assert on_t4.peak_bytes != gpulab.step(MODEL, batch=2, seq_len=SEQ, engine="fake", optimizer="adamw",
                                           use_cache=False, amp="bf16").peak_bytes   # another kernel's plan


def test_largest_batches_are_gpulab_fits_and_the_fixed_batch_is_the_baselines(table):
    def fit(**options) -> int:
        return gpulab.fit(MODEL, CARD, seq_len=SEQ, optimizer="adamw", use_cache=False, **options).largest_batch
    base = fit()
    assert table.baseline.largest_batch == base == table.batch
    assert table.batch_gained("checkpointing") == fit(checkpointing=True) - base
    assert table.row("checkpointing").fit.label.startswith(LABEL_FIT + "; CUDA kernels of ")   # and names the card


def test_micro_batches_are_the_global_batch_over_the_largest(table):
    for r in table.rows:
        assert table.micro_batches(r.name) == math.ceil(1000 / r.largest_batch)
    assert [r.name for r in table.rows] == ["baseline", "bf16 autocast", "checkpointing",
                                            "bf16 autocast + checkpointing"]
    assert table.rows[-1].technique.options == {**TECHNIQUES["bf16 autocast"].options,
                                                **TECHNIQUES["checkpointing"].options}


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def test_flops_equal_flop_counter_mode_over_a_real_training_step():
    you = your_model(_MLP, "T4", input_shape=(32,))
    model, x = _MLP(), torch.randn(8, 32)
    with FlopCounterMode(display=False) as counter:   # a step as a student writes it, on real tensors
        nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
        torch.optim.AdamW(model.parameters()).step()
    assert step_flops(you, 8) == counter.get_total_flops()
    # forward 2·B·(32·64 + 64·10); backward: both gradients of the second layer, only the weight's of the first
    assert counter.get_total_flops() == 2 * 8 * (32 * 64 + 64 * 10) * 3 - 2 * 8 * 32 * 64


def test_checkpointing_pays_one_more_forward_of_the_blocks(table):
    """The extra FLOPs are the transformer blocks' forward, counted on a real model here (CPU,
    no grad): the head, the loss and the embeddings run once."""
    from gpulab.models.hf_configs import build_causal_lm, make_config
    model = build_causal_lm(make_config("tiny-gpt2"))
    ids = torch.randint(0, 1000, (table.batch, SEQ))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, use_cache=False)
    blocks = sum(v for name, ops in counter.get_flop_counts().items()
                 if name.count(".") == 3 and ".transformer.h." in name for v in ops.values())
    extra = table.row("checkpointing").flops_per_step - table.baseline.flops_per_step
    assert blocks > 0 and extra == blocks
    assert table.flops_ratio("bf16 autocast") == 1.0   # autocast changes the precision, not the count
    assert 1.0 < table.flops_ratio("checkpointing") < 4 / 3


def test_exercises_answer_from_the_table(table):
    gain = exercise_batch_gain(table, "bf16 autocast")
    ratio = table.row("bf16 autocast").largest_batch / table.baseline.largest_batch
    right = "a" if ratio <= 1 else "b" if ratio < 1.5 else "c" if ratio <= 2.5 else "d"
    assert gain.check(right).ok and gain.check(f" {right.upper()} ").ok
    assert not gain.check(next(k for k in "abcd" if k != right)).ok
    assert "gpulab.fit" in gain.reveal().message
    flops = exercise_flops_ratio(table, "checkpointing")
    assert flops.check(table.flops_ratio("checkpointing")).ok
    assert not flops.check(4 / 3).ok or abs(table.flops_ratio("checkpointing") - 4 / 3) < 0.04
    assert not flops.check(...).ok


def test_every_figure_is_labelled(table):
    html = table._repr_html_()
    for label in (LABEL_FIT, LABEL_FLOPS, LABEL_ACCUMULATION, table.baseline.label):
        assert label.replace("'", "&#x27;") in html
    assert "fake tensors" in table.baseline.label
    d = table.as_dict()
    assert d["labels"]["flops"] == LABEL_FLOPS and len(d["rows"]) == 4
    assert all(r.name in " ".join(table.sentences()) for r in table.rows[1:])
    assert "activations" in table.by_category()._repr_html_()
    assert table.figure() is not None


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="nn.Module class"):
        your_model(42, "T4")
    with pytest.raises(ValueError, match="24GiB"):
        your_model(_MLP, "T5")
    with pytest.raises(ValueError, match="card name or a size"):
        your_model(_MLP, 16)
    with pytest.raises(ValueError, match="pick one of bf16 autocast"):
        technique("magic")
    with pytest.raises(ValueError, match="keyword arguments of gpulab.fit"):
        technique(("mine", {"warp_speed": True}))
    you = your_model(_MLP, "T4", input_shape=(32,))
    with pytest.raises(ValueError, match="pick another technique"):
        decision_table(you, ["checkpointing"])
    with pytest.raises(ValueError, match="lora_targets"):
        decision_table(you, ["LoRA"])
    assert "no: " in available_techniques(you)._repr_html_()
    with pytest.raises(ValueError, match="image model: pick bf16 autocast"):
        decision_table(your_model("cnn", "T4"), ["bf16 autocast", "checkpointing"])


def test_your_own_module_with_lora_on_named_layers():
    you = your_model(_MLP, "T4", input_shape=(32,))
    t = decision_table(you, ["bf16 autocast", ("LoRA on body.0", {"lora": 4, "lora_targets": ["0"]})],
                       batch=8, combined=False)
    lora = t.row("LoRA on body.0")
    assert lora.trainable_params < t.baseline.trainable_params == sum(p.numel() for p in _MLP().parameters())
    assert lora.flops_per_step < t.baseline.flops_per_step   # no gradient for the frozen weight


def test_a_mistyped_card_is_one_line_in_the_notebook_with_did_you_mean(capsys):
    """Issue 47: lesson 14's CARD = "T5" printed a whole traceback naming the CLI's --gpu, with no
    "did you mean T4?". Now one line (LessonInputError's _render_traceback_), still a ValueError."""
    from IPython.core.interactiveshell import InteractiveShell
    from gpulab.course.capstone import LessonInputError
    with pytest.raises(ValueError) as info:
        your_model(_MLP, "T5")
    assert isinstance(info.value, LessonInputError)
    msg = str(info.value)
    assert "did you mean T4?" in msg and "--gpu" not in msg and "\n" not in msg
    shell = InteractiveShell.instance()
    shell.user_ns["_MLP"] = _MLP
    capsys.readouterr()
    res = shell.run_cell("from gpulab.course.capstone import your_model\nyou = your_model(_MLP, 'T5')")
    assert isinstance(res.error_in_exec, ValueError)
    shown = capsys.readouterr()
    lines = [ln for ln in (shown.out + shown.err).splitlines() if ln.strip()]
    assert lines == [f"ValueError: {msg}"]
    res = shell.run_cell("you = your_model(42, 'T4')")
    shown = capsys.readouterr()
    assert len([ln for ln in (shown.out + shown.err).splitlines() if ln.strip()]) == 1


def test_a_technique_that_changes_the_attention_kernel_says_so(table):
    """On a T4 (sm75) bf16 autocast gets SDPA's math kernel, which saves the s×s attention weights, where
    float32 got the memory-efficient one: its row adds memory. The table's sentence and the checker's
    explanation name both kernels, read off each row's gpulab.fit (its kernels line); a row whose kernel
    did not change gets no such sentence."""
    import dataclasses

    def with_kernels(row, attention):
        return dataclasses.replace(row, fit=dataclasses.replace(
            row.fit, kernels=f"CUDA kernels of a T4 (sm75): {attention}"))

    base, amp, rest = table.rows[0], table.row("bf16 autocast"), [r for r in table.rows[1:] if r.name != "bf16 autocast"]
    changed = dataclasses.replace(table, rows=[with_kernels(base, "memory-efficient attention (x)"),
                                               with_kernels(amp, "math attention (y)"),
                                               *[with_kernels(r, "memory-efficient attention (x)") for r in rest]])
    said = [s for s in changed.sentences() if s.startswith("bf16 autocast:")]
    assert len(said) == 1 and "math attention (y), not the baseline's memory-efficient attention (x)" in said[0]
    assert "math attention (y)" in exercise_batch_gain(changed, "bf16 autocast").reveal().message
    assert not any("attention kernel" in s for s in changed.sentences() if not s.startswith("bf16 autocast:"))
    same = dataclasses.replace(changed, rows=[with_kernels(r, "math attention (y)") for r in changed.rows])
    assert not any("attention kernel" in s for s in same.sentences())
