"""Card-aware predictions (issue #33 item 1): the card's compute capability picks SDPA's kernel
(rules of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``measure.cuda_card``) and sizes
cuBLAS's workspace (aten/src/ATen/cuda/CublasHandlePool.cpp); the card flows from ``gpulab.fit`` /
``serve`` / ``step`` to the fake CUDA target, and every answer's label names it; cuDNN workspaces
recorded on the H200 are added where the question is that recorded step."""
from __future__ import annotations

import json

import pytest
import torch

import gpulab
from gpulab.measure.cuda_card import (DEFAULT_TARGET, KernelTarget, cublas_workspace_bytes, current_target,
                                      gemm_alignment, kernel_target, sdpa_backend, step_workspace_bytes)
from gpulab.measure.engines import LABEL_FAKE_CUDA, run
from gpulab.measure.fake_cuda import cuda_sdpa_backend
from gpulab.predict.cards import parse_gpu
from gpulab.record.lookup import PACKAGE_DIR

Q = (2, 8, 128, 64)   # batch, heads, sequence, head dim: every kernel's constraints hold
CC = {name: parse_gpu(name).capability for name in ("T4", "A100-80GB", "H100", "H200", "L4", "V100-16GB", "B200")}


@pytest.mark.parametrize("card, dtype, backend", [
    ("T4", torch.float16, "efficient"),      # flash needs sm80+; mem-efficient takes fp16 from sm50
    ("T4", torch.bfloat16, "math"),          # bf16 only from sm80 (greater_than_or_equal_sm80_mem_efficient_dtypes)
    ("T4", torch.float32, "efficient"),      # fp32 in both dtype lists
    ("V100-16GB", torch.bfloat16, "math"),
    ("A100-80GB", torch.bfloat16, "flash"),
    ("A100-80GB", torch.float32, "efficient"),   # flash and cuDNN take 16-bit only
    ("L4", torch.float16, "flash"),
    ("H100", torch.bfloat16, "cudnn"),       # check_prefer_cudnn_attention: sm90 with cuDNN newer than 9.15
    ("H100", torch.float32, "efficient"),
    ("B200", torch.bfloat16, "cudnn"),
])
def test_backend_for_card_and_dtype(card, dtype, backend):
    assert sdpa_backend(CC[card], dtype, Q, Q, Q) == backend
    q = torch.empty(Q, dtype=dtype, device="meta")
    assert cuda_sdpa_backend(q, q, q, capability=CC[card]) == backend


def test_the_other_rules_of_sdp_utils():
    a100, l4, h100, t4 = CC["A100-80GB"], CC["L4"], CC["H100"], CC["T4"]
    bf = torch.bfloat16
    assert sdpa_backend(a100, bf, Q, Q, Q, mask=True) == "efficient"              # flash takes no mask
    assert sdpa_backend(a100, bf, (2, 8, 1, 64), Q, Q, is_causal=True) == "efficient"   # causal: sq == sk
    wide = (2, 8, 128, 256)                   # sm86-89 training with head dim in (224, 256] and dropout: not flash
    assert sdpa_backend(l4, bf, wide, wide, wide, requires_grad=True, dropout_p=0.1) == "efficient"
    assert sdpa_backend(l4, bf, wide, wide, wide, requires_grad=True) == "flash"
    assert sdpa_backend(h100, bf, wide, wide, wide) == "flash"                     # cuDNN: head dim <= 128
    assert sdpa_backend(h100, bf, Q, Q, Q, dropout_p=0.1) == "flash"               # cuDNN: p a multiple of 1/16
    odd = (2, 8, 128, 60)                     # 60: not a multiple of 8 (16-bit alignment)
    assert sdpa_backend(t4, torch.float16, odd, odd, odd) == "math"
    assert sdpa_backend(t4, torch.float32, odd, odd, odd) == "efficient"           # fp32 on sm75: alignment 1
    assert (gemm_alignment((8, 0), torch.float16), gemm_alignment((8, 0), torch.float32)) == (8, 4)
    assert (gemm_alignment((7, 5), torch.float16), gemm_alignment((7, 5), torch.float32)) == (8, 1)
    assert gemm_alignment((6, 1), torch.float16) == 1


def test_cublas_workspace_per_capability():
    # parseChosenWorkspaceSize: ":4096:2:16:8" (4096 KiB x 2 + 16 KiB x 8), 32 MiB on Hopper and later
    assert cublas_workspace_bytes((7, 5), {}) == cublas_workspace_bytes((8, 0), {}) == 8_519_680
    assert cublas_workspace_bytes((8, 9), {}) == 8_519_680
    assert cublas_workspace_bytes((9, 0), {}) == cublas_workspace_bytes((10, 0), {}) == 32 * 2**20
    assert cublas_workspace_bytes(None, {}) == 8_519_680                          # no capability: sm80's
    assert cublas_workspace_bytes((7, 5), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "junk"}) == 32 * 2**20   # warned, default
    assert parse_gpu("T4").workspace_bytes() < parse_gpu("H100").workspace_bytes()


def test_cublas_workspaces_match_what_the_h200_kept_after_its_first_step():
    """The H200 record's first step (the process's first matmuls) kept 68,157,440 bytes allocated after
    it: two 32 MiB cuBLAS workspaces (the forward's thread, autograd's) and cuBLASLt's 1 MiB."""
    data = json.loads((PACKAGE_DIR / "nvidia-h200.json").read_text())
    first = data["experiments"][0]
    assert first["kind"] == "step" and data["provenance"]["compute_capability"] == "9.0"
    assert first["result"]["beyond_tensors"]["kept_after_run"] == step_workspace_bytes((9, 0), env={}) == 68_157_440


def test_default_target_keeps_todays_sm80_rules_and_says_so():
    assert current_target() is DEFAULT_TARGET and DEFAULT_TARGET.rules == (8, 0)
    assert "no card named" in DEFAULT_TARGET.text
    q = torch.empty(Q, dtype=torch.bfloat16, device="meta")
    assert cuda_sdpa_backend(q, q, q) == "flash"

    def attend(ctx):
        x = torch.randn(Q, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
    m = run(attend, "fake", fake_target="cuda")
    assert m.label == LABEL_FAKE_CUDA and "no card named" in m.kernels_note and "flash attention" in m.kernels_note
    with kernel_target(KernelTarget("T4", (7, 5))):
        t4 = run(attend, "fake", fake_target="cuda")
    assert "a T4 (sm75)" in t4.label and "math attention" in t4.kernels_note and "s×s" in t4.kernels_note
    b, h, s, _ = Q      # math saves the s×s attention weights in float32 (q, k, v upcast, attention.cpp)
    assert t4.peak_bytes - m.peak_bytes >= b * h * s * s * 4


def test_a_t4_step_in_bf16_saves_the_attention_weights_an_h100_does_not():
    kw = dict(engine="fake", dtype="bf16", batch=2, seq_len=128, steps=1)
    t4, h100 = gpulab.step("hf:tiny-llama", gpu="T4", **kw), gpulab.step("hf:tiny-llama", gpu="H100", **kw)
    assert "a T4 (sm75)" in t4.label and "an H100 (sm90)" in h100.label
    assert "math attention" in t4.measurement.kernels_note and "s×s attention weights" in t4.measurement.kernels_note
    assert "cuDNN attention" in h100.measurement.kernels_note
    cfg = gpulab.models.hf_configs.config_and_name("tiny-llama")[0]
    weights = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * 128 * 128 * 4   # float32 s×s per layer
    gap = t4.peak_by_category["activations"] - h100.peak_by_category["activations"]
    assert gap >= weights
    assert t4.as_dict()["kernels_note"].startswith("CUDA kernels of a T4 (sm75)")


def test_fit_and_serve_name_the_card_and_count_its_workspaces():
    r = gpulab.fit("mlp", "T4")
    assert "CUDA kernels of a T4 (sm75)" in r.label and r.kernels in r.label
    assert r.workspace_bytes == parse_gpu("T4").workspace_bytes()
    assert r.needed_bytes == r.reserved_bytes + r.context_bytes + r.workspace_bytes
    assert "cuDNN workspaces: not predicted" in r.as_dict()["workspace_label"]
    assert "no compute capability known for 24 GiB" in gpulab.fit("mlp", "24GiB").label
    s = gpulab.serve("tiny-llama", "H100", context_len=32)
    assert "an H100 (sm90)" in s.label and s.workspace_bytes == 33_554_432 + 2**20
    assert s.usable_bytes == s.capacity_bytes - s.context_bytes - s.workspace_bytes
    assert s.as_dict()["context_label"].startswith("measured: 1,383.88 MiB on an NVIDIA H200")
    assert current_target() is DEFAULT_TARGET       # the card held only for the question


def test_recorded_cudnn_workspace_on_the_recorded_card_only():
    """cnn / sgd at batch 32 (32×32 images, float32) was recorded on the H200: the fake peak plus the
    recorded cuDNN workspace is the real max_memory_allocated − baseline of that run, to the byte."""
    data = json.loads((PACKAGE_DIR / "nvidia-h200.json").read_text())
    rec = next(e["result"] for e in data["experiments"] if e["kind"] == "step" and e["params"] == {
        "batch": 32, "dtype": "float32", "image_size": 32, "model": "cnn", "optimizer": "sgd", "steps": 1})
    h200 = gpulab.step("cnn", gpu="H200", engine="fake", batch=32, optimizer="sgd", steps=1)
    assert h200.cudnn_workspace_bytes == rec["beyond_tensors"]["bytes"] == 2_203_648
    assert h200.cudnn_workspace_label.endswith("recorded on NVIDIA H200, 2026-11-26, torch 2.11.0+cu130 "
                                               "(the allocator's peak beyond the live tensors' blocks)")
    assert h200.peak_with_workspaces_bytes == rec["allocator"]["peak_allocated_delta"] == 23_667_712
    t4 = gpulab.step("cnn", gpu="T4", engine="fake", batch=32, optimizer="sgd", steps=1)
    assert t4.cudnn_workspace_bytes is None and t4.cudnn_workspace_label.startswith("cuDNN workspaces: not predicted")
    assert t4.peak_with_workspaces_bytes == t4.peak_bytes == h200.peak_bytes
    other = gpulab.step("cnn", gpu="H200", engine="fake", batch=7, optimizer="sgd", steps=1)
    assert other.cudnn_workspace_bytes is None and "no step of these settings" in other.cudnn_workspace_label


def test_the_cli_step_takes_a_card(capsys):
    from gpulab import cli
    assert cli.main(["step", "cnn", "--engine", "fake", "--batch", "32", "--optimizer", "sgd", "--steps", "1",
                     "--gpu", "H200", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "an H200 (sm90)" in d["label"] and d["cudnn_workspace_bytes"] == 2_203_648
    assert cli.main(["step", "cnn", "--engine", "fake", "--batch", "32", "--optimizer", "sgd", "--gpu", "T4"]) == 0
    out = capsys.readouterr().out
    assert "kernels: CUDA kernels of a T4 (sm75)" in out and "cuDNN workspaces: not predicted" in out
    assert cli.main(["step", "cnn", "--engine", "fake", "--gpu", "H1000"]) == 2
    assert "cannot read --gpu" in capsys.readouterr().err
