"""``gpulab fit --fastest --gpus N`` across recipes × layouts (predict.fastest_plans) and the time bound that
prunes pairs (predict.plan_bounds). The bound is checked against the roofline the time model costs, batch by
batch; the search against a brute-force enumeration (``gpulab.fit`` of every layout × recipe pair alone)."""
from __future__ import annotations

import json

import pytest

import gpulab
from gpulab import cli
from gpulab.command import answers
from gpulab.options import Layout, Recipe
from gpulab.predict.card_speeds import speed_of
from gpulab.predict.cards import as_card
from gpulab.predict.plan_bounds import slope_floor
from gpulab.predict.run_ops import RunOps
from gpulab.predict.timing import OpCost, cost_ops

RECIPE = Recipe(optimizer="adamw", dtype="bf16")
H100 = as_card("H100")


def _context(usable_mib: float) -> int:
    return (H100.reported_total_bytes - H100.workspace_bytes() - int(usable_mib * 2 ** 20)) // 1024 * 1024


def _ops(b: int, odd: bool = True) -> RunOps:
    """A step's ops at batch ``b``, by hand: a matmul (FLOPs ∝ b, its weight's bytes fixed), a pointwise op
    (bytes ∝ b), the optimizer (fixed), a tensor-parallel all-reduce (bytes ∝ b); ``odd``: and an op whose
    bytes' intercept is below 0 (its bytes a sample least at batch 1)."""
    h, s = 4096, 512
    ops = [OpCost("mm", "forward", 1, 2 * b * s * h * h, 2 * (h * h + 2 * b * s * h), "bf16"),
           OpCost("silu", "forward", 1, 0, 4 * b * s * h, ""),
           OpCost("_foreach_add_", "optimizer", 1, 0, 3 * 2 * h * h, ""),
           OpCost("all_reduce", "forward", 1, 0, 2 * b * s * h, "", kind="all_reduce", group=4)]
    return RunOps(tuple(ops + ([OpCost("cat", "backward", 1, 0, 2 * s * h * (3 * b - 2), "")] if odd else [])),
                  0, 0, 0)


def test_the_slope_floor_bounds_the_time_a_sample_at_every_batch_and_is_its_limit():
    speed = speed_of(H100)
    floor = slope_floor(_ops(2), _ops(3), speed)
    a = speed.assumptions
    # by hand: each op's per-sample FLOPs over the bf16 peak or bytes over the bandwidth, whichever is larger
    h, s, peak, bw = 4096, 512, speed.peak_flops("bf16") * a.compute_efficiency, speed.bandwidth_bytes_s * a.memory_efficiency
    link = speed.links.node_gbs * 1e9
    regular = max(2 * s * h * h / peak, 4 * s * h / bw) + 4 * s * h / bw + 2 * s * h * 2 * 3 / 4 / link
    assert floor == pytest.approx(regular + 2 * s * h / bw, rel=1e-9)   # cat: 2sh·(3b - 2) bytes, 2sh at batch 1
    per_sample = [cost_ops(list(_ops(b).ops), speed, b, "samples").seconds / b for b in (1, 2, 3, 8, 64, 4096)]
    assert all(t >= floor * (1 - 1e-12) for t in per_sample)
    assert slope_floor(_ops(2, False), _ops(3, False), speed) == pytest.approx(regular, rel=1e-9)
    big = cost_ops(list(_ops(10 ** 6, False).ops), speed, 1, "samples").seconds / 10 ** 6
    assert big == pytest.approx(regular, rel=1e-3)   # the bound is the limit: nothing looser
    assert slope_floor(_ops(2), RunOps(_ops(3).ops[:2], 0, 0, 0), speed) is None   # ops that do not pair: no bound


@pytest.mark.parametrize("args, says", [
    (["--fastest", "layout"], "give --gpus N"),
    (["--gpus", "4", "--fastest", "--what-fits"], "give one of them"),
    (["--gpus", "1", "--fastest"], "2 or more GPUs"),
])
def test_bad_fastest_plan_flags_are_one_line(capsys, args, says):
    assert cli.main(["fit", "hf:tiny-llama", "--gpu", "H100", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_bad_fastest_plan_arguments_are_one_line():
    from gpulab.predict.fastest_plans import fastest_plans
    for kw, says in (({"gpus": 1}, "2 or more GPUs"), ({"gpus": 4, "recipe": "adamw"}, "gpulab.Recipe")):
        with pytest.raises(ValueError, match=says) as e:
            fastest_plans("hf:tiny-llama", "H100", **kw)
        assert "\n" not in str(e.value)


@pytest.mark.extended   # every layout × recipe pair fit alone, a pipeline's among them: ~2 min on the shared 2-core machine
def test_the_fastest_plan_is_the_brute_force_fastest_and_pruning_drops_no_winner():
    from gpulab.predict.fastest_plans import fastest_plans, recipe_changes
    ctx = _context(3000)   # room for large batches: each plan's time a sample near its bound
    r = fastest_plans("hf:tiny-llama", "H100", 2, recipe=RECIPE, seq_len=64, tp=1, strategy="fsdp2", context_bytes=ctx)
    assert r.pairs == r.tried + len(r.pruned) and r.count("time") >= 1   # the pipeline's pairs cannot win
    w = gpulab.models.workload.resolve_workload("hf:tiny-llama", seq_len=64)
    changes, left = recipe_changes(RECIPE, w)
    assert any("LoRA" in why for why in left) and len(changes) == len(r.recipes) - 1
    brute = {}
    for lay in (Layout(gpus=2, strategy="fsdp2"), Layout(gpus=2, pp=2, microbatches=8)):   # independent enumeration
        for name, rec in [("the asked recipe", RECIPE)] + [(c.name, rc) for c, rc in changes]:
            try:
                f = gpulab.fit("hf:tiny-llama", "H100", recipe=rec, layout=lay, seq_len=64, context_bytes=ctx)
            except ValueError:   # a change the layout cannot take (the loss in chunks with pp): no plan
                continue
            brute[lay.pp, name] = f.time.items_per_s if f.time is not None else 0.0
    (pp, name), best = max(brute.items(), key=lambda kv: kv[1])
    assert r.fastest.time.items_per_s == pytest.approx(best, rel=1e-9)
    assert r.fastest.layout.pp == pp and (r.fastest.recipe or "the asked recipe") == name
    assert len(brute) == r.tried + r.count("time")   # every pair is run or pruned by time; the rest are refused
    for p in r.pruned:   # each pruned pair, fit alone, is no faster than the winner, and within its bound
        got = brute.get((2 if "pp 2" in p.layout else 1, p.recipe))
        assert (got is None) == (p.bound == "refused")
        if p.bound == "time":
            assert got <= r.fastest.time.items_per_s * (1 + 1e-9) and got <= p.rate * (1 + 1e-9)
    text = answers.fastest_layouts_text(json.loads(json.dumps(r.as_dict())))
    assert f"{r.pairs} layout × recipe pairs, {r.tried} run" in text and "pruned by time" in text
    assert f"fastest: {r.fastest.name}" in text and "recipe left out: LoRA rank 16" in text
