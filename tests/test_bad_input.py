"""Issue 44 item 6, "bad input seen from outside": inputs that gave a silently wrong answer or an
unclear error, each now refused in one line naming the field or option, the value and what to do
(or answered correctly). Config fields: tests/test_bad_settings.py; FP8 on a card without it:
tests/test_fp8.py."""
from __future__ import annotations

import pytest

import gpulab
from conftest import run_main


@pytest.mark.parametrize("call,said", [
    (lambda: gpulab.fit("hf:tiny-llama", "24GiB", image_size=64, seq_len=32),
     "image_size 64 (--image-size) sizes an image model's input, but hf:tiny-llama is a language model"),
    (lambda: gpulab.step("resnet18", seq_len=64, engine="fake", batch=1),
     "seq_len 64 (--seq-len) sizes a language model's token ids, but resnet18 takes images"),
])
def test_a_size_for_the_other_kind_of_model_is_refused(call, said):
    """--image-size on a language model and --seq-len on a CNN were dropped without a word."""
    with pytest.raises(ValueError, match=r"\(--") as e:
        call()
    assert said in str(e.value) and "leave it out" in str(e.value)


def test_cli_a_size_for_the_other_kind_of_model_is_refused(capsys):
    for argv, said in ((["fit", "hf:tiny-llama", "--gpu", "24GiB", "--image-size", "64"], "--image-size"),
                       (["breakdown", "resnet18", "--seq-len", "64"], "--seq-len")):
        code, out, err = run_main(argv, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and said in err, err
