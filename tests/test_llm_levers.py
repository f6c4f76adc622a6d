"""Lesson 11's section 7 (course.llm_levers): each lever is a fake run of the one training loop,
read against the formula it is taught with."""
from __future__ import annotations

from gpulab.course.llm_levers import exercise_logits_bytes, logits_levers, offload_and_compile


def test_the_loss_holds_the_float32_logits_and_their_gradient_and_chunks_hold_one_chunk():
    seq, vocab, chunks = 512, 128_256, 8
    t = logits_levers(vocab=vocab, seq_len=seq, chunks=chunks)
    logits = seq * vocab * 4
    plain, chunked = t.baseline, t.row(f"head and loss in {chunks} chunks")
    # at the peak (in backward) the temporaries are the float32 logits and their gradient, to a few
    # hundred bytes of scalars; in chunks the peak moves elsewhere, well below
    assert 0 <= plain.by_category["temporaries"] - 2 * logits <= 4096
    assert chunked.by_category["temporaries"] < plain.by_category["temporaries"] / 2
    assert t.saved_bytes(chunked.name) >= 1.25 * logits
    assert t.formula[next(k for k in t.formula if k.startswith("float32 logits"))] == logits


def test_offloading_moves_the_saved_activations_to_the_host_and_compile_saves_fewer():
    t = offload_and_compile("hf:tiny-gpt2", batch=2, seq_len=64)
    plain, off = t.baseline, t.row("activations offloaded to the host")
    comp = t.row("torch.compile (AOTAutograd's partitioner)")
    assert off.by_category["activations"] == 0 and off.host_bytes >= plain.by_category["activations"]
    assert off.peak_bytes < plain.peak_bytes
    assert comp.by_category["activations"] < plain.by_category["activations"]
    assert "offloaded" in t._repr_html_() and t.as_dict()["rows"][1]["saved_bytes"] > 0


def test_the_logits_exercise_is_computed_and_says_what_a_factor_two_means():
    ex = exercise_logits_bytes(2048, 128_256)
    assert ex.check(2048 * 128_256 * 4).ok
    wrong = ex.check(2048 * 128_256 * 2)
    assert not wrong.ok and "too small" in wrong.message
