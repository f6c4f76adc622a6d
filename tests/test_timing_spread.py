"""Issue 47, item 8: timings show their spread and refuse a conclusion the noise does not support.
``course.timing_spread`` on planted samples (a shared machine's timings are never asserted), and the
lesson 04 / 07 texts built on it: a direction is stated only when the span excludes ×1."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpulab.course.timing_spread import NO_CONCLUSION, band, ratio, spread
from gpulab.record.runs.checkpoint import Timing


def _t(*ms: float) -> Timing:
    return Timing([m / 1e3 for m in ms], 1, "planted")


def test_the_span_is_the_bands_extremes_and_holds_one_exactly_when_the_bands_overlap():
    a, b = _t(10, 11, 12), _t(13, 14, 15)
    r = ratio(b, a)
    # by hand: fastest over fastest 13/10; lowest 13/12, highest 15/10
    assert (r.value, r.low, r.high) == pytest.approx((1.3, 13 / 12, 1.5))
    assert not r.within_noise and NO_CONCLUSION not in r.text() and r.text() == "×1.30 [×1.08–×1.50]"
    near = ratio(_t(11.5, 12.5, 13), a)          # 11.5–13 against 10–12: they overlap
    assert near.low < 1 < near.high and near.within_noise and near.text().endswith(NO_CONCLUSION)
    touching = ratio(_t(12, 13), a)              # 12 is both bands' edge: not told apart
    assert touching.within_noise
    faster = ratio(a, b)
    assert faster.high < 1 and not faster.within_noise


def test_the_iqr_band_compares_medians_and_ignores_one_outlier_the_range_keeps():
    a, b = _t(10, 10, 11, 11, 30), _t(14, 15, 15, 16, 16)
    assert band(a, "iqr") == (0.010, 0.011) and band(a, "range") == (0.010, 0.030)
    assert not ratio(b, a, "iqr").within_noise and ratio(b, a, "range").within_noise
    assert ratio(b, a, "iqr").value == pytest.approx(15 / 11)
    assert spread(a, "iqr") == "11.0 ms [10.0–11.0]" and spread(a) == "10.0 ms [10.0–30.0]"
    with pytest.raises(ValueError, match="band must be one of range, iqr"):
        band(a, "stdev")


def _throughput(times: list[tuple[float, ...]], batches=(1, 4, 16)):
    """Lesson 04's BatchThroughput with planted step times; predictions stand in (100 items/s at batch 1,
    growing with the batch) and the card is the H100's datasheet."""
    from gpulab.course.step_time import BatchPoint, BatchThroughput
    from gpulab.predict.card_speeds import speed_of
    pts = []
    for b, ms in zip(batches, times):
        pred = SimpleNamespace(items_per_s=100.0 * b ** 0.5, unit="samples", flops=1e6, by_op={}, label="p")
        pts.append(BatchPoint(b, _t(*ms), pred, pred, 1000 * b))
    h100 = speed_of("H100")
    return BatchThroughput("planted", "H100", h100, h100, pts)


def test_lesson_04s_sentences_state_a_direction_only_outside_the_noise():
    # batch 4 -> 16 takes 4 times as long with these spreads: the last step's gain spans ×1
    noisy = _throughput([(10, 11, 12), (20, 22, 30), (80, 88, 100)])
    whole, last = noisy.sentences()[:2]
    g = noisy.measured_gain()
    assert (g.value, g.low, g.high) == pytest.approx((16 * 10 / 80, 16 * 10 / 100, 16 * 12 / 80))
    assert "grew ×2.0 [×1.6–×2.4], short of proportional" in whole
    assert NO_CONCLUSION in last and "gained" not in last and "lost" not in last
    clear = _throughput([(10, 10.5), (20, 21), (40, 41)])
    whole, last = clear.sentences()[:2]
    assert NO_CONCLUSION not in whole + last and "gained ×2.00 [×1.95–×2.10] in throughput" in last
    flat = _throughput([(10, 14), (40, 56), (120, 200)])
    assert "changed ×1.3" in flat.sentences()[0] and NO_CONCLUSION in flat.sentences()[0]


def test_lesson_04s_loader_table_marks_an_overlap_as_no_conclusion():
    from gpulab.course.data_loading import LoaderTimes
    r = LoaderTimes(8, 2, 0.001, "cpu", False, {"num_workers=0": _t(100, 110), "num_workers=2": _t(60, 70),
                                                "pin": _t(95, 120)})
    rows = {row[0]: row for row in r.rows()}
    assert rows["num_workers=2"][2] == "×1.67 [×1.43–×1.83]" and rows["num_workers=2"][3] == "apart"
    assert rows["pin"][2].endswith(NO_CONCLUSION) and rows["pin"][3] == "overlap"


def test_lesson_07s_recompute_table_and_conclusion_say_no_conclusion_inside_the_noise():
    from gpulab.course.step_time import RecomputePoint, RecomputeTime
    t0, t1 = SimpleNamespace(seconds=0.010, flops=1), SimpleNamespace(seconds=0.013, flops=1)

    def planted(a, b):
        return RecomputeTime(4, 8, 2, None, "H100", [RecomputePoint(1, t0, t0, 0, _t(*a)),
                                                     RecomputePoint(4, t1, t1, 0, _t(*b))])
    close = planted((10, 13), (12, 14))
    assert NO_CONCLUSION in close.conclusion(4) and close.rows()[1][5].endswith(NO_CONCLUSION)
    apart = planted((10, 11), (12, 13))
    assert NO_CONCLUSION not in apart.conclusion(4) and "allow ×1.09–×1.30" in apart.conclusion(4)
    assert apart.rows()[1][5] == "×1.20 [×1.09–×1.30]" and apart.rows()[0][5] == "—"
