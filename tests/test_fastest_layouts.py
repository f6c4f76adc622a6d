"""``gpulab fit --fastest layout --gpus N`` (predict.fastest, predict.layout_choices): the layouts of N GPUs for one
recipe, each answered as ``gpulab.fit`` answers it alone, ranked by predicted tokens/s; those left out say why.
Checked against ``gpulab.fit`` of each layout alone, the plan-time parts summed by hand, and the memory floor
against a fit that finds nothing fits."""
from __future__ import annotations

import json

import pytest

import gpulab
from gpulab import cli
from gpulab.command import answers
from gpulab.options import Layout, Recipe
from gpulab.predict.cards import as_card
from gpulab.predict.fastest import fastest_layouts

RECIPE = Recipe(optimizer="adamw", dtype="bf16")
H100 = as_card("H100")


def _context(usable_mib: float) -> int:
    """The CUDA context (whole KiB) that leaves ``usable_mib`` MiB (and < 1 KiB) of an H100 to the step's tensors."""
    return (H100.reported_total_bytes - H100.workspace_bytes() - int(usable_mib * 2 ** 20)) // 1024 * 1024


def test_layouts_ranked_by_tokens_per_s_agree_with_each_fit_alone():
    # 3 MiB for the step: tiny-llama's ddp replica does not fit at batch 1, its sharded layouts do
    ctx = _context(3)
    r = fastest_layouts("hf:tiny-llama", "H100", 4, recipe=RECIPE, seq_len=32, tp=1, pp=1, context_bytes=ctx)
    assert [p.name for p in r.plans] == ["ddp dp 4, tp 1, pp 1", "zero2 dp 4, tp 1, pp 1", "zero3 dp 4, tp 1, pp 1",
                                         "fsdp2 dp 4, tp 1, pp 1"]
    ddp = r.plans[0]
    assert not ddp.fits and ddp not in r.ranked          # cannot fit: tried, absent from the ranking
    assert len(r.ranked) == 3
    speeds = [p.time.items_per_s for p in r.ranked]
    assert speeds == sorted(speeds, reverse=True) and r.fastest is r.ranked[0]
    for p in r.ranked:   # each plan is what gpulab.fit answers for that layout alone
        alone = gpulab.fit("hf:tiny-llama", "H100", recipe=RECIPE, layout=p.layout, seq_len=32, context_bytes=ctx)
        assert alone.largest_batch == p.largest_batch and alone.reserved_bytes == p.reserved_bytes
        assert alone.time.seconds == pytest.approx(p.time.seconds, rel=1e-9)
        t = p.time   # the step is its parts; the tokens a step are batch × seq × dp
        assert t.seconds == pytest.approx(t.compute_s + t.optimizer_s + t.exposed_comm_s, rel=1e-9)
        assert t.items == p.largest_batch * 32 * 4 and t.items_per_s == pytest.approx(t.items / t.seconds)
    why = {s.what: s.why for s in r.skipped}
    assert "dominated by zero2" in why["zero1"] and "not timed" in why["context parallelism (cp > 1)"]
    d = r.as_dict()
    assert d["tried"] == len(r.plans) and d["fastest"]["name"] == r.fastest.name
    text = answers.fastest_layouts_text(json.loads(json.dumps(d)))   # the CLI's view of the same data
    assert "4 layouts tried, 3 fit" in text and f"fastest: {r.fastest.name}" in text
    assert "does not fit: ddp dp 4" in text and "zero1: dominated" in text and "overlap: ddp:" in text


def test_a_layout_below_its_memory_floor_is_left_out_and_truly_does_not_fit():
    ctx = _context(1.5)   # ddp's weights + gradients + AdamW state, 4 × 439,808 B, pass 1.5 MiB: left out unrun
    r = fastest_layouts("hf:tiny-llama", "H100", 4, recipe=RECIPE, seq_len=32, tp=1, pp=1, context_bytes=ctx)
    floor = next(s for s in r.skipped if s.what.startswith("ddp over dp 4"))
    assert "a floor" in floor.why and all(p.layout.strategy != "ddp" for p in r.plans)
    alone = gpulab.fit("hf:tiny-llama", "H100", recipe=RECIPE, layout=Layout(gpus=4, strategy="ddp"), seq_len=32,
                       context_bytes=ctx, predict_time=False)
    assert alone.largest_batch == 0   # the floor was honest: the fake run does not fit either


@pytest.mark.parametrize("args, says", [
    (["--gpus", "6", "--tp", "4"], "not a multiple of --tp 4"),
    (["--gpus", "1"], "2 or more GPUs"),
    (["--gpus", "4", "--what-fits"], "give one of them"),
    (["--gpus", "4", "--microbatches", "8"], "leave out --microbatches"),
])
def test_bad_fastest_layout_flags_are_one_line(capsys, args, says):
    assert cli.main(["fit", "hf:tiny-llama", "--gpu", "H100", "--fastest", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.extended   # a pipeline's stage searches: ~9 s on the shared 2-core machine
def test_the_cli_answers_a_pipeline_layout_with_its_bubble(capsys):
    # --pp 2 on 2 GPUs fixes the mesh: one layout (dp 1, 1F1B, 8 micro-batches); tp 2 cannot join it
    argv = ["fit", "hf:tiny-llama", "--gpu", "H100", "--gpus", "2", "--pp", "2", "--seq-len", "32", "--dtype", "bf16",
            "--optimizer", "adamw", "--fastest", "layout", "--context", f"{_context(3) // 1024}KiB", "--quiet"]
    assert cli.main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (p,) = d["plans"]
    t = p["time"]
    assert p["mesh_dims"]["pp"] == 2 and p["microbatches"] == 8 and d["ranked"] == [p["name"]]
    assert t["bubble_seconds"] == pytest.approx(t["compute_seconds"] * (2 - 1) / 8, rel=1e-9)   # 1F1B: (p - 1)/m
    assert t["items"] == p["largest_batch"] * 32 * 8
    assert any(s["what"].startswith("dp 1, tp 2") or "tp 2" in s["what"] for s in d["skipped"])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 layouts tried" in out and "fastest: " in out and "left out:" in out and "zero1: dominated" in out
    assert "pipeline bubble" in out and "overlap: ddp:" in out


@pytest.mark.extended   # the fake process group's tensor-parallel runs: ~1 min on the shared 2-core machine
def test_tensor_parallel_layouts_are_tried_within_a_node_and_cost_their_collectives():
    r = fastest_layouts("hf:tiny-llama", "H100", 4, recipe=RECIPE, seq_len=32, pp=1, strategy="fsdp2")
    tps = {p.layout.tp for p in r.plans}
    assert 2 in tps and 1 in tps
    for p in r.ranked:
        assert (p.time.rank.comm_s > 0) == (p.layout.tp > 1)   # TP's collectives, on the critical path
        alone = gpulab.fit("hf:tiny-llama", "H100", recipe=RECIPE, layout=p.layout, seq_len=32)
        assert alone.time.seconds == pytest.approx(p.time.seconds, rel=1e-9)
