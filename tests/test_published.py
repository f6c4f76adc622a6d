"""``benchmarks/published.py``: published real-GPU figures beside gpulab's predictions. The whole
table takes minutes (run the script); here, its shape and its fastest rows."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"


def _module():
    spec = importlib.util.spec_from_file_location("published", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_at_least_twelve_rows_from_four_publishers_each_quoted_and_explained():
    p = _module()
    assert len(p.ROWS) >= 12 and len({s.org for s in p.SOURCES.values()}) >= 4
    for s in p.SOURCES.values():
        lo, hi = s.tolerance
        assert 0.8 <= lo < 1 < hi <= 1.2 and len(s.why) > 100 and s.gpu and s.metric and s.where
    for r in p.ROWS:
        assert r.source in p.SOURCES
        shown = f"{r.published:.2f}".rstrip("0").rstrip(".") if r.published % 1 else f"{int(r.published)}"
        assert shown in r.quote, (r.name, shown, r.quote)   # the figure is the quoted text's


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B-Instruct, input 1", "Llama 2 7B inference, bf16"])
def test_the_fastest_rows_land_inside_their_tolerance(name):
    p = _module()
    row = next(r for r in p.ROWS if r.name == name)
    source = p.SOURCES[row.source]
    predicted, how = row.predict()
    ratio = predicted / (row.published * source.unit)
    assert source.tolerance[0] <= ratio <= source.tolerance[1], (ratio, how)


def test_a_lesson_shows_one_row_beside_its_prediction_with_both_labels():
    from gpulab.record.published import published_check
    c = published_check("Qwen2.5-0.5B-Instruct, input 1")
    lo, hi = c.source.tolerance
    assert c.within_tolerance == (lo <= c.predicted_bytes / (0.97 * 2 ** 30) <= hi)
    html = c._repr_html_()
    assert "published by Alibaba (Qwen), measured on NVIDIA A100 80GB" in html and "fake generation" in html
    assert c.as_dict()["published_bytes"] == 0.97 * 2 ** 30


def test_an_unknown_row_names_the_ones_there_are():
    from gpulab.record.published import published_check
    with pytest.raises(ValueError, match="no published figure called 'nope'; there are: vanilla, batch 4"):
        published_check("nope")


def test_time_rows_quote_their_figure_and_the_bus_bandwidth_rows_follow_nccl_tests_formula():
    p = _module()
    for r in p.TIME_ROWS:   # the figure is the quoted text's, in its unit
        shown = f"{r.published:,.1f}".rstrip("0").rstrip(".")
        assert shown in r.quote.replace("GB/s", ""), (r.name, shown, r.quote)
    from gpulab.predict.card_speeds import CARD_SPEEDS
    link = CARD_SPEEDS["H100"].links.nvlink_gbs
    for r in (r for r in p.TIME_ROWS if r.unit == "GB/s bus bandwidth"):
        # nccl-tests: busbw = algbw x factor, and gpulab's collective time is S x factor / link: busbw = link
        predicted, how = r.predict()
        assert abs(predicted - link) < 1e-6 * link and "busbw = S x" in how
