"""Every multi-GPU answer states its mesh and the group its strategy splits over, and the numbers in
those words are the Layout's own dimensions (``Layout.mesh_dims``, ``Layout.sharded_over``: FSDP2 and ZeRO
shard over ``dp_shard × cp``, as torchtitan's ``ParallelDims`` builds its ``fsdp`` mesh; the experts over
``efsdp``, ``dp_shard × cp × tp / ep``). The text is read back with a regular expression, not compared
with a copy of itself."""
import re

import pytest
import torch

from gpulab.options import Layout, Recipe, settings_from


def _tiny(moe: bool):
    import transformers
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    if moe:
        return transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **kw)
    return transformers.LlamaConfig(**kw)


@pytest.mark.parametrize("kw", [
    dict(gpus=16, tp=2, strategy="fsdp2"),
    dict(gpus=16, tp=2, cp=2, strategy="fsdp2"),
    dict(gpus=16, tp=2, dp_replicate=2, strategy="fsdp2"),
    dict(gpus=32, tp=2, cp=2, pp=2, strategy="zero1"),
    dict(gpus=8, cp=8, strategy="ddp"),
    dict(gpus=16, tp=2, ep=4, strategy="fsdp2"),
    dict(gpus=16, cp=2, ep=4, strategy="fsdp2"),
    dict(gpus=8, ep=8, strategy="fsdp2"),
])
def test_the_sharding_line_states_the_layouts_own_numbers(kw):
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.fit import _sharding
    from gpulab.training.loop import loop_recipe
    recipe, lay = settings_from(Recipe("adamw", dtype="bf16"), Layout(**kw), {})
    w = resolve_workload(_tiny(lay.ep > 1), seq_len=16)
    sh, _ = _sharding(w, loop_recipe(recipe, lay), torch.bfloat16, lay.sharded_over, lay.strategy, False, layout=lay)
    text = sh.describe()
    world, strategy = re.match(r"(\d+) GPUs, (\w+) \(", text).groups()
    assert (int(world), strategy) == (lay.gpus, lay.strategy)
    mesh = dict((k, int(v)) for k, v in re.findall(r"(dp_replicate|dp_shard|cp|tp|pp) (\d+)",
                                                  text[text.index("; mesh "):]))
    assert mesh == {k: v for k, v in lay.mesh_dims.items() if k != "ep"}
    names, sizes, n = re.search(r"(?:N = |everything, )([a-z_ ×]+) = ([\d ×]+) = (\d+) (?:ranks|replicas)",
                                text).groups()
    sizes = [int(v) for v in sizes.split(" × ")]
    assert [mesh[k] for k in names.split(" × ")] == sizes and int(n) == lay.sharded_over == sh.gpus
    if strategy in ("fsdp2", "zero1"):   # FSDP over dp_shard × cp (torchtitan's fsdp mesh)
        assert names == "dp_shard × cp" and int(n) == lay.dp_shard * lay.cp
    if lay.ep > 1:
        names, sizes, ep, n = re.search(r"efsdp\), ([a-z_ ×]+) / ep = ([\d ×]+) / (\d+) = (\d+) ranks", text).groups()
        product = 1
        for k, v in zip(names.split(" × "), sizes.split(" × ")):
            assert mesh[k] == int(v)
            product *= int(v)
        assert int(ep) == lay.ep and int(n) == product // lay.ep == lay.dp_shard * lay.cp * lay.tp // lay.ep
