"""``gpulab.predict.generation.generation_peak``: the two high points of ``generate()`` measured on
fake tensors, checked against a real ``generate()`` on the cpu engine and the KV-cache formula."""
from __future__ import annotations

import pytest

from gpulab.course.kv_cache import kv_cache_for, measured_kv_cache
from gpulab.predict.generation import generation_peak


def test_the_cache_and_the_peak_match_a_real_generate():
    fake = generation_peak("tiny-llama", prompt_len=32, new_tokens=16, dtype="float32")
    real = measured_kv_cache("tiny-llama", prompt_len=32, new_tokens=16)
    # generate's last forward leaves a cache of prompt + new - 1 tokens: the formula's, byte for byte
    assert fake.cache_bytes == real.rows[-1].measured_bytes == kv_cache_for("tiny-llama", 47, 1, "float32").bytes
    assert fake.weights_bytes == real.weights_bytes
    # the real run is the CPU's kernels, the fake one CUDA's: the same within 2%
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    assert fake.peak_bytes >= fake.weights_bytes + fake.cache_bytes


def test_a_long_prompt_peaks_in_the_prefill_and_a_long_generation_in_the_last_step():
    long_prompt = generation_peak("tiny-llama", prompt_len=200, new_tokens=2, dtype="float32")
    long_output = generation_peak("tiny-llama", prompt_len=2, new_tokens=200, dtype="float32")
    assert long_prompt.peak_at == "prefill" and long_output.peak_at == "last decode step"
    assert long_output.cache_bytes == kv_cache_for("tiny-llama", 201, 1, "float32").bytes


@pytest.mark.parametrize("kw, words", [
    ({"prompt_len": 0, "new_tokens": 4}, ["prompt_len", "at least 1"]),
    ({"prompt_len": 4, "new_tokens": 1}, ["new_tokens", "at least 2"]),
    ({"prompt_len": 4, "new_tokens": 4, "batch": 2.5}, ["batch"]),
    ({"prompt_len": 1_000_000, "new_tokens": 4}, ["positions", "fewer tokens"]),
])
def test_bad_lengths_say_what_to_do(kw, words):
    with pytest.raises(ValueError) as e:
        generation_peak("tiny-llama", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)
