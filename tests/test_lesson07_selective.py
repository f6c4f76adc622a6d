"""Lesson 07, selective checkpointing of a transformer block: formulas against the tracker."""
import pytest
import torch

from gpulab.course import selective_checkpointing as C


@pytest.fixture(scope="module")
def cpu_result():
    return C.selective_checkpoint(batch=2, seq=64, width=64, heads=4, layers=2, engine="cpu", time_steps=False)


def test_selective_saves_less_than_none_and_more_than_full(cpu_result):
    r = cpu_result
    none, block, core = (r.point(m) for m in ("none", "block", "attention core"))
    assert block.saved_bytes < core.saved_bytes < none.saved_bytes
    assert block.peak_bytes < core.peak_bytes < none.peak_bytes


@pytest.mark.parametrize("engine", ["cpu", "fake"])
def test_saved_attention_bytes_equal_the_formula_exactly(engine):
    r = C.selective_checkpoint(batch=2, seq=96, width=64, heads=4, layers=2, engine=engine, time_steps=False)
    assert r.attention_measured == r.attention_formula == 2 * C.attention_saved_bytes(2, 96, 4)
    assert C.attention_saved_bytes(2, 96, 4) == 2 * 4 * 96 * 96 * 4
    for p in r.points:  # every mode's saved activations, op by op
        assert p.saved_bytes == p.predicted_saved, p.mode


def test_fake_equals_cpu(cpu_result):
    fake = C.selective_checkpoint(batch=2, seq=64, width=64, heads=4, layers=2, engine="fake", time_steps=False)
    assert [p.saved_bytes for p in fake.points] == [p.saved_bytes for p in cpu_result.points]
    assert [p.peak_bytes for p in fake.points] == [p.peak_bytes for p in cpu_result.points]
    assert "fake" in fake.label and "CPU" in cpu_result.label


def test_attention_share_grows_with_seq():
    share = []
    for s in (64, 256):
        r = C.selective_checkpoint(batch=1, seq=s, width=64, heads=4, layers=1, engine="fake", time_steps=False)
        share.append(r.attention_measured / r.point("none").saved_bytes)
    assert share[1] > 2 * share[0]


def test_checkpointed_blocks_give_the_same_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    grads = {}
    for mode in C.SELECTIVE_MODES:
        torch.manual_seed(1)
        blk = C.TransformerBlock(32, 4, 4, mode)
        blk(x).pow(2).sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in blk.parameters()])
    for mode in C.SELECTIVE_MODES[1:]:
        torch.testing.assert_close(grads[mode], grads["none"])


def test_exercise_answer_comes_from_the_measurement(cpu_result):
    ex = C.exercise_selective(cpu_result)
    assert cpu_result.best_per_flop == "attention core"  # heads/d = 1/16 B per FLOP beats 2/d and the block
    assert ex.check("b").ok and not ex.check("a").ok and not ex.check(...).ok
    assert "measured on CPU" in ex.reveal().message


def test_timed_run_labels_its_times():
    r = C.selective_checkpoint(batch=1, seq=32, width=32, heads=2, layers=1, engine="cpu", repeats=1)
    assert all(p.timing is not None for p in r.points) and "timed on this CPU" in r.timing_label
    assert r.time_ratio("none") == 1.0
    html = r._repr_html_()
    assert "formula" in html and "measured on CPU" in html and "+0.0%" in html
    fake = C.selective_checkpoint(batch=1, seq=32, width=32, heads=2, layers=1, engine="fake")
    assert fake.time_ratio("block") is None and "not timed" in fake.timing_label
    fake.figure()


def test_bad_arguments():
    with pytest.raises(ValueError):
        C.TransformerBlock(30, 4)
    with pytest.raises(ValueError):
        C.TransformerBlock(32, 4, checkpoint="everything")
    with pytest.raises(ValueError):
        C.selective_checkpoint(seq=0, engine="fake")
