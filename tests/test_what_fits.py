"""``gpulab.predict.what_fits``: the recipes that fit when the asked one does not, each a fake run
replayed through the simulated allocator, cheapest first, stacked when none fits alone."""
from __future__ import annotations

import pytest

import gpulab
from gpulab import cli
from gpulab.measure.cuda_card import step_workspace_bytes
from gpulab.predict.replay import replay_events, tracked_events
from gpulab.predict.what_fits import CANDIDATES, what_fits

MODEL = dict(model="hf:tiny-gpt2", seq_len=256, batch=8, optimizer="adamw")


def _reserved(**kw) -> int:
    r = gpulab.step(MODEL["model"], batch=MODEL["batch"], seq_len=MODEL["seq_len"], engine="fake", **kw)
    return max(replay_events(tracked_events(r.measurement)).reserved)


def test_each_candidate_is_its_own_fake_run_and_the_cheapest_come_first():
    asked = _reserved(optimizer="adamw")
    ws = step_workspace_bytes(None)   # a card given in bytes: no compute capability, sm80's cuBLAS workspaces
    card = int(asked * 0.97) + ws     # the asked recipe misses by 3%; most single changes save more
    r = what_fits(MODEL["model"], card, batch=8, seq_len=256, optimizer="adamw", context_bytes=0)
    assert not r.asked_fits and r.asked_reserved_bytes == asked
    assert [t.name for t in r.tried[:len(CANDIDATES)]] == [c.name for c in CANDIDATES][:len(r.tried)]
    by_name = {t.name: t for t in r.tried}
    assert by_name["loss in 8 chunks"].reserved_bytes == _reserved(optimizer="adamw", chunked_loss=8)
    assert by_name["8-bit AdamW state (bitsandbytes)"].reserved_bytes == _reserved(optimizer="adamw8bit")
    for t in r.tried:
        assert t.saved_bytes == asked - t.reserved_bytes and t.fits == (t.reserved_bytes <= card - ws)
    assert "no compute capability known" in r.label     # the kernels its fake runs followed
    assert r.fitting and r.fitting[0].name == next(t.name for t in r.tried if t.fits)


def test_when_nothing_fits_alone_the_changes_are_stacked_until_they_do():
    asked = _reserved(optimizer="adamw")
    r = what_fits(MODEL["model"], int(asked * 0.55), batch=8, seq_len=256, optimizer="adamw", context_bytes=0)
    singles = r.tried[:len(CANDIDATES)]
    assert not any(t.fits for t in singles)
    stacks = r.tried[len(CANDIDATES):]
    assert stacks and all(" + " in t.name for t in stacks)
    assert [t.reserved_bytes for t in stacks] == sorted((t.reserved_bytes for t in stacks), reverse=True)


def test_an_image_model_gets_only_the_changes_that_apply():
    r = what_fits("mlp", 10 ** 6, batch=64, optimizer="sgd", context_bytes=0)
    names = {t.name.split(" + ")[0] for t in r.tried}
    assert "loss in 8 chunks" not in names and "LoRA rank 16" not in names
    assert "8-bit AdamW state (bitsandbytes)" not in names   # sgd has no Adam state to shrink


def test_unknown_options_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe option.*valid: .*accumulate"):
        what_fits("mlp", "2GiB", accumulat=2)   # 2 GiB: room for the measured CUDA context


def test_the_cli_lists_what_fits(capsys):
    assert cli.main(["fit", "hf:tiny-gpt2", "--gpu", "1MiB", "--context", "1KiB", "--seq-len", "64",
                     "--optimizer", "adamw", "--what-fits"]) == 0
    out = capsys.readouterr().out
    assert "what fits at batch 1" in out and "loss in 8 chunks" in out
