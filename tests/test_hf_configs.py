"""The built-in transformer configs: exact published parameter counts (built on the meta device),
name lookup, and tiny configs that train on a CPU."""
import subprocess
import sys

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gpulab.models.hf_configs import HF_CONFIGS, TINY_SOURCE, HFConfigEntry, build_causal_lm, build_model, local_config, task_of, config_summary, hf_entry, hf_names, is_config, make_config

PUBLISHED = [name for name, e in HF_CONFIGS.items() if e.published_params is not None]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied embedding counts once


def test_the_table():
    assert {"gpt2", "gpt2-medium", "llama-3-8b", "llama-2-7b", "mistral-7b", "qwen2.5-0.5b",
            "tiny-gpt2", "tiny-llama"} <= set(hf_names())
    assert hf_names() == list(HF_CONFIGS)
    for name, e in HF_CONFIGS.items():
        assert name == e.name == name.lower()
        assert hasattr(transformers, e.config_class)
        if e.tiny:
            assert e.published_params is None and e.source == TINY_SOURCE and "gpulab" in e.description
        else:
            assert e.source.startswith("https://huggingface.co/") and e.source.endswith("/blob/main/config.json")
            assert e.published_params is not None


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_parameter_counts(name):
    entry = hf_entry(name)
    with torch.device("meta"):
        model = build_model(make_config(entry), auto_class=entry.published_class)
    assert n_params(model) == entry.published_params


def test_tiny_parameter_counts_by_hand():
    # tiny-llama: untied 1000x64 embedding and head; per layer q,o 64x64, k,v 64x32 (2 KV heads
    # of 16), MLP 3 x 64x172, two norms of 64; then the final norm.
    llama = 2 * 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 172 + 2 * 64) + 64
    # tiny-gpt2: tied 1000x64 embedding, 256x64 positions; per layer two LayerNorms, c_attn
    # 64x192+192, c_proj 64x64+64, c_fc 64x256+256, MLP c_proj 256x64+64; then ln_f.
    gpt2 = 1000 * 64 + 256 * 64 + 2 * (2 * 128 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64) + 128
    with torch.device("meta"):
        assert n_params(build_causal_lm("tiny-llama")) == llama == 218_944
        assert n_params(build_causal_lm("tiny-gpt2")) == gpt2 == 180_480


@pytest.mark.parametrize("name", hf_names())
def test_config_keeps_every_field(name):
    """Every field of the table reaches the config under its own name, so a renamed or dropped
    field in a later transformers release shows here rather than as a wrong model."""
    entry = hf_entry(name)
    config = make_config(entry)
    assert type(config).__name__ == entry.config_class
    import transformers
    default = getattr(transformers, entry.config_class)().use_cache   # the class's own default, as from the Hub
    assert config.use_cache is default is True
    assert make_config(entry, use_cache=False).use_cache is False
    rope = getattr(config, "rope_parameters", None) or {}
    for key, value in entry.kwargs.items():
        if key == "rope_theta":  # transformers 5.x keeps it in rope_parameters
            assert (rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"] == value
        elif key == "rope_local_base_freq":  # Gemma 3's sliding layers' theta
            assert rope["sliding_attention"]["rope_theta"] == value
        elif key == "rope_scaling":  # also in rope_parameters, with rope_theta and rope_type added
            assert value.items() <= rope.items()
        elif key == "sliding_window" and entry.kwargs.get("use_sliding_window") is False:
            assert config.sliding_window is None  # Qwen2Config drops an unused window
        else:
            assert getattr(config, key) == value, key


def test_make_config_is_fresh():
    a, b = make_config("gpt2"), make_config(hf_entry("gpt2"))
    assert a is not b and a.to_dict() == b.to_dict()
    a.n_layer = 1
    assert make_config("gpt2").n_layer == 12 and HF_CONFIGS["gpt2"].kwargs["n_layer"] == 12
    # transformers writes rope_theta and rope_type into the rope_scaling dict it is given: the table's stays
    make_config("llama-3.1-70b")
    assert "rope_theta" not in HF_CONFIGS["llama-3.1-70b"].kwargs["rope_scaling"]


@pytest.mark.parametrize("name", [n for n, e in HF_CONFIGS.items() if e.rounded])
def test_rounded_published_counts(name):
    """Where the card gives a rounded figure ("46.7B"), the exact meta-device count in the table rounds to it."""
    entry = hf_entry(name)
    figure = entry.rounded
    assert figure.endswith("B")
    decimals = len(figure[:-1].partition(".")[2])
    assert f"{entry.published_params / 1e9:.{decimals}f}B" == figure


def test_gemma3_1b_as_its_report_counts():
    # Gemma 3 report (arXiv 2503.19786), table 1: 1B = 302 M embedding + 698 M non-embedding parameters.
    with torch.device("meta"):
        model = build_model(make_config("gemma-3-1b"))
    embedding = model.get_input_embeddings().weight.numel()
    assert (round(embedding / 1e6), round((n_params(model) - embedding) / 1e6)) == (302, 698)
    layers = make_config("gemma-3-1b").layer_types
    assert layers[:6] == ["sliding_attention"] * 5 + ["full_attention"]  # 5 local : 1 global


def test_names_and_prefix():
    assert hf_entry("llama-3-8b") is hf_entry("hf:llama-3-8b") is hf_entry("HF:Llama-3-8B")
    assert isinstance(hf_entry("gpt2"), HFConfigEntry)


def test_unknown_name():
    with pytest.raises(ValueError) as err:
        hf_entry("llama3")
    msg = str(err.value)
    assert msg.startswith("unknown transformer config 'llama3'  (did you mean llama-3-8b")
    assert "built-in configs: " + ", ".join(hf_names()) in msg
    assert msg.endswith("or pass a transformers.PretrainedConfig object")
    with pytest.raises(ValueError, match=r"unknown transformer config 'zzzz'; built-in configs"):
        hf_entry("zzzz")
    with pytest.raises(ValueError, match="did you mean"):
        make_config("hf:gpt-2")


def test_is_config():
    assert is_config(make_config("tiny-llama"))
    assert is_config(transformers.GPT2Config())
    assert not is_config(hf_entry("tiny-llama"))
    assert not is_config("tiny-llama")
    assert not is_config({"hidden_size": 64})


def test_import_does_not_import_transformers():
    code = ("import sys, gpulab.models.hf_configs as h; assert not h.is_config(object()); "
            "assert len(h.hf_names()) >= 8; assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tiny_trains_on_cpu(name):
    torch.manual_seed(0)
    model = build_causal_lm(name)
    assert next(model.parameters()).device.type == "cpu"
    ids = torch.randint(0, 1000, (2, 16))
    out = model(input_ids=ids, labels=ids)
    loss = out.loss
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert 5.0 < loss.item() < 9.0  # about ln(1000) = 6.9 for random weights
    assert model.loss_type == "ForCausalLM"  # GPT2LMHeadModel's is None in transformers 5.x
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-llama", "gpt2"])
def test_build_on_meta_and_under_fake_tensors(name):
    with torch.device("meta"):
        meta = build_causal_lm(name, dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in meta.parameters()} == {("meta", torch.bfloat16)}
    with FakeTensorMode():
        fake = build_causal_lm(make_config(name))
        assert all(isinstance(p, FakeTensor) for p in fake.parameters())
    assert n_params(fake) == n_params(meta)


def test_dtype_defaults_to_float32():
    with torch.device("meta"):
        model = build_causal_lm("tiny-llama")
    assert next(model.parameters()).dtype == torch.float32


def test_config_summary():
    assert config_summary("gpt2") == {
        "model_type": "gpt2", "hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12,
        "intermediate_size": 3072, "vocab_size": 50257, "max_positions": 1024, "tie_word_embeddings": True}
    assert config_summary(make_config("llama-3-8b")) == {
        "model_type": "llama", "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "max_positions": 8192, "tie_word_embeddings": False}
    s = config_summary(hf_entry("qwen2.5-0.5b"))
    assert (s["model_type"], s["num_kv_heads"], s["tie_word_embeddings"]) == ("qwen2", 2, True)
    assert config_summary("llama-2-7b")["num_kv_heads"] == 32


def test_encoders_and_encoder_decoders_are_built_as_what_they_are_trained_as():
    import gpulab
    assert [task_of(make_config(n)) for n in ("gpt2", "bert-large-uncased", "t5-base")] == \
        ["causal-lm", "masked-lm", "seq2seq-lm"]
    with torch.device("meta"):
        assert type(build_model(make_config("bert-base-uncased"))).__name__ == "BertForMaskedLM"
        assert type(build_model(make_config("t5-base"))).__name__ == "T5ForConditionalGeneration"
    for name in ("hf:bert-base-uncased", "hf:t5-base"):
        r = gpulab.step(name, batch=1, seq_len=32, engine="fake", guard=False, steps=1)
        assert r.peak_bytes > r.predicted["parameters"] > 0
    with pytest.raises(ValueError, match="causal language model"):
        gpulab.step("hf:bert-base-uncased", batch=1, seq_len=32, engine="fake", chunked_loss=4)


def test_a_local_config_json_and_a_cache_id(tmp_path):
    import gpulab
    transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                             eos_token_id=2).save_pretrained(tmp_path)
    r = gpulab.step(f"hf:{tmp_path / 'config.json'}", batch=2, seq_len=16, engine="fake", guard=False)
    assert r.model == f"hf:{tmp_path / 'config.json'}"
    assert gpulab.step(f"hf:{tmp_path}", batch=2, seq_len=16, engine="fake", guard=False).peak_bytes == r.peak_bytes
    assert type(local_config(str(tmp_path))).__name__ == "LlamaConfig"
    with pytest.raises(ValueError, match="never downloads"):
        gpulab.step("hf:no-such-org/no-such-model", batch=1, engine="fake")
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(ValueError, match="could not read"):
        local_config(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("change,words", [
    ({"vocab_size": "500"}, ["field 'vocab_size' expected int, got str (value: '500')", "correct that field"]),
    # refused by gpulab's own field check (models.config_fields) before transformers builds it, naming the
    # same two fields and what to set
    ({"hidden_size": 66}, ["hidden_size 66 is not a multiple of num_attention_heads 4",
                           "set hidden_size to a multiple of 4, or head_dim"]),
])
def test_a_config_transformers_refuses_says_which_field_and_why(tmp_path, capsys, change, words):
    import json

    from gpulab import cli
    raw = {"model_type": "llama", "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, **change}))
    for key in (str(path), str(tmp_path)):   # the file or its folder
        with pytest.raises(ValueError) as info:
            local_config(key)
        text = str(info.value)
        assert text.startswith(f"{key}: ") and "\n" not in text and "StrictDataclass" not in text, text
        assert all(w in text for w in words), text
    # the command line says it in one line, as bad input (exit 2), not as an internal error
    assert cli.main(["step", f"hf:{path}", "--engine", "fake"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"gpulab: error: {path}: "), err
    assert all(w in err for w in words), err
