"""Lesson 11's claims: the verdicts follow the evidence."""
from __future__ import annotations

from gpulab.course.kv_cache import inference_fit
from gpulab.course.transformer_claims import transformer_claims
from gpulab.course.transformer_memory import (activation_vs_seq, bytes_per_param_table, counted_params,
                                              measured_bytes_per_param)


def test_claims_verdicts_are_computed():
    n, _ = counted_params("tiny-llama")
    pure = measured_bytes_per_param("tiny-llama", "pure-bf16", engine="fake", seq_len=16)
    sweep = activation_vs_seq("tiny-gpt2", seq_lens=(32, 64))
    short = inference_fit("llama-3-8b", "H100", 1024, batch=1)
    long = inference_fit("llama-3-8b", "H100", 32768, batch=8)
    report = transformer_claims(bytes_per_param_table(n), pure, sweep, long, layers=2, hidden=64, heads=4,
                                n_params=180_480)
    sixteen, dominate, kv, korthikanti = report.checks
    assert sixteen.holds and "8 B/param" in sixteen.evidence[-1].value
    assert dominate.verdict.startswith("holds beyond") and "tokens" in dominate.verdict
    assert kv.holds
    assert not transformer_claims(bytes_per_param_table(n), pure, sweep, short).checks[2].holds  # weights win
    assert korthikanti.verdict == "holds" or korthikanti.verdict.startswith("breaks by up to")
    assert "ref 002" in sixteen.source and "2205.05198" in korthikanti.source
