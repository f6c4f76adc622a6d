"""``gpulab serve`` (``gpulab.predict.serve``): serving memory measured on fake tensors at full size,
the KV cache against its formula, quantized weights and an fp8 cache, vLLM's block arithmetic, and
bad input refused with what to do."""
from __future__ import annotations

import json
import math

import pytest

from gpulab import cli
from gpulab.course.kv_cache import kv_cache_for
from gpulab.predict.generation import fp8_cache_exists, generation_peak
from gpulab.predict.serve import serve


def test_the_cache_is_the_formulas_and_the_peaks_are_the_generations():
    r = serve("tiny-llama", "24GiB", context_len=128, batch=3, dtype="float32")
    assert r.kv_cache_bytes == kv_cache_for("tiny-llama", 128, 3, "float32").bytes
    g = generation_peak("tiny-llama", prompt_len=127, new_tokens=2, batch=3, dtype="float32")
    assert (r.prefill_all_bytes, r.decode_bytes) == (g.prefill_peak_bytes, g.decode_peak_bytes)
    one = generation_peak("tiny-llama", prompt_len=127, new_tokens=2, batch=1, dtype="float32")
    assert r.prefill_one_bytes == one.prefill_peak_bytes < r.prefill_all_bytes
    assert r.decode_bytes >= r.weights_bytes + r.kv_cache_bytes and r.fits


def test_quantized_weights_and_an_fp8_cache_shrink_what_they_should():
    bf16 = serve("tiny-llama", "24GiB", context_len=128, batch=2)
    int8 = serve("tiny-llama", "24GiB", context_len=128, batch=2, weights="int8")
    fp8 = fp8_cache_exists()   # transformers 5.15 (Colab's) has no QuantizedCache('fp8'): refused in one line
    int4 = serve("tiny-llama", "24GiB", context_len=128, batch=2, weights="int4", kv_dtype="fp8" if fp8 else None)
    assert int4.weights_bytes < int8.weights_bytes < bf16.weights_bytes
    assert int8.kv_cache_bytes == bf16.kv_cache_bytes
    if not fp8:
        with pytest.raises(ValueError, match="has no fp8 QuantizedCache"):
            serve("tiny-llama", "24GiB", context_len=128, batch=2, kv_dtype="fp8")
        return
    # transformers' fp8 cache measured: float8 states (half the bf16 bytes) and a float32 scale per
    # layer's keys and per layer's values (tiny-llama: 2 layers)
    assert int4.kv_cache_bytes == bf16.kv_cache_bytes // 2 + 2 * 2 * 4
    assert int4.weights == "nf4" and "QuantizedCache('fp8')" in int4.kv_label
    assert int4.kv_per_token_bytes * 2 == bf16.kv_per_token_bytes and "KV in fp8" in int4.kv_assumption


def test_vllms_blocks_follow_its_arithmetic():
    r = serve("tiny-llama", "4GiB", context_len=200, batch=1, block_size=16, utilization=0.5)
    working = r.prefill_one_bytes - r.weights_bytes
    budget = int(0.5 * 4 * 2 ** 30) - r.weights_bytes - working - r.context_bytes
    assert r.paged_blocks > 0
    assert r.paged_blocks == budget // (16 * r.kv_per_token_bytes)
    assert r.max_sequences == r.paged_blocks // math.ceil(200 / 16)
    longer = serve("tiny-llama", "4GiB", context_len=250, batch=1, block_size=16, utilization=0.5)
    assert longer.max_sequences < r.max_sequences


def test_a_card_too_small_does_not_fit():
    r = serve("gpt2", "200MiB", context_len=64, batch=4, context_bytes=0)   # its weights alone: 249 MB
    assert not r.fits and r.max_sequences == 0


@pytest.mark.parametrize("kw, words", [
    ({"context_len": 1}, ["at least 2"]),
    ({"context_len": 64, "batch": 0}, ["batch", "positive"]),
    ({"context_len": 64, "weights": "int3"}, ["weights", "int8", "int4"]),
    ({"context_len": 64, "kv_dtype": "int2"}, ["kv_dtype", "fp8"]),
    ({"context_len": 64, "utilization": 1.5}, ["utilization", "(0, 1]"]),
])
def test_bad_input_says_what_to_do(kw, words):
    with pytest.raises(ValueError) as e:
        serve("tiny-llama", "24GiB", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_past_a_learned_position_table_is_refused_and_past_rotary_positions_is_answered_with_its_assumption():
    with pytest.raises(ValueError) as e:
        serve("tiny-gpt2", "24GiB", context_len=300)     # GPT-2's wpe has 256 rows: index 256 does not exist
    assert all(w in str(e.value) for w in ("256 positions", "learned position table", "or fewer")), str(e.value)
    within = serve("tiny-llama", "24GiB", context_len=256)
    past = serve("tiny-llama", "24GiB", context_len=320)   # rotary: computed for any position
    assert within.positions_note == "" and "past the 256 positions" in past.positions_note
    # the cache grows with the context past the config's positions as within them: the measured
    # transformers cache equals the formula at 320 tokens
    assert past.kv_cache_bytes == kv_cache_for("tiny-llama", 320, 1, "bfloat16").bytes
    assert past.kv_cache_bytes * 256 == within.kv_cache_bytes * 320
    assert "past the 256 positions" in past._repr_html_()


def test_an_encoder_is_not_served():
    with pytest.raises(ValueError, match="causal language model"):
        serve("bert-base-uncased", "24GiB", context_len=64)


def test_the_cli_serves(capsys):
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--context", "64", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 × 64 tokens fits" in out and "vLLM-style at 90%" in out
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--context", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["kv_cache_bytes"] == kv_cache_for("tiny-llama", 64, 1, "bfloat16").bytes
    assert cli.main(["serve", "hf:tiny-gpt2", "--gpu", "24GiB", "--context", "100000"]) == 2
    assert "256 positions" in capsys.readouterr().err
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--context", "300"]) == 0
    assert "positions: 300 tokens is past the 256 positions" in capsys.readouterr().out


def test_the_cli_finds_the_longest_context(capsys):
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--longest-context", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context_len"] == 256 and "positions (256)" in d["limit"] and d["at"]["fits"]
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--longest-context"]) == 0
    assert "the longest context for 1 sequences is 256 tokens" in capsys.readouterr().out
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB"]) == 2
    assert "--longest-context" in capsys.readouterr().err
