"""Lesson 11's claims: the verdicts follow the evidence."""
from __future__ import annotations

from gpulab.predict.serve import serve
from gpulab.course.transformer_claims import transformer_claims
from gpulab.course.transformer_activations import activation_vs_seq
from gpulab.course.transformer_memory import bytes_per_param_table, measured_bytes_per_param
from gpulab.course.transformer_params import counted_params


def test_claims_verdicts_are_computed():
    n, _ = counted_params("tiny-llama")
    pure = measured_bytes_per_param("tiny-llama", "pure-bf16", engine="fake", seq_len=16)
    sweep = activation_vs_seq("tiny-gpt2", seq_lens=(32, 64))
    # Qwen2.5-0.5B (1 GB of bf16 weights, 12 KiB of cache a token) at 8,192 tokens × 32: a 3 GiB cache
    short = serve("qwen2.5-0.5b", "T4", context_len=1024, batch=1)
    long = serve("qwen2.5-0.5b", "T4", context_len=8192, batch=32)
    report = transformer_claims(bytes_per_param_table(n), pure, sweep, long, layers=2, hidden=64, heads=4,
                                n_params=180_480)
    sixteen, dominate, kv, korthikanti = report.checks
    assert sixteen.holds and "8 B/param" in sixteen.evidence[-1].value
    assert dominate.verdict.startswith("holds beyond") and "tokens" in dominate.verdict
    assert kv.holds
    # the verdict on the card counts the prefill: one prompt at a time, and all at once
    rows = {e.what: e.value for e in kv.evidence}
    assert any(k.startswith("prefill of all 32") for k in rows) and "prefill of one prompt (peak)" in rows
    assert long.prefill_all_bytes > long.prefill_one_bytes > long.weights_bytes
    assert not transformer_claims(bytes_per_param_table(n), pure, sweep, short).checks[2].holds  # weights win
    assert korthikanti.verdict == "holds" or korthikanti.verdict.startswith("breaks by up to")
    assert "ref 002" in sixteen.source and "2205.05198" in korthikanti.source
