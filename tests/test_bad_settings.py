"""Issue 35 item 7: settings transformers builds but no model can mean, refused in one line by
``gpulab fit`` and ``gpulab serve`` (exit 2, ``gpulab: ...``), before any fake run: more experts per
token than a layer routes to, a sliding window wider than the positions; an unknown FP8 recipe (its
CLI test: tests/test_fp8.py). The built-in configs (Qwen2.5's unused 131,072-token window included)
are all taken."""
from __future__ import annotations

import json

import pytest

from conftest import run_main
from gpulab.models import hf_configs

transformers = pytest.importorskip("transformers")


def _config_file(tmp_path, base: str, **fields) -> str:
    cfg = hf_configs.make_config(base).to_dict()
    cfg.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return f"hf:{tmp_path / 'config.json'}"


@pytest.mark.parametrize("command", [["fit", "--gpu", "H100", "--dtype", "bf16"],
                                     ["serve", "--gpu", "H100", "--context", "128"]])
@pytest.mark.parametrize("base,fields,said", [
    ("mixtral-8x7b", dict(num_experts_per_tok=9), "num_experts_per_tok 9 is larger than the 8 routed experts "
                                                    "a layer has (num_local_experts)"),
    ("qwen3-30b-a3b", dict(num_experts_per_tok=129), "num_experts_per_tok 129 is larger than the 128 routed "
                                                       "experts a layer has"),   # (num_local_experts in 5.24)
    ("deepseek-v2-lite", dict(num_experts_per_tok=65), "larger than the 64 routed experts a layer has "
                                                         "(n_routed_experts)"),
    ("gemma-2-2b", dict(sliding_window=16384), "sliding_window 16,384 is larger than its 8,192 positions"),
])
def test_a_setting_no_model_can_mean_is_refused_in_one_line(tmp_path, capsys, command, base, fields, said):
    model = _config_file(tmp_path, base, **fields)
    code, out, err = run_main([command[0], model, *command[1:]], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gpulab: ") and said in err and "set " in err


def test_every_built_in_config_is_taken():
    """No false refusal: every built-in config (Gemma's windows within their positions, every MoE's k
    at most its experts); a window over the positions where no layer slides (Qwen2.5's config.json:
    sliding_window 131,072, max_position_embeddings 32,768, use_sliding_window false) is taken, and
    refused once its layers slide."""
    for name in hf_configs.hf_names():
        hf_configs.check_settings(hf_configs.make_config(name), name)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=131072, max_position_embeddings=32768, max_window_layers=0)
    hf_configs.check_settings(transformers.Qwen2Config(**shape, use_sliding_window=False), "qwen2.5")
    with pytest.raises(ValueError, match="sliding_window 131,072 is larger than its 32,768 positions"):
        hf_configs.check_settings(transformers.Qwen2Config(**shape, use_sliding_window=True), "qwen2.5")
