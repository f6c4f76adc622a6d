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


TINY_LLAMA = {"model_type": "llama", "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_MIXTRAL = {**TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("base,fields,said", [
    # issue 44 item 6: "batch 853 fits" for a model whose forward raises
    (TINY_LLAMA, dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (TINY_LLAMA, dict(num_attention_heads=0), "num_attention_heads 0 is not a size"),   # was ZeroDivisionError
    (TINY_LLAMA, dict(intermediate_size=-5), "intermediate_size -5 is negative"),   # was "a training step failed"
    (TINY_LLAMA, dict(num_hidden_layers=-3), "num_hidden_layers -3 is not a size"),   # was Python's __len__ message
    (TINY_LLAMA, dict(hidden_size=66), "hidden_size 66 is not a multiple of num_attention_heads 4"),
    ({**TINY_LLAMA, "model_type": "mistral"}, dict(sliding_window=0), "sliding_window 0 is not a window"),
    (TINY_MIXTRAL, dict(num_experts_per_tok=0), "num_experts_per_tok 0 routes each token to no expert"),
    (TINY_MIXTRAL, dict(num_local_experts=0), "num_local_experts 0 leaves no expert"),
    ({"model_type": "deepseek_v2", "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
      "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None,
      "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
      "num_experts_per_tok": 2}, dict(kv_lora_rank=0), "kv_lora_rank 0 is not a size"),
])
def test_a_size_field_no_forward_can_take_is_named(tmp_path, capsys, base, fields, said):
    """A config.json field no model's forward can take is refused before any run, in one line naming the
    field, its value and what to set; the same config as an object is refused by the same words."""
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    for command in (["fit", f"hf:{tmp_path}", "--gpu", "24GiB", "--seq-len", "32"],
                    ["serve", f"hf:{tmp_path / 'config.json'}", "--gpu", "24GiB", "--context", "32"]):
        code, out, err = run_main(command, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert said in err and " set " in err and "internal error" not in err, err
    raw = {**base, **fields}
    with pytest.raises(ValueError, match=said.split(" is")[0].split(" does")[0].split(" routes")[0]):
        hf_configs.check_fields(raw, "mine")


def test_kv_lora_rank_0_is_refused_as_transformers_reads_it():
    """transformers' DeepSeek attention always compresses K/V to kv_lora_rank (no `None` reading): a
    config object with 0 is refused, where gpulab read it as "not latent" (256 B a token predicted
    against 32 B measured, paged blocks 8x off)."""
    cfg = transformers.DeepseekV2Config(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=4, vocab_size=100, kv_lora_rank=0,
                                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                        n_routed_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="kv_lora_rank 0 .*no non-latent mode.*set kv_lora_rank to 1 or more"):
        hf_configs.check_settings(cfg, "ds")


def test_a_folder_without_config_json_and_a_link_loop_say_so(tmp_path, capsys):
    """Both said "no model_type" (transformers' words for an empty folder, the cache's for a loop)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name, said in (("empty", "holds no config.json"), ("loop", "symbolic link that leads nowhere")):
        code, out, err = run_main(["fit", f"hf:{tmp_path / name}", "--gpu", "24GiB"], capsys)
        assert code == 2 and said in err and "model_type" not in err and err.count("\n") == 1, err
