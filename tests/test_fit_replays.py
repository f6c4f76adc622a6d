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
    """The allocator replays ``fit`` makes, each as (its capacity, None without a limit; what it reads of
    the timeline: each event's kind, storage and bytes), with an empty run cache."""
    run_cache.clear()
    made: list[tuple] = []
    real = fit_module._replay

    def counted(t, capacity):
        made.append((capacity, tuple((e.kind, e.sid, e.nbytes) for e in t.events)))
        return real(t, capacity)
    monkeypatch.setattr(fit_module, "_replay", counted)
    yield made
    run_cache.clear()


@pytest.fixture(scope="module")
def timelines():
    """A 4-layer Llama's fake runs at batches 2 and 3 (bf16 AdamW, an H100's kernels)."""
    w = resolve_workload(_config(4), seq_len=SEQ)
    return {b: fit_module._tracked(w, None, b, torch.bfloat16, user_recipe("adamw", None), ("cuda", "H100"))
            for b in (2, 3)}


def _replayed(t, capacity):
    r = CachingAllocator(capacity_bytes=capacity).replay(t.events, strict=False)
    return r.peak_reserved, bool(r.oom_events)


def test_the_extrapolations_live_peak_is_its_built_timelines(timelines):
    line = fit_module._Extrapolation.make(timelines[2], timelines[3], 2)
    assert line is not None
    for b in (2, 3, 5, 17, 1000):
        built = line.at(b)
        assert line.peak_at(b) == built.peak_bytes > 0
        assert line.nbytes_at(b) == [e.nbytes for e in built.events]


def test_what_fits_verdict_is_the_capacity_replay_then_the_unlimited_one(replays, timelines):
    t = timelines[3]
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
    made = list(replays)
    assert reused.largest_batch > 3 and "confirmed by a fake run" in reused.method
    assert len(set(made)) == len(made)   # each timeline replayed once
    replays.clear()   # the same fit again, its fake runs kept (run_cache): only its replays are made again
    monkeypatch.setattr(fit_module._Extrapolation, "same_events", lambda self, t, batch: False)
    replayed = gpulab.fit(_config(4), "64MiB", **kw)
    assert [c.__dict__ for c in reused.checks] == [c.__dict__ for c in replayed.checks]
    # without the reuse: batch 3 replayed as run and as the line, the answer's batch as line and as run
    assert set(replays) == set(made) and len(replays) == len(made) + 2


@pytest.mark.extended   # ~14 s on the shared 2-core machine under load: two pipeline fits (the second's runs kept)
def test_a_pipelines_rows_reuse_their_searches_replays(replays, monkeypatch):
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, pp=2, microbatches=4)
    reused = gpulab.fit(_config(4), "24MiB", **kw)
    made = list(replays)
    assert len(set(made)) == len(made)   # each timeline replayed once, the rows' included
    replays.clear()   # the same fit again, its fake runs kept (run_cache): only its replays are made again
    monkeypatch.setattr(pipeline_fit, "_reserved", lambda runs, t, read, batch, check: check(t, batch=batch).reserved_bytes)
    replayed = gpulab.fit(_config(4), "24MiB", **kw)
    assert [r.__dict__ for r in reused.ranks] == [r.__dict__ for r in replayed.ranks]
    # the same replays, the rows' own made again where their search had made them (here stage 1's, at its own batch)
    assert set(replays) == set(made) and len(replays) > len(made)


def test_the_lean_replay_gives_the_replays_peak_and_failures(timelines):
    """``CachingAllocator.replay_peak`` (what fit's checks read) against ``replay``'s own peak reserved and
    failed allocations, without a limit and with limits that make allocations fail (the cache released,
    then out of memory) or sit just at the peak."""
    failed = 0
    for t in timelines.values():
        whole = CachingAllocator().replay(t.events, strict=False)
        for capacity in (None, whole.peak_reserved, whole.peak_reserved - 1, t.peak_bytes, whole.peak_reserved // 2):
            r = CachingAllocator(capacity_bytes=capacity).replay(t.events, strict=False)
            assert CachingAllocator(capacity_bytes=capacity).replay_peak(t.events) == (r.peak_reserved,
                                                                                       len(r.oom_events))
            failed += len(r.oom_events)
    assert failed > 0
