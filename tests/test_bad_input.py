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


def test_a_tracker_left_without_being_entered_says_how_to_use_it():
    """MemoryTracker().__exit__ without __enter__ was a raw IndexError (TorchDispatchMode's empty stack)."""
    import torch
    with pytest.raises(RuntimeError, match=r"__exit__ without a matching __enter__: use it as `with MemoryTracker"):
        gpulab.MemoryTracker().__exit__(None, None, None)
    with gpulab.MemoryTracker() as t:
        torch.ones(4)
    with pytest.raises(RuntimeError, match="leave it once"):   # left twice
        t.__exit__(None, None, None)


SEGMENT = {"address": 0, "total_size": 2 << 20, "device": 0, "stream": 0, "segment_type": "small",
           "blocks": [{"size": 512, "requested_size": 512, "state": "active_allocated", "address": 0}]}


@pytest.mark.parametrize("segment,trace,said", [
    ({**SEGMENT, "blocks": [{"state": "active_allocated"}]}, [], "segment 0, block 0 is not a dict with a 'size'"),
    ({**SEGMENT, "blocks": 5}, [], "segment 0's 'blocks' must be a list"),
    ({**SEGMENT, "blocks": [1, 2]}, [], "segment 0, block 0 is not a dict with a 'size'"),
    ({**SEGMENT, "address": "0x0"}, [], "segment 0's 'address' must be a whole number of bytes"),
    ({**SEGMENT, "total_size": None}, [], "segment 0's 'total_size' must be a whole number of bytes"),
    ({**SEGMENT, "total_size": -5}, [], "'total_size' must be a whole number of bytes, 0 or more, got -5"),
    ({**SEGMENT, "device": "cuda"}, [], "segment 0's 'device' must be a whole number"),
    (SEGMENT, [{"action": "alloc", "addr": 0, "stream": 0}], "trace entry 0 ('alloc') has no 'size'"),
    (SEGMENT, [{"action": "alloc", "addr": "x", "size": 512, "stream": 0}], "'addr' must be a whole number"),
])
def test_a_snapshot_with_wrong_typed_fields_names_the_field(segment, trace, said):
    """Wrong-typed segments gave a raw KeyError / TypeError / AttributeError, or int()'s message."""
    import pickle

    from gpulab.interop.snapshot_import import read_snapshot
    with pytest.raises(ValueError) as e:
        read_snapshot(pickle.dumps({"segments": [segment], "device_traces": [trace]})).replay()
    msg = str(e.value)
    assert said in msg and msg.startswith("not a memory snapshot") and "\n" not in msg
    read_snapshot(pickle.dumps({"segments": [SEGMENT], "device_traces": [[]]})).replay()   # the good one is read


def test_a_panel_refuses_a_value_outside_its_range_instead_of_clamping_it():
    """sharding_panel(world_size=99) became 4 without a word; a dropdown's unknown value and a power-of-two
    slider's other value raised traitlets' TraitError. Now one ValueError naming the range or choices,
    from the panel's arguments and from panel.set alike; in-range values are taken."""
    from gpulab.widgets.distributed import sharding_panel
    from gpulab.widgets.largest_batch import largest_batch_panel
    from gpulab.widgets.tensor_bytes import rounding_panel
    with pytest.raises(ValueError, match=r"processes must be a whole number from 1 to 4 \(the panel's range\), got 99"):
        sharding_panel(world_size=99)
    with pytest.raises(ValueError, match=r"strategy must be one of 'ddp', .* got 'zero9'"):
        sharding_panel(strategy="zero9")
    with pytest.raises(ValueError, match="context_mib must be a whole number from 0 to 2048"):
        largest_batch_panel(context_mib=9999)
    with pytest.raises(ValueError, match="max_elements must be a whole number from 16 to 2048"):
        rounding_panel(max_elements=1)
    panel = sharding_panel(world_size=3)
    assert panel.controls["world_size"].value == 3
    with pytest.raises(ValueError, match=r"world_size must be a whole number from 1 to 4 .* got 99"):
        panel.set(world_size=99)
    assert panel.controls["world_size"].value == 3 and panel.runs == 0
    assert largest_batch_panel(card_gib=24).controls["card_gib"].value == 24   # (label, value) choices
