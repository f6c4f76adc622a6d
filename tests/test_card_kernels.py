"""Card-aware predictions (issue #33 item 1): the card's compute capability picks SDPA's kernel
(rules of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``measure.cuda_card``) and sizes
cuBLAS's workspace (aten/src/ATen/cuda/CublasHandlePool.cpp); the card flows from ``gpulab.fit`` /
``serve`` / ``step`` to the fake CUDA target, and every answer's label names it; cuDNN workspaces
recorded on the H200 are added where the question is that recorded step."""
from __future__ import annotations

import functools
import json
import mmap
import pathlib
import re
import struct

import pytest
import torch

import gpulab
from gpulab.measure.cuda_card import (DEFAULT_TARGET, KernelTarget, _between, _cudnn_ok, _efficient_ok, _flash_ok,
                                      cublas_workspace_bytes, current_target, gemm_alignment, kernel_target,
                                      sdpa_backend, step_workspace_bytes)
from gpulab.measure.engines import LABEL_FAKE_CUDA, run
from gpulab.measure.fake_cuda import cuda_sdpa_backend
from gpulab.predict.cards import FP8_CAPABILITY, check_fp8_card, parse_gpu
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


# --- the rules against the installed torch: the messages its sdp_utils.cpp, CublasHandlePool.cpp and
# Blas.cpp compiled into libtorch_cuda.so name the bounds each check enforces ---------------------------

@functools.lru_cache(maxsize=1)
def _libtorch_cuda_rodata() -> bytes:
    """The read-only data (``.rodata``, where the messages live) of the installed libtorch_cuda.so."""
    lib = pathlib.Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not lib.exists():
        pytest.skip("this torch has no libtorch_cuda.so (a CPU-only build): its CUDA rules cannot be read")
    with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:5] == b"\x7fELF\x02", "expected a 64-bit ELF file"
        shoff, = struct.unpack_from("<Q", m, 0x28)
        size, count, names = struct.unpack_from("<HHH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * size) for i in range(count)]
        strtab = sections[names][4]
        for name, _, _, _, offset, length, *_ in sections:
            if m[strtab + name:m.find(b"\0", strtab + name)] == b".rodata":
                return bytes(m[offset:offset + length])
    raise AssertionError("no .rodata section")


def _message(start: bytes) -> str:
    """The installed torch's message that begins with ``start`` (to its end: the next NUL byte)."""
    data = _libtorch_cuda_rodata()
    at = data.find(start)
    assert at >= 0, f"the installed torch no longer says {start!r}: re-read sdp_utils.cpp and update cuda_card"
    return data[at:data.index(b"\0", at)].decode()


def _sm(text: str) -> tuple[int, int]:
    """"sm121" or "SM86" -> (12, 1), (8, 6): the last digit is the minor version."""
    digits = text[2:]
    return int(digits[:-1]), int(digits[-1])


def _neighbours(low: tuple[int, int], high: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The capabilities just outside [low, high] (minor versions 0-9)."""
    below = (low[0], low[1] - 1) if low[1] else (low[0] - 1, 9)
    return below, (high[0], high[1] + 1)


_SQ = 128
_ALLOWED = {   # each kernel's check with every other constraint met (fp16, head dim 64, no mask, no dropout)
    "flash": lambda cc: _flash_ok(cc, "float16", 64, 64, 64, _SQ, _SQ, False, False, 0.0, False),
    "efficient": lambda cc: _efficient_ok(cc, "float16", 64, 64, 64),
    "cudnn": lambda cc: _cudnn_ok(cc, "float16", 64, 64, _SQ, _SQ, 0.0),
}


@pytest.mark.parametrize("kernel, start", [
    ("flash", b"Flash attention only supports gpu architectures in the range"),      # check_flash_attention_hardware_support
    ("efficient", b"Mem Efficient Attention only supports gpu architectures in the range"),
    ("cudnn", b"cuDNN MHA only supports gpu architectures in the range"),            # check_cudnn_hardware_support
])
def test_each_kernels_capability_range_is_the_installed_torchs(kernel, start):
    low, high = map(_sm, re.search(r"\[(sm\d+), (sm\d+)\]", _message(start)).groups())
    allowed = _ALLOWED[kernel]
    below, above = _neighbours(low, high)
    assert allowed(low) and allowed(high) and not allowed(below) and not allowed(above), (kernel, low, high)


def test_the_sm86_89_and_sm120_121_training_limit_is_the_installed_torchs():
    """check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training cannot use flash
    with a head dim in (192, 224], or in (224, 256] with dropout, on those capabilities."""
    text = _message(b"Flash attention currently doesn't support training with head_dim")
    text += _message(b" (192, 224] or (head_dim") + _message(b" (224, 256] and dropout > 0.0)")
    ranges = sorted({tuple(map(_sm, r)) for r in re.findall(r"(SM\d+)-(SM\d+)", text)})
    assert ranges == [((8, 6), (8, 9)), ((12, 0), (12, 1))]

    def flash(cc, d, p=0.0):
        return _flash_ok(cc, "bfloat16", d, d, d, _SQ, _SQ, False, False, p, True)
    for low, high in ranges:
        for cc in (low, high):
            assert flash(cc, 192) and not flash(cc, 200) and flash(cc, 240) and not flash(cc, 240, 0.1), cc
        for cc in _neighbours(low, high):
            if _between(cc, (8, 0), (12, 1)):
                assert flash(cc, 200) and flash(cc, 240, 0.1), cc


def test_cudnns_dropout_and_sequence_rules_are_the_installed_torchs():
    assert "multiple of 1/16" in _message(b"cuDNN dropout probability resolution is limited to 1/16")
    _message(b"cudnn SDPA does not support key/value sequence length 1.")
    _message(b"cudnn SDPA does not support query sequence length 1 with dropout.")
    h100 = (9, 0)
    assert _cudnn_ok(h100, "bfloat16", 64, 64, _SQ, _SQ, 3 / 16) and not _cudnn_ok(h100, "bfloat16", 64, 64, _SQ, _SQ, 0.1)
    assert not _cudnn_ok(h100, "bfloat16", 64, 64, _SQ, 1, 0.0)
    assert _cudnn_ok(h100, "bfloat16", 64, 64, 1, _SQ, 0.0) and not _cudnn_ok(h100, "bfloat16", 64, 64, 1, _SQ, 1 / 16)
    # check_cudnn_tensor_shapes: q / k 192 with v 128 on sm90 / sm10x (cuDNN 9.11 and up), 128 elsewhere
    _message(b"head_dim should be no more than")
    qk, v = (2, 8, 128, 192), (2, 8, 128, 128)
    got = {card: sdpa_backend(CC[card], torch.bfloat16, qk, qk, v) for card in ("A100-80GB", "L4", "H100", "B200")}
    assert got == {"A100-80GB": "efficient", "L4": "efficient", "H100": "cudnn", "B200": "cudnn"}
    assert sdpa_backend(CC["H100"], torch.bfloat16, qk, qk, qk) == "flash"      # 192 for v too: not cuDNN's pair


def test_fp8_and_cublas_defaults_are_the_installed_torchs():
    """torch._scaled_mm's capability (Blas.cpp) is gpulab's FP8_CAPABILITY; the cuBLAS workspace's
    unreadable-config fallback and the workspace-cache switch exist in this torch (docs/cards.md)."""
    caps = re.search(r">= (\d+)\.(\d+) or (\d+)\.(\d+)", _message(b"torch._scaled_mm is only supported on CUDA"))
    assert min((int(caps[1]), int(caps[2])), (int(caps[3]), int(caps[4]))) == FP8_CAPABILITY == (8, 9)
    with pytest.raises(ValueError, match="has no float8 matmul"):
        check_fp8_card("A100-80GB", "tensorwise")
    for card in ("L4", "RTX 4090", "H100", "B200"):
        check_fp8_card(card, "rowwise")
    _message(b"Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of")
    _message(b"TORCH_CUBLAS_WORKSPACE_CACHE")


def test_the_card_table_in_docs_is_what_gpulab_computes():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "cards.md").read_text()
    table = text.split("<!-- CARD_TABLE:")[1].split("<!-- CARD_TABLE_END -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]
    assert [r[0] for r in rows] == ["T4", "A100-80GB", "L4", "RTX 4090", "H100", "B200", "RTX 5090"]
    q, wide = (8, 12, 1024, 64), (8, 12, 1024, 256)
    for name, sm, *kernels, workspaces in rows:
        card = parse_gpu(name)
        cc = card.capability

        def pick(dtype, shape=q, **kw):
            return sdpa_backend(cc, dtype, shape, shape, shape, requires_grad=True, **{"is_causal": True, **kw})
        assert sm == f"{cc[0]}.{cc[1]}"
        assert kernels == [pick(torch.float32), pick(torch.float16), pick(torch.bfloat16),
                           pick(torch.bfloat16, dropout_p=0.1), pick(torch.bfloat16, is_causal=False, mask=True),
                           pick(torch.bfloat16, wide), pick(torch.bfloat16, wide, dropout_p=0.1)], name
        assert workspaces == f"{step_workspace_bytes(cc, env={}):,} B", name
