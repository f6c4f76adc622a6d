"""Lesson 11: the reference articles' claims about transformers, with verdicts computed from the
lesson's formulas and measurements (``course.claims``)."""
from __future__ import annotations

import math

from gpulab.measure.engines import LABEL_FORMULA
from gpulab.predict.serve import ServeResult
from gpulab.units import format_bytes
from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.course.transformer_activations import ActivationSweep
from gpulab.course.transformer_memory import BytesPerParamRow

__all__ = ["TOLERANCE_PERCENT", "transformer_claims"]

TOLERANCE_PERCENT = 10.0   # "the formula predicts the measurement" within this


def transformer_claims(table: list[BytesPerParamRow], pure_bf16: BytesPerParamRow, sweep: ActivationSweep,
                       serving: ServeResult, layers: int = 12, hidden: int = 768, heads: int = 12,
                       n_params: int = 124_439_808) -> ClaimReport:
    """Four claims: 16 bytes per parameter for mixed-precision Adam; activations dominate at long
    sequences (GPT-2's shape: ``layers``, ``hidden``, ``heads``, ``n_params``); the KV cache, not
    the weights, limits long-context serving (``serving``: ``gpulab.predict.serve``'s answer, whose
    prefill peaks are part of the verdict); Korthikanti's formula against the measurement."""
    checks = [_sixteen_bytes(table, pure_bf16), _activations_dominate(sweep, layers, hidden, heads, n_params),
              _kv_limits(serving), _korthikanti(sweep)]
    return ClaimReport("Transformers: the claims, tested", checks)


def _sixteen_bytes(table: list[BytesPerParamRow], pure: BytesPerParamRow) -> ClaimCheck:
    rows = {r.recipe: r for r in table}
    zero, auto = rows["zero-mixed"], rows["autocast"]
    ok = zero.total == 16 and auto.total == 16
    ev = [Evidence(zero.name, f"{zero.total:g} B/param", LABEL_FORMULA),
          Evidence(auto.name, f"{auto.total:g} B/param", LABEL_FORMULA),
          Evidence(f"{pure.name}, {pure.model} (weights + gradients + optimizer state)", f"{pure.total:.4g} B/param",
                   pure.label)]
    why = (f"Both mixed-precision layouts keep {zero.total:g} bytes per parameter of model state (ZeRO's fp16 copies "
           f"plus an fp32 master, or autocast's fp32 weights); pure bf16 training measures {pure.total:.4g}.")
    return ClaimCheck("Mixed-precision training with Adam needs 16 bytes per parameter.",
                      "ref 002; ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054)", HOLDS if ok else BREAKS, why, ev)


def _activations_dominate(sweep: ActivationSweep, layers: int, hidden: int, heads: int,
                          n_params: int) -> ClaimCheck:
    states = 16 * n_params   # fp32 Adam's model state, the other side of the comparison
    # the sequence length where all layers' activations (formula, batch 1) pass the model state:
    # L·s·h·(34 + 5·a·s/h) = states, a quadratic in s
    a2, a1 = layers * 5 * heads, layers * 34 * hidden
    cross = math.ceil((-a1 + math.sqrt(a1 * a1 + 4 * a2 * states)) / (2 * a2))
    ev = [Evidence("model state (16 B/param)", format_bytes(states), LABEL_FORMULA),
          Evidence("sequence length where activations (all layers, batch 1) pass it", f"{cross:,} tokens",
                   LABEL_FORMULA)]
    for r in sweep.rows:
        ev.append(Evidence(f"activations at s = {r.seq_len}, all {layers} layers, eager", format_bytes(
            int(r.measured_eager * layers)), r.label))
    longest = max(sweep.rows, key=lambda r: r.seq_len)
    measured_dominates = longest.measured_eager * layers > states
    verdict = f"holds beyond {cross:,} tokens at batch 1, breaks below"
    why = (f"Weights, gradients and Adam state are fixed at {format_bytes(states)}; the activations grow with s·b and "
           f"the scores with s²·b. At batch 1 they pass the model state from about {cross:,} tokens (formula); "
           f"at {longest.seq_len} tokens they are "
           f"{'above' if measured_dominates else 'below'} it (measured). A larger batch moves the crossing down.")
    return ClaimCheck("At long sequence lengths, activations dominate training memory.",
                      "Korthikanti et al. 2022 (arXiv 2205.05198)", verdict, why, ev)


def _kv_limits(fit: ServeResult) -> ClaimCheck:
    ok = fit.kv_cache_bytes > fit.weights_bytes
    usable = format_bytes(fit.usable_bytes)

    def verdict(needed: int) -> str:
        m = format_bytes(abs(fit.usable_bytes - needed))
        return f"{format_bytes(needed)} of {usable}: " + (f"fits, {m} to spare" if needed <= fit.usable_bytes
                                                            else f"does not fit, {m} over")
    ev = [Evidence("weights", format_bytes(fit.weights_bytes), fit.label),
          Evidence(f"KV cache, {fit.context_len:,} tokens × batch {fit.batch}", format_bytes(fit.kv_cache_bytes),
                   fit.kv_label),
          Evidence("prefill of one prompt (peak)", format_bytes(fit.prefill_one_bytes), fit.label),
          Evidence(f"prefill of all {fit.batch} prompts at once (peak)", format_bytes(fit.prefill_all_bytes),
                   fit.label),
          Evidence(f"on {fit.card}, prompts prefilled one at a time", verdict(fit.needed_one_at_a_time_bytes),
                   "the larger of the decode step and one prefill beside the others' caches"),
          Evidence(f"on {fit.card}, all prompts prefilled at once", verdict(fit.needed_all_at_once_bytes),
                   "the larger of the decode step and the whole batch's prefill")]
    why = (f"{fit.model} at {fit.context_len:,} tokens and batch {fit.batch}: the cache is "
           f"{fit.kv_cache_bytes / fit.weights_bytes:.2f}× the weights. Whether it fits depends on the prefill too: "
           f"the prompt's pass through the model holds its activations on top of the caches already there.")
    return ClaimCheck("At long context, the KV cache, not the weights, limits serving.",
                      "Kwon et al. 2023, PagedAttention / vLLM (arXiv 2309.06180)", HOLDS if ok else BREAKS, why, ev)


def _korthikanti(sweep: ActivationSweep) -> ClaimCheck:
    errs = [(r.seq_len, r.eager_error_percent) for r in sweep.rows]
    worst = max(errs, key=lambda t: abs(t[1] or 0))
    ok = all(e is not None and abs(e) <= TOLERANCE_PERCENT for _, e in errs)
    ev = [Evidence(f"s = {r.seq_len}: formula vs eager", f"{format_bytes(r.formula)} vs "
                   f"{format_bytes(int(r.measured_eager))}", r.label) for r in sweep.rows]
    verdict = HOLDS if ok else f"breaks by up to {abs(worst[1]):.0f}% on {sweep.model}"
    why = ("Formula errors against the measurement: " + ", ".join(f"s={s}: {e:+.1f}%" for s, e in errs)
           + ". The formula counts GPT-3's layer; the measured model saves what its own ops save (see the "
             "differences listed above), so the gap is the model's, storage by storage.")
    s = sweep.rows[0]
    ev.append(Evidence(f"the formula's s² term at s = {s.seq_len} vs eager − sdpa measured",
                       f"{format_bytes(s.scores_formula)} vs {format_bytes(int(s.scores_measured))}", s.label))
    return ClaimCheck("A layer stores s·b·h·(34 + 5·a·s/h) bytes of 16-bit activations.",
                      "Korthikanti et al. 2022 (arXiv 2205.05198)", verdict, why, ev)
