"""Lessons 07 and 11's panels made faster give the answers they gave (#47 item 9): the checkpointing
panel's memory guard predicts a peak once per N, width and batch. Latencies are the benchmark's
(``benchmarks/panel_latency.py``), never asserted here."""
from gpulab.course.checkpointing import checkpoint_sweep
from gpulab.widgets import checkpoint as C


def test_the_checkpoint_guards_prediction_made_once_equals_a_fresh_fake_run(monkeypatch):
    """``predict_checkpoint_peak``: the fake engine's k = 1 peak, equal to a fresh fake sweep's for two
    settings; asked again with only the segments, timed rounds or engine moved, it runs nothing."""
    C._fake_baseline_peak.cache_clear()
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return checkpoint_sweep(*args, **kwargs)
    monkeypatch.setattr(C, "checkpoint_sweep", counted)
    settings = {"n_blocks": 6, "width": 16, "batch": 8, "segments": "every k from 1 to N", "repeats": 3,
                "engine": "cpu"}
    first = C.predict_checkpoint_peak(settings)
    assert first == checkpoint_sweep(6, 16, 8, [1], "fake").baseline.peak_bytes > 6 * 16 * 8 * 4
    again = C.predict_checkpoint_peak(dict(settings, segments="divisors of N", repeats=5, engine="auto"))
    assert again == first and len(calls) == 1
    wider = C.predict_checkpoint_peak(dict(settings, width=32))
    assert wider == checkpoint_sweep(6, 32, 8, [1], "fake").baseline.peak_bytes > first and len(calls) == 2
