"""The public ``Recipe`` and ``Layout`` (``gpulab.options``): printable, comparable, checked once
without torch, passed whole to ``gpulab.fit`` / ``gpulab.step`` and the command, carried by the answers."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import gpulab
from gpulab import Layout, Recipe


def test_repr_shows_what_is_set_and_eq_compares_values():
    r = Recipe(optimizer="adamw", dtype="bf16", checkpointing="selective")
    assert repr(r) == "Recipe(optimizer='adamw', dtype='bfloat16', checkpointing='selective')"
    assert repr(Recipe()) == "Recipe()" and repr(Layout()) == "Layout()"
    assert r == Recipe(optimizer="AdamW", dtype="bfloat16", checkpointing="selective")   # normalized when made
    assert r != Recipe(optimizer="adamw") and hash(r) == hash(Recipe("adamw", dtype="bf16", checkpointing="selective"))
    lay = Layout(gpus=64, strategy="fsdp2", tp=8, pp=4)
    assert repr(lay) == "Layout(gpus=64, strategy='fsdp2', tp=8, pp=4, microbatches=4)"   # a pipeline's default
    assert lay.dp == 2 and Layout().dp == 1 and Layout(gpus=8, tp=2, cp=2).dp == 2
    assert dataclasses.asdict(Layout(tp=2))["tp"] == 2 and dataclasses.asdict(r)["dtype"] == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.lora = 8


@pytest.mark.parametrize("make, words", [
    (lambda: Recipe(optimizer="adamm"), "unknown optimizer"),
    (lambda: Recipe(lora_dropout=float("nan")), "lora_dropout must be a probability"),
    (lambda: Recipe(quantize="nf4"), "add lora=RANK"),
    (lambda: Recipe(grad_scaler=True), "add amp='fp16'"),
    (lambda: Recipe(dtype="int8"), "unknown dtype"),
    (lambda: Recipe(routing="capacity:0"), "capacity factor F > 0"),
    (lambda: Layout(sequence_parallel=True), "give --tp 2 or more"),
    (lambda: Layout(pp=2, microbatches=2000), "microbatches must be a whole number from 1 to 1024"),
    (lambda: Layout(strategy="zero4"), "unknown strategy"),
    (lambda: Layout(gpus=0), "gpus must be a whole number"),
    (lambda: Layout(gpus=4, strategy="fsdp2", dp_shard=3), "gpus=4 is not dp_replicate × dp_shard × cp × tp × pp"),
])
def test_bad_values_are_refused_when_made(make, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        make()


def test_the_names_match_their_torch_side_sources():
    from gpulab import options
    from gpulab.models.quantized import COMPUTE_DTYPES
    from gpulab.predict.sharding import STRATEGIES
    from gpulab.training.loop import AMP_DTYPES
    from gpulab.training.optimizers import IMPL_FLAGS
    assert tuple(STRATEGIES) == options.STRATEGY_NAMES and tuple(IMPL_FLAGS) == options.IMPLEMENTATION_NAMES
    assert tuple(COMPUTE_DTYPES) == options.COMPUTE_DTYPE_NAMES and tuple(AMP_DTYPES) == options.AMP_NAMES


def test_building_them_needs_no_torch():
    code = ("import sys; from gpulab.options import Recipe, Layout, settings_from; "
            "settings_from(Recipe(optimizer='adamw', lora=8, quantize='nf4'), Layout(gpus=8, strategy='zero3', cp=2), "
            "{'dtype': None}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_fit_with_objects_equals_fit_with_keywords_and_carries_them():
    recipe, layout = Recipe(optimizer="adamw", dtype="bf16", accumulate=2), Layout(tp=2)
    a = gpulab.fit("hf:tiny-llama", "4GiB", recipe=recipe, layout=layout, seq_len=64)
    b = gpulab.fit("hf:tiny-llama", "4GiB", optimizer="adamw", dtype="bf16", accumulate=2, tp=2, seq_len=64)
    assert (a.largest_batch, a.peak_bytes, a.reserved_bytes, a.recipe) == \
        (b.largest_batch, b.peak_bytes, b.reserved_bytes, b.recipe)
    assert a.answered_recipe == b.answered_recipe == recipe and a.answered_layout == b.answered_layout == layout
    d = a.as_dict()
    assert d["answered_recipe"] == dataclasses.asdict(recipe) and d["answered_layout"]["tp"] == 2
    layout_note = d["recipe"].pop("tensor_parallel")   # the tensor-parallel layout, stated (training.tensor_parallel)
    assert layout_note["text"].startswith("tp=2: torchtitan's TP layout")
    assert d["recipe"] == {"accumulate": 2, "tp": 2}   # the existing key: what the answer states


def test_a_keyword_that_contradicts_an_object_is_refused():
    with pytest.raises(ValueError, match="optimizer given both as keyword"):
        gpulab.fit("mlp", "T4", recipe=Recipe(optimizer="sgd"), optimizer="adamw")
    with pytest.raises(ValueError, match="tp given both as keyword"):
        gpulab.step("hf:tiny-llama", engine="fake", layout=Layout(tp=2), tp=4)
    with pytest.raises(ValueError, match="recipe must be a gpulab.Recipe"):
        gpulab.fit("mlp", "T4", recipe={"optimizer": "sgd"})
    with pytest.raises(ValueError, match="leave out lora with tp"):   # checked together
        gpulab.fit("hf:tiny-llama", "T4", recipe=Recipe(lora=8), layout=Layout(tp=2))
    with pytest.raises(ValueError, match="gpulab.fit answers"):
        gpulab.step("mlp", engine="fake", layout=Layout(gpus=8, strategy="ddp"))
    # a keyword equal to the object's value, or left at its default, is not a contradiction
    same = gpulab.step("mlp", engine="fake", batch=4, recipe=Recipe(optimizer="sgd"), optimizer="sgd", tp=1)
    assert same.answered_recipe == Recipe(optimizer="sgd")


def test_step_is_predict_step_and_carries_its_settings():
    import gpulab.predict.step
    assert gpulab.step is gpulab.predict.step.step
    s = gpulab.step("mlp", engine="fake", batch=4, recipe=Recipe(optimizer="sgd", set_to_none=False))
    flat = gpulab.step("mlp", engine="fake", batch=4, optimizer="sgd", set_to_none=False)
    assert s.peak_bytes == flat.peak_bytes and s.step_peaks == flat.step_peaks
    assert s.as_dict()["answered_recipe"]["set_to_none"] is False and s.as_dict()["answered_layout"]["tp"] == 1


def test_cli_json_carries_recipe_and_layout(capsys):
    from gpulab import cli
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--optimizer", "sgd", "--accumulate", "2", "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["answered_recipe"]["optimizer"] == "sgd" and d["answered_recipe"]["accumulate"] == 2
    assert d["answered_layout"] == dataclasses.asdict(Layout()) and d["recipe"] == {"accumulate": 2}
    assert cli.main(["step", "mlp", "--engine", "fake", "--batch", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["answered_recipe"] == dataclasses.asdict(Recipe()) and d["answered_layout"]["pp"] == 1


def test_the_mesh_is_torchtitans_parallel_dims():
    """Layout names the mesh dp_replicate × dp_shard × cp × tp × pp as torchtitan's ParallelDims does, derived
    from gpus and strategy when not given (ddp replicates, fsdp2/zero* shard), checked against gpus with the
    product in the message, ep dividing dp_shard × cp × tp (ParallelDims._validate's sparse region)."""
    assert Layout(gpus=8, strategy="ddp").mesh_dims == dict(dp_replicate=8, dp_shard=1, cp=1, tp=1, pp=1, ep=1)
    assert Layout(gpus=64, strategy="fsdp2", tp=8, pp=4).mesh == "mesh dp_replicate 1 × dp_shard 2 × cp 1 × tp 8 × pp 4"
    lay = Layout(gpus=8, strategy="fsdp2", ep=8)
    assert lay.mesh == "mesh dp_replicate 1 × dp_shard 8 × cp 1 × tp 1 × pp 1 (ep 8 from dp_shard × cp)"
    assert repr(lay) == "Layout(gpus=8, strategy='fsdp2', ep=8)" and lay == Layout(gpus=8, strategy="fsdp2", ep=8,
                                                                                    dp_shard=8)
    hsdp = Layout(gpus=16, strategy="fsdp2", dp_replicate=2)
    assert (hsdp.dp_shard, hsdp.sharded_over, hsdp.dp) == (8, 8, 16)
    assert Layout(gpus=8, strategy="fsdp2", cp=8).sharded_over == 8 and Layout(gpus=8, strategy="ddp", cp=8).sharded_over == 1
    assert Layout(ep=4).dp_shard == 4   # one rank of an ep group: the smallest mesh that holds it
    for make, words in [
        (lambda: Layout(gpus=8, strategy="fsdp2", dp_replicate=2, dp_shard=3),
         "gpus=8 is not dp_replicate × dp_shard × cp × tp × pp = 2 × 3 × 1 × 1 × 1 = 6"),
        (lambda: Layout(gpus=8, tp=3), "gpus=8 is not a multiple of tp=3"),
        (lambda: Layout(gpus=8, strategy="ddp", ep=4),
         "--ep 4 does not divide the 1 data-parallel ranks it borrows from: dp_shard × cp × tp = 1 × 1 × 1 = 1"),
        (lambda: Layout(gpus=8, strategy="ddp", dp_shard=2), "dp_shard 2 shards each replica's state: give strategy fsdp2"),
        (lambda: Layout(gpus=8, strategy="zero3", dp_replicate=2), "hybrid sharding"),
        (lambda: Layout(dp_shard=2), "give gpus too"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            make()
