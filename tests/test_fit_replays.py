"""Issues 45 and 46, speed with the answers unchanged: each timeline ``fit`` and ``what_fits`` replay
through the simulated allocator is replayed once, and a batch the live tensors alone rule out is
not replayed at all (``predict.fit``: ``_Extrapolation.peak_at``, ``verdict``; ``predict.pipeline_fit``:
a stage's row reuses its search's replay). Counted, not timed: the replays made, against the same
answer with each reuse switched off; the figures compared with an allocator replayed here."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab.allocator.simulator import CachingAllocator
from gpulab.models import hf_configs
from gpulab.models.workload import resolve_workload
from gpulab.predict import fit as fit_module
from gpulab.predict import pipeline_fit, run_cache
from gpulab.training.loop import user_recipe

SEQ = 32


def _config(layers: int):
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 176
    cfg.num_hidden_layers, cfg.vocab_size = layers, 1024
    return cfg


@pytest.fixture
def replays(monkeypatch):
    """The capacities of the allocator replays ``fit`` makes (None: without a limit), with an empty run cache."""
    run_cache.clear()
    made: list[int | None] = []
    real = fit_module._replay

    def counted(t, capacity):
        made.append(capacity)
        return real(t, capacity)
    monkeypatch.setattr(fit_module, "_replay", counted)
    yield made
    run_cache.clear()


def _timeline(batch: int):
    w = resolve_workload(_config(4), seq_len=SEQ)
    return fit_module._tracked(w, None, batch, torch.bfloat16, user_recipe("adamw", None), ("cuda", "H100"))


def _replayed(t, capacity):
    r = CachingAllocator(capacity_bytes=capacity).replay(t.events, strict=False)
    return r.peak_reserved, bool(r.oom_events)


def test_the_extrapolations_live_peak_is_its_built_timelines():
    line = fit_module._Extrapolation.make(_timeline(2), _timeline(3), 2)
    assert line is not None
    for b in (2, 3, 5, 17, 1000):
        built = line.at(b)
        assert line.peak_at(b) == built.peak_bytes > 0
        assert line.nbytes_at(b) == [e.nbytes for e in built.events]


def test_what_fits_verdict_is_the_capacity_replay_then_the_unlimited_one(replays):
    t = _timeline(4)
    free, _ = _replayed(t, None)
    peak = t.peak_bytes
    assert peak < free
    for usable in (peak - 1, peak, (peak + free) // 2, free - 1, free, free + (1 << 20)):
        reserved, oom = _replayed(t, usable)
        fits = not oom and peak <= usable
        replays.clear()
        assert fit_module.verdict(t, usable) == ((reserved if fits else free), fits), usable
        # one replay where the live tensors alone pass the card or the replay without a limit stays within it
        assert len(replays) == (1 if peak > usable or free <= usable else 2), usable


def test_a_confirmed_batch_reuses_its_extrapolations_replay(replays, monkeypatch):
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0)
    reused = gpulab.fit(_config(4), "64MiB", **kw)
    made = len(replays)
    assert reused.largest_batch > 3 and "confirmed by a fake run" in reused.method
    run_cache.clear()
    replays.clear()
    monkeypatch.setattr(fit_module._Extrapolation, "same_events", lambda self, t, batch: False)
    replayed = gpulab.fit(_config(4), "64MiB", **kw)
    assert [c.__dict__ for c in reused.checks] == [c.__dict__ for c in replayed.checks]
    assert made == len(replays) - 1


def test_a_pipelines_rows_reuse_their_searches_replays(replays, monkeypatch):
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, pp=4, microbatches=8)
    reused = gpulab.fit(_config(8), "24MiB", **kw)
    made = len(replays)
    run_cache.clear()
    replays.clear()
    monkeypatch.setattr(pipeline_fit, "_reserved", lambda runs, t, read, batch, check: check(t, batch=batch).reserved_bytes)
    replayed = gpulab.fit(_config(8), "24MiB", **kw)
    assert [r.__dict__ for r in reused.ranks] == [r.__dict__ for r in replayed.ranks]
    assert made == len(replays) - sum(r.peak_bytes is not None for r in reused.ranks)   # no row replayed again
