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


def test_a_card_smaller_than_the_assumed_context_says_so_and_a_negative_size_is_refused_as_one():
    """--gpu 1GiB and gpulab.fit(m, -5) blamed "the CUDA context allowance" without saying it is an
    assumption or naming --context."""
    with pytest.raises(ValueError, match=r"1 GiB \(1.0 GiB\) is no larger than the CUDA context gpulab assumes "
                                         r"\(.*an assumption.*--context \(context_bytes= in Python\)"):
        gpulab.fit("mlp", "1GiB")
    with pytest.raises(ValueError, match=r"gpu -5 is not a card's size: give a positive number of bytes"):
        gpulab.fit("mlp", -5)
    with pytest.raises(ValueError, match=r"context_bytes \(--context\) must be a whole number of bytes, 0 or more"):
        gpulab.fit("mlp", "4GiB", context_bytes=-1)
    with pytest.raises(ValueError, match=r"context_bytes \(--cuda-context\) must be a whole number of bytes"):
        gpulab.serve("hf:tiny-llama", "4GiB", context_len=32, context_bytes=-1)


def test_cli_negative_sizes_reach_the_size_check(capsys):
    """--gpu -1GB got argparse's "expected one argument"; a negative value is joined to its option."""
    for argv, said in ((["fit", "mlp", "--gpu", "-1GB"], "cannot read --gpu '-1GB': a size must be at least 1 byte"),
                       (["fit", "mlp", "--gpu", "24GiB", "--context", "-1GiB"], "cannot read --context '-1GiB'"),
                       (["serve", "hf:tiny-llama", "--gpu", "-.5GiB", "--context", "8"], "at least 1 byte")):
        code, out, err = run_main(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and said in err and "expected one argument" not in err, err


def test_cli_longest_context_with_a_context_is_refused(capsys):
    """serve --longest-context --context 4096 ignored --context without a word."""
    code, out, err = run_main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--longest-context", "--context",
                               "4096"], capsys)
    assert code == 2 and "--context 4096 would be ignored: give one of them" in err


@pytest.mark.parametrize("argv,said", [
    (["fit", "mlp", "--gpu", "H1000", "--json"], "cannot read --gpu"),                 # a value, before torch
    (["fit", "mlp", "--gpu", "24GiB", "--bogus", "--json"], "unrecognized arguments: --bogus"),   # argparse's
    (["fit", "nosuchmodel", "--gpu", "24GiB", "--json"], "unknown model 'nosuchmodel'"),   # the library's
])
def test_cli_json_errors_are_one_json_object_on_stdout(capsys, argv, said):
    """--json errors left stdout empty: now {"error": "..."} on stdout (exit 2), the line on stderr kept."""
    import json
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out.count("\n") == 1
    assert said in json.loads(out)["error"] and err.startswith("gpulab: error: ")


def test_the_search_limit_is_said_to_be_a_bound(capsys):
    """--gpu 99999999TiB said "largest batch that fits: 1048576", which is the search's limit."""
    import json

    from gpulab.predict.fit import MAX_BATCH
    code, out, err = run_main(["fit", "mlp", "--gpu", "99999999TiB", "--quiet"], capsys)
    assert code == 0 and f"largest batch that fits: at least {MAX_BATCH} (the search's limit)" in out
    code, out, err = run_main(["fit", "mlp", "--gpu", "99999999TiB", "--quiet", "--json"], capsys)
    d = json.loads(out)
    assert d["largest_batch"] == MAX_BATCH and d["largest_batch_at_limit"] is True
    assert d["largest_batch_text"] == f"at least {MAX_BATCH} (the search's limit)"
    r = gpulab.fit("mlp", "2GiB")   # an answer below the limit is the answer
    assert not r.at_search_limit and r.largest_batch_text == str(r.largest_batch)
    assert "at least" in repr(gpulab.fit("mlp", "99999999TiB"))


@pytest.mark.parametrize("argv,said", [
    (["--lora", "4", "--lora-targets", "nope"],
     ["lora_targets (--lora-targets) nope: no linear layer of hf:tiny-llama is named nope",
      "its linear layers are named q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"]),
    (["--lora", "100000"],
     ["lora 100000 (--lora): LoRA rank 100000 is more than the smaller side of the adapted layer",
      "use a rank of at most 32"]),
])
def test_lora_targets_and_rank_are_refused_before_any_fake_run(argv, said, capsys, monkeypatch):
    """--lora-targets nope and --lora 100000 were refused by peft's wrapping, after the first fake run
    had started (a progress line, then the error): now check_recipe_for reads the model's linear
    layers off a meta-device build first, and the refusal is the one line on stderr."""
    from gpulab.predict import fake_runs   # fit's fake runs (predict.fake_runs.fake_run)

    def no_run(*a, **k):
        raise AssertionError("a fake run started before the LoRA settings were checked")
    monkeypatch.setattr(fake_runs, "train_experiment", no_run)
    code, out, err = run_main(["fit", "hf:tiny-llama", "--gpu", "24GiB", "--seq-len", "32", *argv], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("gpulab: error: "), err
    assert all(s in err for s in said), err
    with pytest.raises(ValueError) as e:   # the Python API, the same line
        gpulab.fit("hf:tiny-llama", "24GiB", seq_len=32, lora=int(argv[1]), lora_targets=argv[3:] or None)
    assert all(s in str(e.value) for s in said), str(e.value)
