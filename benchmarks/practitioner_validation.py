"""Practitioner validation (issue 33, item 3): gpulab's answers for the runs a practitioner makes,
checked on one GPU against plain PyTorch.

The command a GPU session runs (one H100 or H200; it stops starting cases after --time-limit):

    PYTHONPATH=. python benchmarks/practitioner_validation.py --out "$OUT/practitioner" --md docs/gpu-validation.md --time-limit 520 --commit SHA; cp docs/gpu-validation.md "$OUT/practitioner/"

(``$OUT``: the folder the device machine sends back; ``SHA``: ``git rev-parse HEAD`` where the
command is prepared, since that machine's copy has no .git; the ``cp`` brings the updated doc back.
Anywhere else: ``--out DIR`` and drop the ``cp``.)

It needs torch with CUDA, transformers, peft and NVML (pynvml), and bitsandbytes for the QLoRA and
8-bit AdamW cases (without its CUDA kernels they are skipped, and said so). On an NVIDIA H100 80GB
HBM3 (2026-11-27, torch 2.11.0+cu130) the sixteen cases of that run took 209 s (147 s for the first
twelve, 37 s for the two FP8 cases, 25 s for the two T4-kernel ones); issue 48's 33 cases and 13 fit
checks are estimated from those times and the sizes at about 500 s (each case ~4-12 s with its 8 timed
steps, each fit check ~15 s, compile's inductor ~25 s): the cases run in ``CASES``' order, the most
important first (the T4 case traced, the snapshots for the lessons, the MoE and sliding-window models),
and what the time limit leaves out is reported as not run. Then the cuDNN workspace sweep
(``WORKSPACE_SWEEP``: seven ResNet-50 and VGG-16 settings, one step each on gpulab's cuda engine,
~1-2 s each, ~10 s in all) records the allocations no tensor owns for each setting, in the time left.

Options: ``--quick`` (tiny configs and small batches: what the test suite runs under the CUDA
stand-in, tests/cuda_standin.py), ``--cases a,b`` (a subset, by name), ``--case-limit S`` (seconds
one case may take before it is stopped and reported as timed out), ``--no-fit`` (leave the fit
checks out), ``--merge`` (keep the cases of OUT's earlier report, same GPU, that this run does not
run again), ``--commit SHA``. Exit status: 0 when every target passed, 1 when one was missed or
not measured, 2 without a CUDA GPU (one line on stderr).

For each case (a model from gpulab's own configs with random weights, a recipe of the one training
loop ``gpulab.training.loop.LoopRecipe``, a batch) it compares:

* the fake engine's prediction (``gpulab.step(..., engine="fake", gpu=<this device's card>)``, CUDA
  target: this device's attention kernels; the same number of steps), its events replayed as allocator blocks, with ``torch.cuda.max_memory_allocated`` of a
  PLAIN step: the model, the optimizer and a batch built and trained with plain PyTorch (no
  tracker, no dispatch mode, no hooks), the build's transients freed (``empty_cache``) and the peaks
  reset before the steps, the baseline (the cuBLAS workspaces a warm-up made) subtracted;
  target within 1%;
* the simulated reserved peak (``gpulab.predict.replay.replay_events``, allowed the device's free
  memory, where the real allocator too frees its cache and retries) with ``max_memory_reserved``;
  target within 3%;
* the predicted whole process (baseline reserved + simulated reserved + the CUDA context gpulab
  assumes, ``gpulab.predict.context``) with NVML's used memory after the steps; target within 5%;
* fit (some cases): ``gpulab.fit`` for an emulated card (T4's 14.74 GiB, 24 GiB, 40 GiB, the
  H100's 79.18 GiB: each card's memory with this device's kernels and cuBLAS workspaces), given
  the CUDA context measured here; the allocator limited by
  ``torch.cuda.set_per_process_memory_fraction`` to what that card leaves after the measured
  context; fit's batch b must run two steps and b + 1 must raise ``torch.OutOfMemoryError``;
  target: exact in at least 90% of the checks, never one batch too many; a miss says by how much.

* time (issue 48): the time model's step time (``gpulab.step(..., time=<this card's speeds>)``, the
  same fake run) beside CUDA events (``torch.cuda.Event(enable_timing=True)``) around steps 3-10 of
  the plain run (generate(): around a second call); target within ±25% in 80% of the timed cases,
  and the order of every two cases by time reported;
* the allocator's trace (``trace=True`` cases: the T4 case and its plain twin, a small Llama's step,
  a generate() at batch 4): ``torch.cuda.memory._record_memory_history`` around the measured steps,
  ``_snapshot()`` pickled under ``OUT/traces/`` with a JSON of its provenance, and the largest blocks
  alive at its peak in the report (the T4 case's beside its twin's);
* the cuDNN workspace sweep (``workspace_setting_run``): per setting, the allocator's peak beyond the
  tensors' blocks, the allocations no tensor owns (count, largest, live at the peak) and the reserved
  peak beside the simulator's replays, in the report; ``--no-sweep`` leaves it out;
* the T4 case's attention reproduced on the CPU (``t4_dropout_on_cpu``: what the math kernel saves
  in a real CPU run, a float32 dropout noise, and in gpulab's fake engine, CUDA's bool mask), in the
  report.

Each plain step is what a practitioner writes (the one loop's order, each recipe option as PyTorch's
documentation writes it: autocast, GradScaler, ``clip_grad_norm_``, micro-batches, ``save_on_cpu``,
optimizer-in-backward by ``register_post_accumulate_grad_hook``, ``torch.optim``'s ``foreach``/
``fused`` flags); the model is built as gpulab's workload builds it (transformers, peft), an
interleaved pipeline's rank by cutting the stage's model into its chunks and running torch's own
``ScheduleInterleaved1F1B`` order, FSDP2 by ``fully_shard`` in PyTorch's fake process group.

QLoRA and 8-bit AdamW run bitsandbytes itself on the GPU side (``Linear4bit``, ``AdamW8bit``):
without its CUDA kernels they are reported as skipped. torch.compile runs inductor on the GPU side,
while the fake side answers from inductor's own memory plan (``training.inductor_plan``: its graphs
lowered and scheduled for CUDA, no code generated), with the same target as the other cases.
generate() of Llama-3-8B is compared with ``gpulab.predict.generation.generation_peak`` (and
``gpulab.serve``'s figures beside it).

Each case runs under a time limit; an error or an out-of-memory in a case is that case's result
(memory freed: ``gc.collect``, ``torch.cuda.empty_cache``), never the end of the run; past the
time limit the remaining cases are reported as not run. The JSON record and the markdown go to
DIR (``practitioner-validation.json``, ``practitioner-validation.md``, rewritten after every case);
``--md FILE`` also writes the section into FILE under its own heading (between the markers
``PRACTITIONER_START`` / ``PRACTITIONER_END``, replacing an earlier one, the rest of FILE kept).
Under the stand-in the report's first line says that no GPU measured anything.

A benchmark script, not package code: it prints progress lines. It shares its helpers (checks,
table rendering, device facts, the CUDA context) with benchmarks/gpu_validation.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import pathlib
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_validation as gv  # noqa: E402  (the sibling script: shared helpers)

JSON_NAME = "practitioner-validation.json"
MD_NAME = "practitioner-validation.md"
REPORT_FORMAT = 1
STEPS = 2
TIMED_FROM, TIMED_TO = 3, 10   # the time column: CUDA events around steps 3..10 (after the measured two)
TIME_TOL = 0.25                # the time model's step time vs the CUDA events' (issue 48) ...
TIME_SHARE = 0.80              # ... in at least this share of the timed cases (24 of 30)
TIME_SPEED_CARD = "H100"       # the card the time model speaks for where this device is none gpulab knows
TRACE_DIR = "traces"           # under --out: the allocator's history of the traced cases (snapshot pickles)
TRACE_MAX_ENTRIES = 200_000
TRACE_PAIR = ("gpt2-t4-kernels-bf16", "gpt2-bf16")   # the T4 case and its plain twin, compared at their peaks
MiB, GiB = 1 << 20, 1 << 30

ALLOCATED_TOL = 0.01     # fake prediction vs max_memory_allocated
RESERVED_TOL = 0.03      # simulated reserved vs max_memory_reserved
PROCESS_TOL = 0.05       # predicted whole process vs NVML used
FIT_EXACT_SHARE = 0.90   # fit's batch exact in at least this share of the checks, never one too many
FIT_PROBES = 3           # batches tried beyond b + 1 (or below b) to say by how much fit missed

DEFAULT_TIME_LIMIT_S = 520
DEFAULT_CASE_LIMIT_S = 150
MIN_CASE_S = 10          # no case is started with less time than this left

MARK_START = "<!-- PRACTITIONER_START: written by benchmarks/practitioner_validation.py -->"
MARK_END = "<!-- PRACTITIONER_END -->"
HEADING = "## The practitioner's path (benchmarks/practitioner_validation.py)"


# ---- the cases -----------------------------------------------------------------------------------

def llama_1b_config():
    """A ~1.2B Llama-style config (Llama 3.2 1B's shapes: 16 layers, 2048 wide, GQA 32/8 heads,
    128,256 tokens, tied embeddings), random weights; positions cut to 8,192."""
    import transformers
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True)


def mixtral_small_config():
    """A small Mixtral-style mixture of experts (Mixtral 8x7B's design at 1024 wide: 8 layers, 8 experts
    of which each token uses 2, GQA 16/8 heads, 32,000 tokens), random weights: ~0.8B parameters."""
    import transformers
    return transformers.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=4096, sliding_window=None,
                                      router_aux_loss_coef=0.02, output_router_logits=False, tie_word_embeddings=False)


def gemma3_small_config():
    """A small Gemma-3-style sliding-window model (Gemma 3 1B's design at 640 wide: 12 layers, five
    sliding-window (512) layers to one global, 1 KV head of 256, its 262,144-token tied vocabulary)."""
    import transformers
    return transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                         num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                         sliding_window_pattern=6, max_position_embeddings=32768,
                                         attention_dropout=0.0)


def tiny_mixtral_config():
    import transformers
    return transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=256, sliding_window=None,
                                      output_router_logits=False, tie_word_embeddings=False)


def tiny_gemma3_config():
    import transformers
    return transformers.Gemma3TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                         query_pre_attn_scalar=16, sliding_window=16, sliding_window_pattern=2,
                                         max_position_embeddings=256)


def tiny_llama4_config():
    """tiny-llama's shapes with 4 layers (a pipeline of 2 stages × 2 chunks needs 4)."""
    import transformers
    return transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    tie_word_embeddings=False)


MODELS: dict[str, tuple[str, Callable[[], Any] | str]] = {
    # key: (what the report calls it, a gpulab model name or a function making a config)
    "gpt2": ("GPT-2 124M (hf:gpt2)", "hf:gpt2"),
    "qwen": ("Qwen2.5-0.5B (hf:qwen2.5-0.5b)", "hf:qwen2.5-0.5b"),
    "llama-1b": ("Llama-style 1.2B (Llama 3.2 1B's shapes)", llama_1b_config),
    "llama-8b": ("Llama-3-8B (hf:llama-3-8b)", "hf:llama-3-8b"),
    "resnet50": ("ResNet-50 (torchvision)", "resnet50"),
    "mixtral-small": ("Mixtral-style MoE 0.8B (8 experts, top-2)", mixtral_small_config),
    "gemma3-small": ("Gemma-3-style 0.23B (sliding window 512, 5:1)", gemma3_small_config),
    # --quick (the stand-in): tiny configs
    "tiny-gpt2": ("tiny GPT-2 (hf:tiny-gpt2)", "hf:tiny-gpt2"),
    "tiny-llama": ("tiny Llama (hf:tiny-llama)", "hf:tiny-llama"),
    "cnn": ("the lessons' small CNN (cnn)", "cnn"),
    "tiny-mixtral": ("tiny Mixtral-style MoE (4 experts, top-2)", tiny_mixtral_config),
    "tiny-gemma3": ("tiny Gemma-3-style (sliding window 16)", tiny_gemma3_config),
    "tiny-llama4": ("tiny Llama, 4 layers", tiny_llama4_config),
}


@dataclass(frozen=True)
class Case:
    """One run: a model (a key of ``MODELS``), a batch, a recipe (``options``: gpulab.step's
    recipe keywords), and the cards its fit check emulates. ``kind``: "train" or "generate"."""
    name: str
    model: str
    batch: int
    optimizer: str = "adamw"
    seq_len: int | None = None
    dtype: str | None = None            # the model's dtype (None: float32)
    options: dict[str, Any] = field(default_factory=dict)
    fit_cards: tuple[str, ...] = ()
    needs: str | None = None            # "bitsandbytes": its CUDA kernels on the GPU side
    kind: str = "train"
    prompt_len: int = 0                 # generate
    new_tokens: int = 0
    target: bool = True                 # False: the gap is reported, no target (compile)
    kernels_of: str | None = None       # another card's attention kernels: predicted for it, forced here
    trace: bool = False                 # record the allocator's history of the plain step (a snapshot pickle)
    world: int = 1                      # kind "fsdp2": the fake process group's ranks (this process rank 0)

    def recipe_text(self) -> str:
        if self.kind == "generate":
            return f"generate(): prompt {self.prompt_len:,} + {self.new_tokens:,} new tokens, {self.dtype}"
        parts = [self.optimizer, "float32" if self.dtype is None else f"pure {self.dtype}"]
        if self.kind == "fsdp2":
            parts.append(f"FSDP2 fully_shard per layer, rank 0 of {self.world} (fake process group)")
        parts += [f"{k}={v}" for k, v in self.options.items()]
        if self.kernels_of:
            parts.append(f"{self.kernels_of}'s attention kernels")
        return ", ".join(parts)


CASES: tuple[Case, ...] = (   # in the order they run: past the time limit, the last ones are not run
    # (H100 estimates, from the 2026-11-27 run's per-case times and the sizes: each case's prediction,
    # two measured steps and 8 timed ones ~4-12 s, each of the 13 fit checks ~10-15 s; ~500 s in all)
    Case("gpt2-fp32-adamw", "gpt2", 8, seq_len=1024, fit_cards=("T4",)),
    # issue 48 item 2: the T4 case and its plain twin, each with the allocator's trace
    Case("gpt2-t4-kernels-bf16", "gpt2", 8, seq_len=1024, dtype="bf16", kernels_of="T4", trace=True),
    Case("gpt2-bf16", "gpt2", 8, seq_len=1024, dtype="bf16", trace=True),
    Case("llama8b-bf16-adamw", "llama-8b", 2, seq_len=2048, dtype="bf16", fit_cards=("H100",)),
    Case("llama8b-generate", "llama-8b", 1, kind="generate", dtype="bf16", prompt_len=7936, new_tokens=256),
    # the snapshots for lessons 11 and 13: a small Llama's training step and a generate() at batch 4
    Case("llama1b-bf16-adamw", "llama-1b", 2, seq_len=1024, dtype="bf16", trace=True, fit_cards=("24GiB",)),
    Case("llama1b-generate-b4", "llama-1b", 4, kind="generate", dtype="bf16", prompt_len=2048, new_tokens=64,
         trace=True),
    Case("mixtral-moe-bf16", "mixtral-small", 4, seq_len=1024, dtype="bf16", fit_cards=("24GiB",)),
    Case("gemma3-sliding-bf16", "gemma3-small", 2, seq_len=2048, dtype="bf16", fit_cards=("24GiB",)),
    Case("qwen-ckpt-full", "qwen", 4, seq_len=2048, dtype="bf16", options={"checkpointing": "full"}),
    Case("qwen-ckpt-selective", "qwen", 4, seq_len=2048, dtype="bf16", options={"checkpointing": "selective"},
         fit_cards=("24GiB",)),
    Case("qwen-ckpt-every2", "qwen", 4, seq_len=2048, dtype="bf16", options={"checkpointing": "every-2"}),
    Case("llama1b-lora", "llama-1b", 4, seq_len=2048, dtype="bf16", options={"lora": 16}, fit_cards=("40GiB",)),
    Case("llama1b-qlora", "llama-1b", 4, seq_len=2048, dtype="bf16", options={"lora": 16, "quantize": "nf4"},
         needs="bitsandbytes"),
    Case("llama1b-qlora-no-dq", "llama-1b", 4, seq_len=2048, dtype="bf16",
         options={"lora": 16, "quantize": "nf4", "double_quant": False}, needs="bitsandbytes"),
    Case("llama1b-adamw8bit", "llama-1b", 2, optimizer="adamw8bit", seq_len=1024, dtype="bf16",
         needs="bitsandbytes"),
    Case("llama1b-paged-adamw8bit", "llama-1b", 2, optimizer="paged_adamw8bit", seq_len=1024, dtype="bf16",
         needs="bitsandbytes"),
    Case("qwen-offload", "qwen", 4, seq_len=2048, dtype="bf16", options={"offload_activations": True},
         fit_cards=("T4",)),
    Case("llama1b-pp2-interleaved", "llama-1b", 2, seq_len=2048, dtype="bf16",
         options={"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4, "pp_stage": 0}),
    Case("llama1b-fsdp2-rank0of4", "llama-1b", 2, seq_len=2048, dtype="bf16", kind="fsdp2", world=4, target=False),
    Case("qwen-chunked-loss", "qwen", 4, seq_len=2048, dtype="bf16", options={"chunked_loss": 8}, fit_cards=("T4",)),
    Case("gpt2-bf16-autocast", "gpt2", 8, seq_len=1024, options={"amp": "bf16"}),
    Case("gpt2-fp16-gradscaler", "gpt2", 8, seq_len=1024, options={"amp": "fp16", "grad_scaler": True},
         fit_cards=("T4",)),
    Case("gpt2-accumulate4-clip", "gpt2", 4, seq_len=1024, options={"accumulate": 4, "clip_grad_norm": 1.0},
         fit_cards=("T4",)),
    Case("gpt2-opt-in-backward", "gpt2", 8, seq_len=1024, options={"optimizer_in_backward": True},
         fit_cards=("T4",)),
    Case("gpt2-keep-grads", "gpt2", 8, seq_len=1024, options={"set_to_none": False}, fit_cards=("T4",)),
    Case("gpt2-adamw-for-loop", "gpt2", 8, seq_len=1024, options={"implementation": "for-loop"}),
    Case("gpt2-adamw-fused", "gpt2", 8, seq_len=1024, options={"implementation": "fused"}),
    Case("resnet50-fp32-momentum", "resnet50", 64, optimizer="momentum"),
    # a T4's attention kernels (issue 33: sm75 has no flash or cuDNN attention, and its memory-efficient
    # kernel takes no bf16): predicted for a T4, and forced on this GPU call by call (``forced_attention``)
    Case("gpt2-t4-kernels-fp16", "gpt2", 8, seq_len=1024, dtype="fp16", kernels_of="T4"),
    # torchao's float8 training (issue 35): eager Float8Linear layers, both recipes
    Case("llama1b-fp8-tensorwise", "llama-1b", 2, seq_len=2048, dtype="bf16", options={"fp8": "tensorwise"}),
    Case("llama1b-fp8-rowwise", "llama-1b", 2, seq_len=2048, dtype="bf16", options={"fp8": "rowwise"}),
    # inductor's own plan on the fake side (training.inductor_plan); the reserved peak still replays
    # the op-by-op run's events
    Case("gpt2-compile", "gpt2", 8, seq_len=1024, options={"compile": True}),
)

# --quick: the same recipes on tiny configs, small batches (the stand-in runs them in seconds)
QUICK_MODEL = {"gpt2": "tiny-gpt2", "qwen": "tiny-llama", "llama-1b": "tiny-llama", "llama-8b": "tiny-llama",
               "resnet50": "cnn", "mixtral-small": "tiny-mixtral", "gemma3-small": "tiny-gemma3"}
# "context+N": a card N larger than the CUDA context measured here (tiny runs fit there on any GPU,
# beside the cuBLAS workspaces: 65 MiB on a Hopper card)
QUICK_CARDS = {"T4": "context+100MiB", "24GiB": "context+120MiB", "40GiB": "context+140MiB", "H100": "context+160MiB"}
RELATIVE = "context+"


def quick_cases(cases: Sequence[Case] = CASES) -> list[Case]:
    """``cases`` scaled down: tiny configs (a pipeline's: 4 layers, for 2 stages of 2 chunks), batch 2 (8 for
    images), 64 positions, LoRA rank 4, small emulated cards (a few tens of MiB beyond the CUDA context measured on the device)."""
    out = []
    for c in cases:
        opts = {k: (4 if k == "lora" else v) for k, v in c.options.items()}
        quick_model = "tiny-llama4" if c.options.get("pp", 1) > 1 else QUICK_MODEL.get(c.model, c.model)
        out.append(dataclasses.replace(
            c, model=quick_model, batch=8 if c.model == "resnet50" else min(c.batch, 2),
            seq_len=None if c.seq_len is None else 64, options=opts,
            fit_cards=tuple(QUICK_CARDS.get(x, x) for x in c.fit_cards),
            prompt_len=min(c.prompt_len, 48), new_tokens=min(c.new_tokens, 4)))
    return out


# ---- cuDNN's convolution workspaces by setting (issue 48 item 3) ---------------------------------

@dataclass(frozen=True)
class WorkspaceSetting:
    """A convolution network's training step whose cuDNN workspaces the sweep records: a
    ``torchvision.models`` builder, a batch of ``image_size``² images, autocast or not, and
    ``channels_last`` (the weights converted: cuDNN then runs channels-last convolutions,
    ``cudnn_conv_suggest_memory_format``). SGD with momentum, one step, as the ResNet-50 case."""
    name: str
    model: str
    batch: int
    amp: str | None = None
    channels_last: bool = False
    image_size: int = 224


# Why a record and not a rule: with ``torch.backends.cudnn.benchmark`` off, ``Conv_v8.cpp`` asks
# cuDNN's heuristics for engine configs (``get_configs_from_heuristics``) and runs the first that
# builds and fits (``try_configs``), allocating that plan's ``getWorkspaceSize()``; which engine
# cuDNN ranks first, and its workspace, are cuDNN's (closed) answer per card, version, shape,
# dtype and layout. In the order run (the ResNet-50 case's own setting first); ~1-2 s each on an H100.
WORKSPACE_SWEEP: tuple[WorkspaceSetting, ...] = (
    WorkspaceSetting("resnet50-b64-fp32", "resnet50", 64),
    WorkspaceSetting("resnet50-b64-fp32-channels-last", "resnet50", 64, channels_last=True),
    WorkspaceSetting("resnet50-b64-bf16-autocast", "resnet50", 64, amp="bf16"),
    WorkspaceSetting("resnet50-b64-bf16-autocast-channels-last", "resnet50", 64, amp="bf16", channels_last=True),
    WorkspaceSetting("resnet50-b32-fp32", "resnet50", 32),
    WorkspaceSetting("vgg16-b16-fp32", "vgg16", 16),
    WorkspaceSetting("vgg16-b16-bf16-autocast-channels-last", "vgg16", 16, amp="bf16", channels_last=True),
)
QUICK_SWEEP: tuple[WorkspaceSetting, ...] = (   # --quick: a small ResNet on small images
    WorkspaceSetting("resnet18-b2-fp32-channels-last", "resnet18", 2, channels_last=True, image_size=32),
    WorkspaceSetting("resnet18-b2-bf16-autocast", "resnet18", 2, amp="bf16", image_size=32),
)
MIN_SWEEP_S = 5          # no sweep setting is started with less time than this left


def workspace_setting_run(setting: WorkspaceSetting) -> dict[str, Any]:
    """One setting on gpulab's cuda engine (its tracker beside the allocator's own trace): the
    allocator's peak beyond the live tensors' blocks; the allocations no tensor owns
    (``measure.non_tensor``: cuDNN's convolution workspaces on every GPU measured so far): how many,
    the largest, their bytes live at the trace's peak, by C++ site where the trace has frames; the
    real reserved peak beside the simulator's replay of the tensors alone and of the whole trace
    (the segments the workspaces add). Never raises: an error is the setting's result."""
    import torch
    import torchvision

    import gpulab
    from gpulab.predict.replay import replay_events
    out: dict[str, Any] = {k: getattr(setting, k) for k in setting.__dataclass_fields__}
    t0 = time.monotonic()
    try:
        net = getattr(torchvision.models, setting.model)()
        if setting.channels_last:
            net = net.to(memory_format=torch.channels_last)
        free_memory()
        r = gpulab.step(net, batch=setting.batch, input_shape=(3, setting.image_size, setting.image_size),
                        optimizer="momentum", engine="cuda", amp=setting.amp, steps=1, guard=False)
        m = r.measurement
        if m.engine != "cuda":
            raise RuntimeError(f"the step ran on the {m.engine} engine, not cuda")
        if m.oom:
            raise RuntimeError(f"out of memory: {m.error}")
        a, beyond = m.allocator or {}, m.beyond_tensors or {}
        nt = beyond.get("not_tensors") or {}
        out.update(tensors_peak=m.blocks.peak_bytes if m.blocks else None,
                   allocated_peak=a.get("peak_allocated_delta"), reserved_peak=a.get("peak_reserved_delta"),
                   beyond_tensors=beyond.get("bytes"), not_tensor_count=nt.get("count"),
                   not_tensor_largest=nt.get("largest_bytes"), not_tensor_at_peak=nt.get("at_peak"),
                   not_tensor_total=nt.get("total_bytes"), sites=nt.get("site_bytes") or {},
                   tensors_reserved=replay_events(m.tracking.events).peak_reserved,
                   trace_reserved=nt.get("replayed_peak_reserved"))
        del r, m
    except Exception as exc:  # noqa: BLE001 - the setting's result, the sweep goes on
        out["error"] = gv._error(exc)
    finally:
        free_memory()
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def workspace_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The sweep's table, as markdown."""
    if not rows:
        return []
    L = ["### cuDNN workspaces by setting (issue 48 item 3)", "",
         "Each setting's one training step (SGD with momentum) on gpulab's cuda engine: the allocator's peak beyond "
         "the live tensors' blocks, the allocations no tensor owns in the allocator's own trace "
         "(`gpulab.measure.non_tensor`; cuDNN's convolution workspaces on every GPU measured so far), and the real "
         "reserved peak beside the simulator's replay of the tensors alone and of the whole trace. "
         "cuDNN picks its algorithms at run time, so these figures hold for this card, cuDNN and torch only.", ""]
    head = ["setting", "tensors' peak", "allocated peak", "beyond tensors", "no tensor's: count", "largest",
            "live at the trace's peak", "reserved peak", "replayed: tensors", "replayed: whole trace", "time"]
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["name"], f"error: {r['error'].splitlines()[0]}"] + [""] * (len(head) - 2))
            continue
        body.append([r["name"], gv._mib(r.get("tensors_peak")), gv._mib(r.get("allocated_peak")),
                     gv._mib(r.get("beyond_tensors")),
                     "—" if r.get("not_tensor_count") is None else str(r["not_tensor_count"]),
                     gv._mib(r.get("not_tensor_largest")), gv._mib(r.get("not_tensor_at_peak")),
                     gv._mib(r.get("reserved_peak")), gv._mib(r.get("tensors_reserved")),
                     gv._mib(r.get("trace_reserved")), _seconds(r.get("seconds"))])
    return L + gv._table(head, body) + [""]


# ---- results -------------------------------------------------------------------------------------

@dataclass
class FitCheck:
    """One emulated card: fit's batch b, whether b ran two steps and b + 1 ran out of memory."""
    card: str
    card_bytes: int | None = None        # the card's total (what CUDA reports on it)
    context_bytes: int | None = None     # measured here, given to fit
    limit_bytes: int | None = None       # what the allocator was allowed: card - measured context
    fraction: float | None = None
    fit_batch: int | None = None
    fit_seconds: float | None = None
    predicted_reserved: dict[str, int] = field(default_factory=dict)   # fit's simulated reserved, b and b + 1 ...
    predicted_fits: dict[str, bool] = field(default_factory=dict)      # ... and whether it fitted (else: where it stopped)
    baseline_reserved: int | None = None  # inside the limit: the warm-up's workspaces' segments ...
    fit_workspace_bytes: int | None = None  # ... and the workspaces fit predicts for the card
    kernels: str = ""                     # whose kernels fit's fake runs followed
    tried: dict[str, str] = field(default_factory=dict)   # batch -> "ran" / "OOM" / "error: ..."
    real_reserved: dict[str, int] = field(default_factory=dict)   # batch -> max_memory_reserved - baseline
    real_largest: int | None = None      # the largest batch that ran, as far as the probes went
    real_largest_exact: bool = False     # False: only a bound (the probes stopped) ...
    bound: str = ""                      # ... "≥" (the last batch tried ran) or "≤" (it did not)
    verdict: str = "not measured"        # PASS, MISS ..., not emulated ..., error ...
    error: str | None = None

    @property
    def exact(self) -> bool | None:
        if self.fit_batch is None or self.real_largest is None or not self.real_largest_exact:
            return None if self.verdict.startswith(("not", "error")) else False
        return self.fit_batch == self.real_largest

    @property
    def too_many(self) -> bool:
        return self.fit_batch is not None and self.real_largest is not None and self.fit_batch > self.real_largest


@dataclass
class CaseRun:
    name: str
    model: str
    recipe: str
    batch: int
    seq_len: int | None = None
    steps: int = STEPS
    status: str = "not run"              # ran / skipped: ... / error: ... / out of memory: ... / timed out ...
    target: bool = True
    predicted_tensors: int | None = None  # the fake tracker's peak (each storage rounded to 512 B)
    predicted_allocated: int | None = None  # its events replayed as allocator blocks (from an empty cache)
    predicted_reserved: int | None = None   # the simulated allocator's reserved peak
    seeded_allocated: int | None = None     # diagnostic: the replay from the real baseline's segments
    seeded_reserved: int | None = None
    real_allocated: int | None = None     # max_memory_allocated - baseline
    real_reserved: int | None = None      # max_memory_reserved - baseline reserved
    baseline_allocated: int | None = None
    baseline_reserved: int | None = None
    free_bytes: int | None = None         # cudaMemGetInfo's free memory at the start (the replay's capacity)
    context_assumed: int | None = None
    nvml_used: int | None = None          # NVML used after the steps
    predicted_process: int | None = None  # baseline reserved + predicted reserved + assumed context
    context_now: int | None = None        # NVML used - memory_reserved after the steps
    serve: dict[str, int] | None = None   # generate: gpulab.serve's figures for the same context
    predict_seconds: float | None = None
    run_seconds: float | None = None
    predicted_step_s: float | None = None   # the time model (gpulab.step(..., time=...).time.seconds)
    real_step_s: float | None = None        # CUDA events over steps TIMED_FROM..TIMED_TO, per step
    time_note: str | None = None            # whose speeds, what was timed, or why not
    trace: dict[str, Any] | None = None     # the allocator's history: files and the tensors alive at its peak
    fit: list[FitCheck] = field(default_factory=list)
    note: str | None = None
    error: str | None = None

    @property
    def ran(self) -> bool:
        return self.status == "ran"


@dataclass
class Report:
    device: dict[str, Any]
    started: str
    quick: bool = False
    context_before: dict[str, Any] | None = None
    warm_up: dict[str, Any] | None = None
    kernels: str = ""                     # whose CUDA kernels the predictions followed
    cases: list[CaseRun] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    seconds: float | None = None
    time_limit: float | None = None
    earlier: list[str] = field(default_factory=list)   # cases kept from an earlier run (--merge)
    t4_cpu: dict[str, Any] | None = None   # the T4 case's attention on the CPU (t4_dropout_on_cpu)
    workspaces: list[dict[str, Any]] = field(default_factory=list)   # the cuDNN workspace sweep
    format: int = REPORT_FORMAT

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        r = gv.build(cls, d)
        r.cases = [gv.build(CaseRun, c) for c in d.get("cases", [])]
        for c in r.cases:
            c.fit = [gv.build(FitCheck, f) for f in c.fit]
        return r


def merge_earlier(report: Report, old: Report) -> None:
    """``report`` keeps ``old``'s cases that it did not run again (same GPU), in ``CASES``' order,
    and says which run measured them."""
    if old.device.get("gpu_name") != report.device.get("gpu_name"):
        report.not_run.append(f"the earlier report (device {old.device.get('gpu_name')}) was not merged: another device")
        return
    if not report.workspaces:
        report.workspaces = list(old.workspaces)
    mine = [c for c in report.cases if not any(c is k for k in old.cases)]   # idempotent: saved after each case
    kept = [c for c in old.cases if c.name not in {m.name for m in mine}]
    order = {c.name: i for i, c in enumerate(CASES)}
    report.cases = sorted(kept + mine, key=lambda c: order.get(c.name, len(order)))
    if not kept:
        report.earlier = list(old.earlier)
        return
    report.earlier = list(old.earlier) + [
        f"{', '.join(c.name for c in kept)}: run started {old.started} (commit "
        f"{str(old.device.get('gpulab_commit') or 'unknown')[:7]}), {old.device.get('torch')}"]


# ---- checks --------------------------------------------------------------------------------------

def allocated_check(r: CaseRun) -> gv.Check:
    return gv.Check(r.name, r.predicted_allocated, r.real_allocated, ALLOCATED_TOL)


def reserved_check(r: CaseRun) -> gv.Check:
    return gv.Check(r.name, r.predicted_reserved, r.real_reserved, RESERVED_TOL)


def process_check(r: CaseRun) -> gv.Check:
    return gv.Check(r.name, r.predicted_process, r.nvml_used, PROCESS_TOL)


def time_check(r: CaseRun) -> gv.Check:
    return gv.Check(r.name, None if r.predicted_step_s is None else int(round(r.predicted_step_s * 1e6)),
                    None if r.real_step_s is None else int(round(r.real_step_s * 1e6)), TIME_TOL)


def time_verdict(r: CaseRun) -> str:
    c = time_check(r)
    if not r.ran or c.difference is None:
        return "—"
    return ("PASS " if c.passed else "MISS by ") + gv._pct(c.difference)


def timed(report: Report) -> list[CaseRun]:
    """The cases with both a predicted and a measured (CUDA events) time."""
    return [r for r in report.cases if r.ran and r.predicted_step_s and r.real_step_s]


def time_summary(report: Report) -> tuple[str, str]:
    """(within ±25%: "PASS/MISS: n of m ...", order of two recipes by time right in "k of n pairs (x%)")."""
    cases = timed(report)
    if not cases:
        return "not measured: no GPU timed any case", "not measured: no GPU timed any case"
    inside = [r for r in cases if abs(r.predicted_step_s / r.real_step_s - 1) <= TIME_TOL]
    share = len(inside) / len(cases)
    within = (f"{'PASS' if share >= TIME_SHARE else 'MISS'}: {len(inside)} of {len(cases)} within "
              f"±{TIME_TOL:.0%} ({share:.0%})")
    right = total = 0
    for i, a in enumerate(cases):
        for b in cases[i + 1:]:
            if a.real_step_s == b.real_step_s:
                continue
            total += 1
            right += (a.predicted_step_s < b.predicted_step_s) == (a.real_step_s < b.real_step_s)
    order = (f"{right} of {total} pairs ({right / total:.0%})" if total else "no pair to order")
    return within, order


def _judged(report: Report) -> list[CaseRun]:
    return [r for r in report.cases if r.ran and r.target]


def fit_checks(report: Report) -> list[FitCheck]:
    return [f for r in report.cases for f in r.fit]


def fit_summary(checks: Sequence[FitCheck]) -> str:
    judged = [f for f in checks if f.exact is not None]
    if not judged:
        return "not measured"
    exact = [f for f in judged if f.exact]
    too_many = [f for f in judged if f.too_many]
    share = len(exact) / len(judged)
    ok = share >= FIT_EXACT_SHARE and not too_many
    text = f"{'PASS' if ok else 'MISS'}: exact in {len(exact)}/{len(judged)} ({share:.0%})"
    if too_many:
        text += f"; one batch too many or more in {', '.join(f.card for f in too_many)}"
    bad = [f"{f.card}: {f.verdict}" for f in judged if not f.exact]
    return text + (f" ({'; '.join(bad)})" if bad else "")


def summary_rows(report: Report) -> list[list[str]]:
    """[check, target, result]; a result starts with PASS, MISS or "not measured"."""
    judged = _judged(report)
    rows = [["fake prediction (CUDA target, allocator blocks) vs a plain step's `max_memory_allocated`",
             gv._target(ALLOCATED_TOL), gv._summary([allocated_check(r) for r in judged], "")[1]],
            ["simulated reserved vs `max_memory_reserved`", gv._target(RESERVED_TOL),
             gv._summary([reserved_check(r) for r in judged], "")[1]],
            ["predicted whole process (reserved + assumed CUDA context) vs NVML used", gv._target(PROCESS_TOL),
             gv._summary([process_check(r) for r in judged], "")[1]]]
    within, order = time_summary(report)
    rows.append([f"the time model's step time vs CUDA events (steps {TIMED_FROM}–{TIMED_TO})",
                 f"within ±{TIME_TOL:.0%} in ≥{TIME_SHARE:.0%}", within])
    rows.append(["the order of two recipes by time (every pair of timed cases)", gv.NO_TARGET, order])
    fits = fit_checks(report)
    if fits:
        rows.append(["fit's batch on emulated cards (b runs two steps, b + 1 is out of memory)",
                     f"exact in ≥{FIT_EXACT_SHARE:.0%}, never one too many", fit_summary(fits)])
    gaps = [r for r in report.cases if r.ran and not r.target]
    for r in gaps:
        rows.append([f"{r.name}: {r.note or 'gap'}", gv.NO_TARGET,
                     f"allocated {gv._pct(allocated_check(r).difference)}, reserved {gv._pct(reserved_check(r).difference)}"])
    bad = [r for r in report.cases if not r.ran and not r.status.startswith("skipped")]
    skipped = [r for r in report.cases if r.status.startswith("skipped")]
    ran = [r for r in report.cases if r.ran]
    rows.append(["cases", "every case runs",
                 ("PASS" if not bad and not report.not_run else "MISS")
                 + f": {len(ran)} ran, {len(skipped)} skipped, {len(bad)} failed"
                 + (f" ({'; '.join(f'{r.name}: {r.status}' for r in bad)})" if bad else "")
                 + (f"; not run: {len(report.not_run)}" if report.not_run else "")])
    ctx = report.context_before or {}
    rows.append(["CUDA context (NVML used − `memory_reserved`, before the cases)", gv.NO_TARGET,
                 gv._mib(ctx.get("bytes")) if ctx.get("bytes") is not None else ctx.get("label", "not measured")])
    return rows


def missed(report: Report) -> list[str]:
    return [check for check, target, result in summary_rows(report)
            if target != gv.NO_TARGET and result.startswith(("MISS", "not measured"))]


# ---- the report (pure: data -> markdown) ---------------------------------------------------------

def render(report: Report) -> str:
    """The practitioner section as markdown. Under the stand-in its first line says that no GPU
    measured anything."""
    dev = report.device
    stand_in = gv.is_stand_in(dev)
    if stand_in:
        L = [f"{HEADING.replace('## ', '## NO GPU MEASURED ANYTHING HERE (stand-in, not a GPU): ')}", "",
             "**This section comes from the test suite's CUDA stand-in (tests/cuda_standin.py: meta tensors, "
             "gpulab's own allocator simulator behind torch.cuda's counters, tiny configs with --quick). "
             "No GPU measured any figure below; it checks the script, not gpulab.**", ""]
    else:
        L = [HEADING, ""]
    L += gv.device_lines(dev) + [""]
    L += [f"Generated by `benchmarks/practitioner_validation.py`{' --quick' if report.quick else ''} "
          f"(started {report.started}); do not edit by hand. Raw figures: `{JSON_NAME}` in the run's `--out` folder.",
          ""]
    L += ["### Summary", ""] + gv._table(["check", "target", "result"], summary_rows(report)) + [""]
    if report.not_run:
        L += ["Not run: " + "; ".join(report.not_run) + ".", ""]
    L += ["### Each case against a plain PyTorch step", "",
          f"*predicted*: `gpulab.step(..., engine=\"fake\", steps={STEPS})` (fake tensors, the CUDA kernels of "
          f"{report.kernels or 'the device'}), its "
          "events replayed through gpulab's allocator simulator from an empty cache (allocated: blocks; reserved: "
          "segments, the simulator allowed the device's free memory as the real allocator is). *real*: the same model, optimizer and batch built and trained with plain PyTorch, no tracker, "
          f"{STEPS} steps, after the build's transients were freed (`empty_cache`) and the peaks reset: "
          "`max_memory_allocated` / `max_memory_reserved` minus the baseline (the warm-up's cuBLAS workspaces). "
          "*process*: baseline reserved + simulated reserved + the assumed CUDA context, vs NVML used after "
          f"the steps. Targets: allocated {gv._target(ALLOCATED_TOL)}, reserved {gv._target(RESERVED_TOL)}, "
          f"process {gv._target(PROCESS_TOL)}.", ""]
    rows = []
    for r in report.cases:
        a, res, p = allocated_check(r), reserved_check(r), process_check(r)
        verdict = (lambda c: c.verdict if r.target else f"gap {gv._pct(c.difference)} (no target)")
        rows.append([r.name, r.model, r.recipe, r.batch, r.seq_len or "—", r.status,
                     gv._mib(r.predicted_allocated), gv._mib(r.real_allocated), verdict(a) if r.ran else "—",
                     gv._mib(r.predicted_reserved), gv._mib(r.real_reserved), verdict(res) if r.ran else "—",
                     gv._mib(r.predicted_process), gv._mib(r.nvml_used), verdict(p) if r.ran else "—",
                     _seconds(r.predicted_step_s),
                     "not measured on a GPU" if stand_in and r.ran else _seconds(r.real_step_s),
                     time_verdict(r),
                     "—" if r.predict_seconds is None else f"{r.predict_seconds:.1f}",
                     "—" if r.run_seconds is None else f"{r.run_seconds:.1f}"])
    L += gv._table(["case", "model", "recipe", "batch", "seq", "result", "predicted allocated",
                    "real allocated", "verdict", "predicted reserved", "real reserved", "verdict",
                    "predicted process", "NVML used", "verdict", "predicted time", "real time",
                    "time verdict", "predict s", "run s"], rows) + [""]
    L += [f"*time*: the time model's step time (`gpulab.step(..., time=<this card's speeds>).time.seconds`, "
          f"the fake run's last step; {TIME_SPEED_CARD}'s speeds where the device is no card gpulab knows) beside "
          f"CUDA events (`torch.cuda.Event(enable_timing=True)`) around steps {TIMED_FROM}–{TIMED_TO} of the plain "
          "run, per step (generate(): a whole second call); target "
          f"{gv._target(TIME_TOL)} in ≥{TIME_SHARE:.0%} of the timed cases."
          + (" **Under the stand-in no time was measured on a GPU.**" if stand_in else ""), ""]
    notes = [f"- {r.name}: {r.note}" for r in report.cases if r.note]
    notes += [f"- {r.name}: {r.error}" for r in report.cases if r.error]
    if notes:
        L += ["Notes and errors:", ""] + notes + [""]
    diag = [r for r in report.cases if r.seeded_allocated is not None]
    if diag:
        L += ["Diagnostic (no target): the same replay started from the real baseline's segments "
              "(`torch.cuda.memory_snapshot()`), and the fake tracker's own peak (each storage rounded to 512 B).", ""]
        L += gv._table(["case", "fake tracker peak", "seeded allocated", "diff", "seeded reserved", "diff",
                        "baseline allocated", "baseline reserved", "context after (NVML − reserved)"],
                       [[r.name, gv._mib(r.predicted_tensors), gv._mib(r.seeded_allocated),
                         gv._pct(gv.Check("", r.seeded_allocated, r.real_allocated, 0).difference),
                         gv._mib(r.seeded_reserved),
                         gv._pct(gv.Check("", r.seeded_reserved, r.real_reserved, 0).difference),
                         gv._mib(r.baseline_allocated), gv._mib(r.baseline_reserved), gv._mib(r.context_now)]
                        for r in diag]) + [""]
    traced = [r for r in report.cases if r.trace]
    if traced:
        L += ["### The allocator's trace (issue 48 item 2)", "",
              "`torch.cuda.memory._record_memory_history(stacks='python')` around the plain run, then "
              "`torch.cuda.memory._snapshot()` pickled (open it at https://pytorch.org/memory_viz), a JSON of its "
              "provenance beside it. Replayed (`alloc` / `free_completed`): the peak of the blocks the trace saw "
              "(the warm-up's workspaces before it are not in it) and the largest blocks alive there, with the "
              "innermost frames outside torch that allocated them.", ""]
        for r in traced:
            t = r.trace
            L += [f"**{r.name}** (`{t.get('file')}`, {t.get('events', 0):,} events): peak {gv._mib(t.get('peak_bytes'))}, "
                  f"{t.get('alive_at_peak', 0):,} blocks alive there; the largest:", ""]
            L += gv._table(["bytes", "allocated at"], [[gv._mib(x["bytes"]), x["where"]] for x in t.get("largest", [])]) + [""]
        pairs = [(a, b) for a in traced for b in traced if a is not b and a.name == TRACE_PAIR[0] and b.name == TRACE_PAIR[1]]
        for a, b in pairs:
            diff = trace_difference(a.trace, b.trace)
            L += [f"Alive at the peak in {a.name} beyond {b.name} (by block size; negative: more in {b.name}):", ""]
            L += (gv._table(["block", "how many more", "bytes"],
                            [[gv._mib(d["bytes"]), d["more"], gv._signed_bytes(d["bytes"] * d["more"])] for d in diff])
                  if diff else ["None: the same blocks are alive at both peaks."]) + [""]
    L += t4_cpu_lines(report.t4_cpu)
    L += workspace_lines(report.workspaces)
    gen = [r for r in report.cases if r.serve]
    for r in gen:
        L += [f"{r.name}: `gpulab serve` for the same context: " + ", ".join(
            f"{k.replace('_', ' ')} {gv._mib(v)}" for k, v in r.serve.items()) + ".", ""]
    fits = [(r, f) for r in report.cases for f in r.fit]
    if fits:
        L += ["### Fit on emulated cards", "",
              "The allocator limited (`torch.cuda.set_per_process_memory_fraction`) to the card's total less the "
              "CUDA context measured here (NVML used − `memory_reserved`); `gpulab.fit(card, context_bytes=<that "
              "context>)` for the card's memory with this device's kernels (its compute capability: attention "
              "kernel, cuBLAS workspaces). The limit also holds the segments the process already reserved (the "
              "warm-up's cuBLAS workspaces), which fit predicts itself (its workspaces beside them). Plain steps at "
              "fit's batch b (must run two steps) and b + 1 (must raise `torch.OutOfMemoryError`, caught, memory "
              f"freed); further batches only to say by how much a miss missed (at most {FIT_PROBES}). Fit's "
              "simulated reserved peaks at b and b + 1 and the real runs' reserved peaks (above the held "
              "segments) are beside it.", ""]
        L += gv._table(["case", "card", "card total", "context (measured)", "allocator limit",
                        "… of it held before (workspaces)", "fit's workspaces", "fit's batch",
                        "fit's reserved at b, b + 1",
                        "batches tried (real reserved)", "real largest", "verdict"],
                       [[r.name, f.card, gv._mib(f.card_bytes), gv._mib(f.context_bytes), gv._mib(f.limit_bytes),
                         gv._mib(f.baseline_reserved), gv._mib(f.fit_workspace_bytes),
                         "—" if f.fit_batch is None else f.fit_batch,
                         "; ".join(f"{b}: {gv._mib(v)}" + ("" if f.predicted_fits.get(b, True) else " (out of memory there)")
                                   for b, v in f.predicted_reserved.items()) or "—",
                         "; ".join(f"{b}: {t}" + (f" ({gv._mib(f.real_reserved[b])})" if b in f.real_reserved else "")
                                   for b, t in f.tried.items()) or "—",
                         "—" if f.real_largest is None else (f"{f.real_largest}" if f.real_largest_exact
                                                             else f"{f.bound} {f.real_largest}"),
                         f.verdict] for r, f in fits]) + [""]
    if report.earlier:
        L += ["Merged (`--merge`) with an earlier run of this script on the same GPU: " + "; ".join(report.earlier)
              + ". The time below is this run's.", ""]
    if report.seconds is not None:
        L += [f"The practitioner validation took {report.seconds:.0f} s"
              + (f" (time limit {report.time_limit:.0f} s)." if report.time_limit else ".")]
    return "\n".join(L).rstrip() + "\n"


def t4_cpu_lines(t: dict[str, Any] | None) -> list[str]:
    """The T4 case's attention reproduced on the CPU (``t4_dropout_on_cpu``), as markdown."""
    if not t:
        return []
    L = ["### The T4 case on the CPU (issue 48 item 2)", ""]
    if "error" in t:
        return L + [f"Not reproduced: {t['error'].splitlines()[0]}", ""]

    def sq(key):
        return ", ".join(f"{x['dtype']} {'×'.join(map(str, x['shape']))}" for x in t.get(f"{key}_square", [])) or "none"
    L += [f"bf16 `F.scaled_dot_product_attention` with dropout {t['dropout_p']} at {'×'.join(map(str, t['size']))} "
          "(batch × heads × positions × head dim), the math kernel forced (`sdpa_kernel(SDPBackend.MATH)`), its "
          "tensors saved for backward (`saved_tensors_hooks`), measured on the CPU:", "",
          f"- real CPU run (`allowFP16BF16ReductionMathSDP` off, PyTorch's default: the math path upcasts to float32): "
          f"s×s tensors saved: {sq('cpu')};",
          f"- gpulab's fake engine for a T4 (its math kernel, `aten::_scaled_dot_product_attention_math`): {sq('fake_t4')};",
          "- with the reduction allowed the same tensors are saved in " +
          ", ".join(sorted({x['dtype'] for x in t.get('cpu_reduction_allowed', [])})) + ";",
          "- `F.dropout` under the same fake engine saves: " +
          ", ".join(f"{x['dtype']} {'×'.join(map(str, x['shape']))}" for x in t.get("fake_f_dropout", [])) + ".", "",
          "`at::dropout` (aten/src/ATen/native/Dropout.cpp) runs `native_dropout` (output and a bool mask, saved) only "
          "for a CUDA input (`is_fused_kernel_acceptable`); a CPU input goes through `_dropout_impl`, whose noise "
          "tensor has the input's dtype (here float32) and is saved by `mul`. The math composite calls `at::dropout` "
          f"from C++: the CPU run keeps {t.get('cpu_excess_per_element', 0):g} bytes an s×s element more than CUDA, "
          f"{gv._mib(t.get('excess_per_layer_at_full_bytes'))} a layer for GPT-2 at 8 × 1024 (12 heads), the size "
          "of the T4 case's over-prediction per layer on the H100 run of 2026-11-27 (docs/validation.md). "
          "gpulab's fake engine now registers CUDA's choice on `aten::dropout` itself "
          "(`measure.fake_cuda._cuda_dropout_op`) and keeps "
          f"{t.get('fake_t4_excess_per_element', 0):g} bytes more. The GPU trace of gpt2-t4-kernels-bf16 and "
          "gpt2-bf16 above says whether that was the whole difference.", ""]
    return L


def _seconds(x: float | None) -> str:
    return "—" if x is None else (f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")


def insert_section(text: str, section: str) -> str:
    """``text`` (a markdown file) with the practitioner section between its markers: an earlier
    one replaced, else appended; the rest kept as it was."""
    block = f"{MARK_START}\n{section.rstrip()}\n{MARK_END}\n"
    start, end = text.find(MARK_START), text.find(MARK_END)
    if start >= 0 and end > start:
        rest = text[end + len(MARK_END):].lstrip("\n")
        return text[:start] + block + ("\n" + rest if rest else "")
    return (text.rstrip() + "\n\n" if text.strip() else "") + block


def write_report(report: Report, out: pathlib.Path, md: pathlib.Path | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report.as_dict(), indent=1, sort_keys=True, default=str) + "\n")
    text = render(report)
    (out / MD_NAME).write_text(text)
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(insert_section(md.read_text() if md.exists() else "", text))
    return text


# ---- measuring: helpers --------------------------------------------------------------------------

class CaseTimeout(BaseException):
    """A case ran past its time limit (a BaseException, so library code catching Exception does
    not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``CaseTimeout`` inside the block after ``seconds`` (SIGALRM; only in the main
    thread, and only where no earlier alarm, such as pytest-timeout's, would come first)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    old_left, _ = signal.getitimer(signal.ITIMER_REAL)
    if old_left and old_left < seconds:
        yield
        return

    def _raise(signum, frame):
        raise CaseTimeout(f"stopped after {seconds:.0f} s (the case's time limit)")

    t0 = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_left:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, old_left - (time.monotonic() - t0)))


def free_memory() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _short(exc: BaseException) -> str:
    text = gv._error(exc)
    return text.split("\n")[0][:300]


def is_oom(exc: BaseException) -> bool:
    import torch
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError   # torch.OutOfMemoryError: 2.5+
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def warm_up() -> dict[str, Any]:
    """The allocations a process makes once (cuBLAS's workspaces: one per handle and stream, the
    forward's thread and autograd's), made now so that every case's baseline holds them."""
    import torch
    before = torch.cuda.memory_allocated()
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 64, device="cuda", dtype=dt, requires_grad=True)
        lin = torch.nn.Linear(64, 64, device="cuda", dtype=dt)
        lin(x).sum().backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin.float()(x.float()).sum().backward()
        del x, lin
    free_memory()
    return {"kept_bytes": torch.cuda.memory_allocated() - before, "reserved_bytes": torch.cuda.memory_reserved()}


_BNB: dict[str, str | None] = {}


def bitsandbytes_cuda() -> str | None:
    """None when bitsandbytes' CUDA kernels run here, else why not (asked once a process)."""
    if "answer" not in _BNB:
        _BNB["answer"] = _probe_bitsandbytes()
    return _BNB["answer"]


def _probe_bitsandbytes() -> str | None:
    import torch
    try:
        import bitsandbytes.functional as F
        x = torch.ones(64, device="cuda", dtype=torch.bfloat16)
        q, _state = F.quantize_4bit(x, quant_type="nf4")
        if q.device.type != "cuda":
            return "bitsandbytes CUDA kernels absent"
        torch.cuda.synchronize()
        return None
    except Exception:  # noqa: BLE001 - any failure: no kernels to use
        return "bitsandbytes CUDA kernels absent"


def model_arg(case: Case):
    label, model = MODELS[case.model]
    return label, (model() if callable(model) else model)


def _step_options(case: Case) -> dict[str, Any]:
    return dict(case.options)


def device_card():
    """The card this device is (``gpulab.predict.cards``, by the name CUDA gives it), with the
    compute capability CUDA reports: the kernels every prediction here follows. None when gpulab
    does not know the name (the stand-in): predictions then follow gpulab's default (sm80 rules)."""
    import torch
    from gpulab.predict.cards import parse_gpu
    try:
        card = parse_gpu(torch.cuda.get_device_name(0))
    except ValueError:
        return None
    cc = tuple(torch.cuda.get_device_capability(0))
    if getattr(card, "capability", cc) != cc:
        card = dataclasses.replace(card, capability=cc)
    return card


def emulated_card(name: str, device, context: int):
    """The card a fit check asks about: ``name``'s memory (``"context+N"``: the measured context
    plus N) with this device's kernels and cuBLAS workspaces, which the emulated run has."""
    from gpulab.predict.cards import parse_gpu
    if name.startswith(RELATIVE):   # --quick: the context measured here + a small size
        card = parse_gpu(f"{(context + parse_gpu(name[len(RELATIVE):]).reported_total_bytes) // 1024}KiB")
    else:
        card = parse_gpu(name)
    if device is not None and hasattr(card, "capability") and card.capability != device.capability:
        card = dataclasses.replace(card, name=f"{card.name}-sized {device.name}", aliases=(),
                                   capability=device.capability)
    return card


def _gpu_keyword(fn, device) -> dict[str, Any]:
    """``gpu=device`` for a prediction that takes the card whose kernels it follows."""
    import inspect
    return {"gpu": device} if device is not None and "gpu" in inspect.signature(fn).parameters else {}


# ---- the prediction (fake engine, CUDA target) ---------------------------------------------------

def time_speed(device):
    """The speeds the time model answers for: this device's card, or ``TIME_SPEED_CARD`` where gpulab
    does not know the device (the stand-in)."""
    from gpulab.predict.card_speeds import speed_of
    return speed_of(device if device is not None else TIME_SPEED_CARD)


def predict(case: Case, model, device=None) -> dict[str, Any]:
    """The fake engine's answer for the case, following ``device``'s kernels (``device_card``):
    tracker peak, blocks, and its events (replayed for the reserved peak by ``simulated_reserved``,
    once the device's free memory is known); and the time model's step time on ``device``'s speeds
    (``step_s``, ``time_note``) from the same fake run. ``fsdp2``: the one-GPU run made one rank's by
    gpulab's FSDP2 model (``predict.sharding.per_rank``, as ``gpulab.fit --gpus N --strategy fsdp2``)."""
    import gpulab
    from gpulab.measure.engines import allocator_blocks
    if case.kind == "generate":
        from gpulab.measure.cuda_card import kernel_target
        from gpulab.predict.generation import generation_peak
        with kernel_target(getattr(device, "kernel_target", None)):
            g = generation_peak(model, prompt_len=case.prompt_len, new_tokens=case.new_tokens, batch=case.batch,
                                dtype=case.dtype or "bf16")
        return {"tensors": g.peak_bytes, "allocated": g.peak_bytes, "events": g.measurement.tracking.events,
                "step_s": None, "time_note": "no time model for generate() (gpulab.predict.timing times training steps)"}
    speed = time_speed(device)
    if case.kernels_of:
        from gpulab.predict.cards import parse_gpu
        device = parse_gpu(case.kernels_of)
    kwargs = dict(batch=case.batch, seq_len=case.seq_len, optimizer=case.optimizer, steps=STEPS, engine="fake",
                  dtype=case.dtype, guard=False, **_step_options(case), **_gpu_keyword(gpulab.step, device))
    note = f"predicted (roofline, {speed.name})"
    try:
        res = gpulab.step(model, time=speed, **kwargs)
    except (TypeError, NotImplementedError, RuntimeError) as exc:   # the time model cannot time it: memory alone
        res, note = gpulab.step(model, **kwargs), f"no time prediction: {_short(exc)}"
    m = res.measurement
    if m.oom:
        raise RuntimeError(f"the fake run ran out of memory: {m.error}")
    t = m.tracking
    if case.kind == "fsdp2":
        t = fsdp2_rank(case, model, t)
        note += "; the one-GPU step's time (the fake process group moves no data)"
    events = t.events
    step_time = getattr(res, "time", None)
    planned = getattr(res, "inductor_peak_bytes", None)   # compile: inductor's own plan (the op-by-op run bounds it)
    return {"tensors": t.peak_bytes if case.kind == "fsdp2" else planned or res.peak_bytes,
            "allocated": planned or allocator_blocks(events).peak_bytes, "events": events,
            "step_s": None if step_time is None else float(step_time.seconds), "time_note": note}


def fsdp2_rank(case: Case, model, tracking):
    """``tracking`` (a one-GPU fake run) as rank 0 of ``case.world`` holds it under FSDP2, by gpulab's
    own rule (``gpulab.predict.fit._sharding``, what ``gpulab fit --gpus N --strategy fsdp2`` answers)."""
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.fit import _sharding
    from gpulab.training.loop import user_recipe
    from gpulab.units import parse_dtype
    w = resolve_workload(model, batch=case.batch, seq_len=case.seq_len)
    dt = parse_dtype(case.dtype) if case.dtype else None
    import torch
    _, one_rank = _sharding(w, user_recipe(case.optimizer), dt or torch.float32, case.world, "fsdp2", False)
    return one_rank(tracking)


def simulated_reserved(events, capacity: int | None) -> tuple[int, bool]:
    """The simulated allocator's reserved peak for ``events`` from an empty cache, allowed
    ``capacity`` bytes (the device's free memory: past it the allocator frees its cached blocks and
    retries, as the real one does before it gives up); (peak, False) when even that does not fit,
    the peak then from a replay without a limit."""
    from gpulab.allocator.simulator import SimulatedOutOfMemoryError
    from gpulab.predict.replay import replay_events
    try:
        return replay_events(events, capacity_bytes=capacity).peak_reserved, True
    except SimulatedOutOfMemoryError:
        return replay_events(events).peak_reserved, False


# ---- the plain step (no tracker, no dispatch mode, no hooks) -------------------------------------

def _bnb_qlora_model(w, case: Case, dtype, device):
    """The QLoRA model as a practitioner builds it on the GPU: every linear layer but the head
    replaced by bitsandbytes' ``Linear4bit`` (NF4, double quantization unless the case's
    ``double_quant`` is False: ``compress_statistics``, computing in ``dtype``,
    quantized as it moves to the GPU), then peft's LoRA adapters (gpulab's ``wrap_lora``: the same
    rank, layers and dropout as the prediction)."""
    import bitsandbytes as bnb
    import torch
    from gpulab.models.lora import default_targets, wrap_lora
    double = case.options.get("double_quant", True)
    with torch.device(device):
        model = w.make(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=dtype, compress_statistics=double, quant_type="nf4",
                                      device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False,
                                             compress_statistics=double, quant_type="nf4").to(device)
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q)
                del child
    opts = case.options
    return wrap_lora(model, opts["lora"], opts.get("lora_targets") or default_targets(w.config),
                     task_type="CAUSAL_LM", dropout=opts.get("lora_dropout", 0.0))


@contextlib.contextmanager
def forced_attention(card_name: str | None):
    """``F.scaled_dot_product_attention`` on this GPU with the kernel ``card_name``'s GPU would pick
    for each call (``gpulab.measure.fake_cuda.cuda_sdpa_backend`` at that card's capability, the
    rules the prediction follows), forced with ``torch.nn.attention.sdpa_kernel``; yields the count
    of each kernel used. A plain function in place of the attribute, no dispatch mode; nothing
    without ``card_name``."""
    import collections

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    used: collections.Counter = collections.Counter()
    if not card_name:
        yield used
        return
    from gpulab.measure.fake_cuda import cuda_sdpa_backend
    from gpulab.predict.cards import parse_gpu
    cc = parse_gpu(card_name).capability
    kernels = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        name = cuda_sdpa_backend(query, key, value, attn_mask, bool(is_causal), dropout_p, capability=cc)
        used[name] += 1
        with sdpa_kernel(kernels[name]):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield used
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


# torch.optim's classes as a practitioner names them (hyper-parameters do not change memory, but
# momentum decides whether SGD keeps a buffer); ``implementation`` as torch's flags
_TORCH_OPTIMIZERS = {"sgd": ("SGD", {"lr": 0.01}), "momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
                     "adam": ("Adam", {"lr": 1e-3}), "adamw": ("AdamW", {"lr": 1e-3}),
                     "adafactor": ("Adafactor", {"lr": 1e-2})}
_IMPL_FLAGS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _plain_optimizer(case: Case, params):
    """The optimizer as a practitioner writes it: ``torch.optim.<Class>(params, lr=..., foreach=...)``,
    or bitsandbytes' ``AdamW8bit`` / ``PagedAdamW8bit``."""
    import torch
    if case.optimizer in ("adamw8bit", "paged_adamw8bit"):
        import bitsandbytes as bnb
        cls = bnb.optim.PagedAdamW8bit if case.optimizer == "paged_adamw8bit" else bnb.optim.AdamW8bit
        return cls(params, lr=1e-3)
    name, kw = _TORCH_OPTIMIZERS[case.optimizer]
    return getattr(torch.optim, name)(params, **kw, **_IMPL_FLAGS[case.options.get("implementation", "default")])


def _fp8_model(net, recipe: str):
    """torchao's float8 training as its README converts a model: every linear layer whose dims divide
    by 16, the output head kept in high precision."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None

    def keep(m, fqn):
        return m is not head and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0
    return convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)


def _batch(data) -> tuple[tuple, dict[str, Any], Any]:
    """(positional inputs, keyword inputs, class labels or None) of a batch made by the case's model
    (``w.inputs``: token ids and labels for a language model, images and ``_labels`` for a classifier)."""
    args, kwargs = data
    return args, {k: v for k, v in kwargs.items() if k != "_labels"}, kwargs.get("_labels")


def _plain_loss(output, labels):
    """The loss as a practitioner takes it: a transformers model's own (``labels`` passed in), or
    ``F.cross_entropy`` of an image classifier's logits against its labels."""
    import torch
    if labels is not None:
        return torch.nn.functional.cross_entropy(output, labels)
    return output.loss


class StepClock:
    """CUDA events around steps ``TIMED_FROM``..``last`` of a plain run (``TIMED_TO``; the stand-in,
    which times nothing on a GPU, runs one timed step to check the code): ``seconds`` per step."""

    def __init__(self, last: int = TIMED_TO) -> None:
        import torch
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.last = last
        self.steps = last - TIMED_FROM + 1
        self.seconds: float | None = None

    def at(self, step: int) -> None:
        """Call before step ``step`` (1-based) and once more with ``last + 1`` after the last."""
        if step == TIMED_FROM:
            self.start.record()
        elif step == self.last + 1:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3 / self.steps


def plain_train(case: Case, model, batch: int, stand_in: bool, after_build: Callable[[], None],
                measured: Callable[[], None] | None = None, clock: StepClock | None = None) -> None:
    """``STEPS`` training steps of ``case`` at ``batch`` in plain PyTorch on ``cuda``: model,
    optimizer, one batch, then zero_grad / forward / backward / step (the one loop's order:
    ``zero_grad(set_to_none=True)`` at the top of every step from the second on), each recipe option
    as PyTorch's own documentation writes it: ``torch.autocast``, ``torch.amp.GradScaler`` (scale,
    unscale_, clip, step, update), ``clip_grad_norm_``, micro-batches with the loss divided,
    ``torch.autograd.graph.save_on_cpu``, optimizer-in-backward by ``register_post_accumulate_grad_hook``
    (PyTorch's tutorial), ``zero_grad(set_to_none=False)``. ``after_build()`` is called once the model
    exists (frees transients, resets the peaks); with ``clock``, ``measured()`` after the measured steps,
    then the steps up to ``clock.last`` run under the clock's CUDA events."""
    import torch
    from gpulab.models.workload import resolve_workload
    from gpulab.training.chunked_loss import chunked_lm_loss
    from gpulab.training.loop import recipe_workload, user_recipe
    opts = _step_options(case)
    amp = opts.pop("amp", None)
    chunks = opts.pop("chunked_loss", 0)
    compiled = opts.pop("compile", False)
    accumulate = opts.pop("accumulate", 1)
    clip = opts.pop("clip_grad_norm", None)
    scaled = opts.pop("grad_scaler", False)
    set_to_none = opts.pop("set_to_none", True)
    in_backward = opts.pop("optimizer_in_backward", False)
    offload = opts.pop("offload_activations", False)
    fp8 = opts.pop("fp8", None)
    opts.pop("implementation", None)
    w = resolve_workload(model, batch=batch, seq_len=case.seq_len)
    dev = torch.device("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[case.dtype]
    torch.manual_seed(0)
    if opts.get("quantize"):
        net = _bnb_qlora_model(w, case, dt or torch.float32, dev)
    else:   # LoRA and checkpointing as the prediction's workload builds them (peft, transformers)
        recipe = user_recipe("adamw", **opts)
        net = recipe_workload(w, recipe).build(dev, dt)
    if fp8:
        net = _fp8_model(net, fp8)
    params = [p for p in net.parameters() if p.requires_grad]
    if in_backward:   # PyTorch's "How to save memory by fusing the optimizer step into the backward pass"
        per_param = {p: _plain_optimizer(case, [p]) for p in params}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=set_to_none)
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        opt = None
    else:
        opt = _plain_optimizer(case, params)
    run_net = net
    with torch.device(dev):
        data = w.inputs(batch, dt)
    args, inputs, labels = _batch(data)
    autocast = (lambda: torch.autocast("cuda", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[amp])) \
        if amp else contextlib.nullcontext
    saving = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=not stand_in)) if offload else contextlib.nullcontext
    scaler = torch.amp.GradScaler("cuda") if scaled else None
    if compiled:   # inductor on a GPU; the stand-in's meta tensors cannot run generated code
        torch._dynamo.reset()
        run_net = torch.compile(net, backend="aot_eager_decomp_partition" if stand_in else "inductor")
        with autocast():
            loss = _plain_loss(run_net(*args, **inputs), labels)
        loss.backward()
        del loss
        net.zero_grad(set_to_none=True)
    after_build()
    for i in _plain_steps(clock, measured):
        if i and opt is not None:
            opt.zero_grad(set_to_none=set_to_none)
        for _ in range(accumulate):
            with autocast(), saving():
                if chunks:
                    loss = chunked_lm_loss(net, data, chunks)
                else:
                    output = run_net(*args, **inputs)
                    loss = _plain_loss(output, labels)
                    del output
                if accumulate > 1:
                    loss = loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        if opt is None:
            continue
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    torch.cuda.synchronize()
    if in_backward:
        for h in handles:
            h.remove()


def _plain_steps(clock, measured: Callable[[], None] | None):
    """The step indices of a plain run. Without ``clock``: the ``STEPS`` measured steps. With it:
    ``measured()`` once the measured steps are done, every step marked for the CUDA events, and the
    end of the last marked when the caller's loop is through (the generator's trailer)."""
    for i in range(clock.last if clock is not None else STEPS):
        if clock is not None:
            if i == STEPS and measured is not None:
                measured()
            clock.at(i + 1)
        yield i
    if clock is not None:
        clock.at(clock.last + 1)


def _stage_model(case: Case, model, dt, dev):
    """The rank's modules of an interleaved pipeline, as a one-process run cuts them (torchtitan's way:
    build the stage's depth, then drop what the stage does not hold): rank ``pp_stage`` of ``pp`` holds
    chunks ``c`` = virtual stages ``c·pp + rank`` of ``pp·V``, each ``layers / (pp·V)`` decoder layers; the
    embedding on virtual stage 0, the norm, head and loss on the last. Returns (chunks by virtual
    stage: a module running them, whether it is the first, the last), the parameters."""
    import copy

    import torch
    from gpulab.models import hf_configs
    o = case.options
    pp, v_count, rank = o["pp"], o.get("virtual_stages", 1), o.get("pp_stage", 0)
    config, _ = hf_configs.config_and_name(model)
    config = copy.deepcopy(config)
    config.num_hidden_layers //= pp
    with torch.device(dev):
        full = hf_configs.build_causal_lm(config, dt)
    base = full.model
    n = len(base.layers) // v_count
    chunks = {}
    for c in range(v_count):
        v = c * pp + rank
        part = copy.copy(base)
        part._modules = dict(base._modules)
        part.layers = torch.nn.ModuleList(list(base.layers)[c * n:(c + 1) * n])
        first, last = v == 0, v == pp * v_count - 1
        if not first:
            part.embed_tokens = None
        if last:
            head = copy.copy(full)
            head._modules = dict(full._modules)
            head.model = part
            part = head
        else:
            part.norm = torch.nn.Identity()
        chunks[v] = (part, first, last)
    if rank > 0:
        base.embed_tokens = None
    if not any(last for _, _, last in chunks.values()):
        base.norm = torch.nn.Identity()
        params = list(base.parameters())
    else:
        params = list(full.parameters())
    return chunks, params, config.hidden_size


def plain_pipeline(case: Case, model, batch: int, after_build: Callable[[], None],
                   measured: Callable[[], None] | None = None, clock: StepClock | None = None) -> None:
    """One rank of an interleaved 1F1B pipeline run as one process: the rank's chunks, its forwards and
    backwards in the order torch's ``ScheduleInterleaved1F1B`` gives it
    (``_calculate_single_rank_operations``), each micro-batch of ``batch`` sequences; a chunk that does
    not start the model gets the previous stage's activation in a receive buffer (a fresh tensor, its
    gradient sent back), one that does not end it a received gradient (zeros of its output's shape)."""
    import torch
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType
    o = case.options
    pp, v_count, rank, mbs = o["pp"], o.get("virtual_stages", 1), o.get("pp_stage", 0), o.get("microbatches") or o["pp"]
    dev = torch.device("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, None: torch.float32}[case.dtype]
    torch.manual_seed(0)
    chunks, params, hidden = _stage_model(case, model, dt, dev)
    opt = _plain_optimizer(case, params)
    rounds = max(1, mbs // pp)
    sched = SimpleNamespace(pp_group_size=pp, n_local_stages=v_count, number_of_rounds=rounds,
                            microbatches_per_round=mbs // rounds, _n_microbatches=mbs)
    actions = [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, rank) if a is not None]
    vocab = chunks[next(iter(chunks))][0].config.vocab_size
    ids = torch.randint(0, vocab, (batch, case.seq_len), device=dev)

    def forward(v: int) -> tuple:
        """One micro-batch forward through chunk ``v``: (what its backward starts from, the receive
        buffer, held with it until that backward: its gradient is what the stage sends back)."""
        net, first, last = chunks[v]
        if first:
            return net(input_ids=ids, use_cache=False).last_hidden_state, None
        x = torch.empty(batch, case.seq_len, hidden, dtype=dt, device=dev, requires_grad=True)
        if last:
            return net(inputs_embeds=x, labels=ids, use_cache=False).loss, x
        return net(inputs_embeds=x, use_cache=False).last_hidden_state, x

    def backward(v: int, held_one: tuple) -> None:
        out = held_one[0]
        if chunks[v][2]:
            out.backward()
        else:   # the gradient the next stage sends back, in a receive buffer of the output's shape
            out.backward(torch.zeros_like(out))
    after_build()
    for i in _plain_steps(clock, measured):
        if i:
            opt.zero_grad(set_to_none=True)
        held = {}
        for a in actions:
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == _ComputationType.FORWARD:
                held[key] = forward(a.stage_index)
            else:
                backward(a.stage_index, held.pop(key))
        opt.step()
    torch.cuda.synchronize()


def plain_fsdp2(case: Case, model, batch: int, after_build: Callable[[], None],
                measured: Callable[[], None] | None = None, clock: StepClock | None = None,
                device: str = "cuda") -> dict[str, Any]:
    """Rank 0 of ``case.world`` under FSDP2 in PyTorch's fake process group (one process; its
    collectives move no data, their buffers are real): ``fully_shard`` on every decoder layer, then
    on the root (torchtitan's way), AdamW over the sharded parameters, plain steps. ``device``: "cuda"
    (the case), "cpu" (a test of this code on the CPU). Returns the local shards' and the whole
    model's parameter counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from gpulab.models.workload import resolve_workload
    if dist.is_initialized():
        raise RuntimeError("a process group is already running: the FSDP2 case needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.world)
    try:
        mesh = init_device_mesh(device, (case.world,))
        w = resolve_workload(model, batch=batch, seq_len=case.seq_len)
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[case.dtype]
        torch.manual_seed(0)
        net = w.build(torch.device(device), dt)
        whole = sum(p.numel() for p in net.parameters())
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = _plain_optimizer(case, list(net.parameters()))
        with torch.device(device):
            data = w.inputs(batch, dt)
        args, inputs, labels = _batch(data)
        after_build()
        for i in _plain_steps(clock, measured):
            if i:
                opt.zero_grad(set_to_none=True)
            output = net(*args, **inputs)
            loss = _plain_loss(output, labels)
            del output
            loss.backward()
            del loss
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        local = sum(p.to_local().numel() for p in net.parameters())
        del net, opt, data, args, inputs, labels
        return {"local": local, "whole": whole}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _standin_stop_check(stand_in: bool, length: int):
    """Under the stand-in only: transformers' ``StopCheck`` (its "every sequence finished" read of
    the device) answers from the length, since the stand-in's tensors have no values to read."""
    if not stand_in:
        yield
        return
    import transformers.generation.utils as gen_utils
    stop = getattr(gen_utils, "StopCheck", None)
    if stop is None:
        yield
        return
    original = stop.__call__
    stop.__call__ = lambda self, unfinished, tokens, now: now >= length
    try:
        yield
    finally:
        stop.__call__ = original


def plain_generate(case: Case, model, after_build: Callable[[], None], measured: Callable[[], None] | None = None,
                   clock: StepClock | None = None, stand_in: bool = False) -> None:
    """``model.generate()`` in plain transformers: random weights in ``case.dtype``, a random prompt
    with an all-ones attention mask, greedy, exactly ``new_tokens`` new tokens. With ``clock``: after
    the measured call (``measured()``), one more call timed by CUDA events (``clock.seconds``: the
    whole call's)."""
    import copy

    import torch
    from gpulab.models import hf_configs
    from gpulab.units import parse_dtype
    config, _ = hf_configs.config_and_name(model)
    config = copy.deepcopy(config)
    config.use_cache = True
    dt = parse_dtype(case.dtype or "bf16")
    with torch.device("cuda"):
        net = hf_configs.build_causal_lm(config, dt)
    net.eval()
    vocab = hf_configs.vocab_size(config)
    ids = torch.randint(0, vocab, (case.batch, case.prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    after_build()

    def call():
        with torch.no_grad(), _standin_stop_check(stand_in, case.prompt_len + case.new_tokens):
            out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=case.new_tokens,
                               min_new_tokens=case.new_tokens, do_sample=False, pad_token_id=0)
        del out
    call()
    torch.cuda.synchronize()
    if clock is not None:
        if measured is not None:
            measured()
        clock.steps = 1
        clock.at(TIMED_FROM)
        call()
        clock.at(clock.last + 1)


def _after_build() -> None:
    import torch
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def plain_run(case: Case, model, batch: int, stand_in: bool, measured: Callable[[], None] | None = None,
              clock: StepClock | None = None) -> dict[str, int]:
    """The case's plain run at ``batch``; refused if a dispatch mode is on (on a GPU none may be:
    the stand-in is one itself). Returns the attention kernels forced (``case.kernels_of``: a
    card's, ``forced_attention``) by name and count; else {}. With ``clock``: ``measured()`` once the
    measured steps are done, then the timed ones (``StepClock``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    mode = _get_current_dispatch_mode()
    if mode is not None and not stand_in:
        raise RuntimeError(f"a dispatch mode ({type(mode).__name__}) is on: the plain step would not be plain")
    if case.kind == "generate":
        plain_generate(case, model, _after_build, measured, clock, stand_in)
        return {}
    if case.kind == "fsdp2":
        plain_fsdp2(case, model, batch, _after_build, measured, clock)
        return {}
    if case.options.get("pp", 1) > 1:
        plain_pipeline(case, model, batch, _after_build, measured, clock)
        return {}
    with forced_attention(case.kernels_of) as used:
        plain_train(case, model, batch, stand_in, _after_build, measured, clock)
    return dict(used)


# ---- the allocator's trace (issue 48 item 2) -----------------------------------------------------

def _frame_text(frames: Sequence[dict[str, Any]], depth: int = 3) -> str:
    """The innermost ``depth`` Python frames outside torch's own files and the test suite's stand-in
    (where user or library code asked for the tensor), innermost first."""
    picked = [f for f in frames if "/torch/" not in str(f.get("filename", "")).replace("\\", "/")
              and not str(f.get("filename", "")).endswith("cuda_standin.py")] or list(frames)
    return " < ".join(f"{pathlib.Path(str(f.get('filename', '?'))).name}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in picked[:depth]) or "no frames"


def trace_peak(snapshot: dict[str, Any], top: int = 16) -> dict[str, Any]:
    """The allocator's trace (``torch.cuda.memory._snapshot()["device_traces"]``) replayed: blocks
    allocated (``alloc``) and given back (``free_completed``), the peak of their total, and the ``top``
    largest blocks alive at that peak with the frames that allocated them."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    traces = snapshot.get("device_traces") or [[]]
    events = traces[0] if traces else []
    for e in events:
        action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if action == "alloc":
            live[addr] = e
            total += size
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and addr in live:
            total -= int(live.pop(addr).get("size", 0))
    largest = sorted(at_peak, key=lambda e: -int(e.get("size", 0)))[:top]
    by_size: dict[int, int] = {}
    for e in at_peak:
        by_size[int(e.get("size", 0))] = by_size.get(int(e.get("size", 0)), 0) + 1
    return {"events": len(events), "peak_bytes": peak, "alive_at_peak": len(at_peak),
            "largest": [{"bytes": int(e.get("size", 0)), "where": _frame_text(e.get("frames") or [])} for e in largest],
            "count_by_size": {str(k): v for k, v in sorted(by_size.items(), reverse=True)}}


def trace_difference(a: dict[str, Any], b: dict[str, Any], top: int = 8) -> list[dict[str, Any]]:
    """The blocks alive at ``a``'s peak beyond ``b``'s, by size: (bytes, how many more in ``a``), the
    largest first (``trace_peak``'s ``count_by_size``); negative counts: more in ``b``."""
    ca, cb = a.get("count_by_size", {}), b.get("count_by_size", {})
    diff = [{"bytes": int(k), "more": ca.get(k, 0) - cb.get(k, 0)} for k in set(ca) | set(cb)
            if ca.get(k, 0) != cb.get(k, 0)]
    return sorted(diff, key=lambda d: -abs(d["bytes"] * d["more"]))[:top]


class AllocatorTrace:
    """With ``case.trace`` and an ``out`` folder: the allocator's history recorded from ``start()``
    to ``stop()`` (``torch.cuda.memory._record_memory_history``, Python stacks), then ``_snapshot()``
    pickled to ``out/traces/<case>.pickle`` beside a JSON of its provenance (card, driver, CUDA,
    torch); ``info`` gets the files and the ``trace_peak`` analysis. Stopped before the timed steps,
    so recording costs them nothing."""

    def __init__(self, case: Case, out: pathlib.Path | None, device_facts: dict[str, Any]):
        self.case, self.out, self.facts = case, out, device_facts
        self.on = bool(case.trace and out is not None)
        self.info: dict[str, Any] = {}
        self.recording = False

    def start(self) -> None:
        import torch
        if self.on:
            torch.cuda.memory._record_memory_history(max_entries=TRACE_MAX_ENTRIES, stacks="python")
            self.recording = True

    def stop(self) -> None:
        import pickle

        import torch
        if not self.recording:
            return
        try:
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
        case, folder = self.case, self.out / TRACE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{case.name}.pickle"
        with open(path, "wb") as fh:
            pickle.dump(snap, fh)
        provenance = {k: self.facts.get(k) for k in ("gpu_name", "driver", "cuda_runtime", "torch", "compute_capability",
                                                      "time_utc", "gpulab_commit", "stand_in")}
        provenance.update(case=case.name, recipe=case.recipe_text(), batch=case.batch, seq_len=case.seq_len,
                          what="torch.cuda.memory._snapshot() after _record_memory_history(stacks='python') around "
                               "the plain run: the model's build and " + ("one generate() call" if case.kind == "generate"
                                                                         else f"{STEPS} training steps"))
        (folder / f"{case.name}.json").write_text(json.dumps(provenance, indent=1, default=str) + "\n")
        self.info.update(file=f"{TRACE_DIR}/{path.name}", provenance=f"{TRACE_DIR}/{case.name}.json", **trace_peak(snap))


# ---- the T4 case on the CPU (issue 48 item 2) ----------------------------------------------------

def _saved_tensors(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """What autograd saves for backward while ``fn()`` runs (``torch.autograd.graph.saved_tensors_hooks``):
    each tensor's shape, dtype and storage bytes."""
    import torch
    got: list[dict[str, Any]] = []

    def pack(t):
        got.append({"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                    "bytes": t.untyped_storage().nbytes()})
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return got


def t4_dropout_on_cpu(batch: int = 2, heads: int = 2, seq: int = 64, head_dim: int = 16, p: float = 0.1,
                      full: tuple[int, int, int] = (8, 12, 1024)) -> dict[str, Any]:
    """The T4 case's attention at a size the CPU runs: bf16 ``F.scaled_dot_product_attention`` with
    dropout, the math kernel forced (``sdpa_kernel(SDPBackend.MATH)``), what autograd saves for it
    (a) in a real CPU run, with ``allowFP16BF16ReductionMathSDP`` off (PyTorch's default: the math
    path upcasts to float32) and on; (b) in gpulab's fake engine for a T4 (``cuda_kernels`` under
    ``kernel_target(T4)``: its math kernel, ``aten::_scaled_dot_product_attention_math``); (c)
    ``F.dropout`` under the same fake engine, which gpulab swaps for CUDA's ``native_dropout``.
    ``at::dropout`` (aten/src/ATen/native/Dropout.cpp) takes ``native_dropout`` (the output and a
    bool mask, saved) only for a CUDA input (``is_fused_kernel_acceptable``); else ``_dropout_impl``
    multiplies by a noise tensor of the input's dtype (``at::empty_like(input).bernoulli_``), which
    ``mul`` saves. The dropout inside the math composite is that C++ call: the real CPU run keeps the
    noise, and gpulab's fake engine, which registers CUDA's choice on ``aten::dropout`` itself
    (``measure.fake_cuda._cuda_dropout_op``), keeps the bool mask. Returns the saved tensors, the s×s
    bytes per element each run keeps beyond CUDA's, and the CPU path's excess at ``full`` (GPT-2's
    8 × 12 heads × 1024 positions) per layer: what the fake engine kept before that registration."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpulab.measure.cuda_card import kernel_target
    from gpulab.measure.fake_cuda import cuda_kernels
    from gpulab.predict.cards import parse_gpu

    def attention():
        q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        return _saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True))

    out: dict[str, Any] = {"size": [batch, heads, seq, head_dim], "dropout_p": p}
    allowed = torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp
    was = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        with sdpa_kernel(SDPBackend.MATH):
            allowed(False)
            out["cpu"] = attention()
            allowed(True)
            out["cpu_reduction_allowed"] = attention()
    finally:
        allowed(was)
    with FakeTensorMode(), kernel_target(parse_gpu("T4").kernel_target), cuda_kernels():
        out["fake_t4"] = attention()
        x = torch.randn(batch, heads, seq, seq, requires_grad=True)
        out["fake_f_dropout"] = _saved_tensors(lambda: F.dropout(x, p, True))
    elems = batch * heads * seq * seq

    def square(saved):   # the s×s tensors saved for one attention call (the batch and heads dims may be merged)
        return [t for t in saved if t["shape"][-2:] == [seq, seq]]
    bool_mask = elems   # CUDA: native_dropout's bool mask in place of the noise
    for key in ("cpu", "fake_t4"):
        sq = square(out[key])
        out[f"{key}_square"] = sq
        # the bytes per element beyond CUDA: CUDA saves the same s×s tensors but a bool mask for the noise;
        # the noise is the one s×s tensor of the softmax output's shape beyond softmax and the dropped output
        pair = [t for t in sq if len(t["shape"]) == 4]   # the softmax's output and the noise (4-D, as the input)
        noise = pair[1]["bytes"] if len(pair) == 2 else 0
        out[f"{key}_excess_per_element"] = (noise - bool_mask) / elems
    b, h, s = full
    out["excess_per_layer_at_full_bytes"] = int(out["cpu_excess_per_element"] * b * h * s * s)
    return out


# ---- one case ------------------------------------------------------------------------------------

def standin_limit(case: Case) -> str | None:
    """Why the test suite's CUDA stand-in cannot run ``case`` (None: it can): what needs a CUDA device
    or real values, said in the report as the case's skip."""
    if case.kind == "fsdp2":
        return "the stand-in cannot run FSDP2 (init_device_mesh('cuda') and FSDP2's streams need a CUDA device)"
    if case.options.get("implementation") == "fused":
        return "the stand-in's meta tensors cannot run a fused optimizer (fused=True takes CUDA tensors)"
    if case.options.get("compile"):
        return ("the stand-in cannot compile (its dispatch modes sit under gpulab's tracker, which torch.compile's "
                "capture must pause)")
    return None


def measure_case(case: Case, *, stand_in: bool, context_assumed: int, do_fit: bool = True,
                 case_limit: float = DEFAULT_CASE_LIMIT_S, say: Callable[[str], None] = lambda _m: None,
                 device=None, out: pathlib.Path | None = None, device_facts: dict[str, Any] | None = None) -> CaseRun:
    """One case: prediction (memory and time), plain run (memory, then the timed steps), the
    allocator's trace where the case asks (into ``out``), comparisons, fit checks. Never raises (but
    KeyboardInterrupt): every failure is the case's result."""
    import torch
    from gpulab.measure import gpu as mgpu
    label, _ = MODELS[case.model]
    run = CaseRun(case.name, label, case.recipe_text(), case.batch, case.seq_len, target=case.target,
                  context_assumed=context_assumed)
    if case.options.get("compile"):
        run.note = ("torch.compile: inductor on the GPU, inductor's own memory plan on the fake side "
                    "(its graphs lowered and scheduled for CUDA, no code generated; reserved: the op-by-op run)")
    if case.needs == "bitsandbytes":
        why = bitsandbytes_cuda()
        if why:
            run.status = f"skipped: {why}"
            return run
    why = standin_limit(case) if stand_in else None
    if why:
        run.status = f"skipped: {why}"
        return run
    t_case = time.monotonic()
    try:
        with time_limit(case_limit):
            _, model = model_arg(case)
            t0 = time.monotonic()
            pred = predict(case, model, device)
            run.predict_seconds = round(time.monotonic() - t0, 2)
            run.predicted_tensors, run.predicted_allocated = pred["tensors"], pred["allocated"]
            run.predicted_step_s, run.time_note = pred.get("step_s"), pred.get("time_note")
            free_memory()
            run.baseline_allocated = torch.cuda.memory_allocated()
            run.baseline_reserved = torch.cuda.memory_reserved()
            run.free_bytes = int(torch.cuda.mem_get_info()[0])
            run.predicted_reserved, fits = simulated_reserved(pred["events"], run.free_bytes)
            if not fits:
                run.note = ((run.note + "; ") if run.note else "") + (
                    f"the simulated allocator runs out of memory in this device's free {gv._mib(run.free_bytes)}: "
                    "its reserved peak is from a replay without a limit")
            layout = gv.baseline_layout()
            if layout is not None:
                seeded = gv.seeded_replay(pred["events"], layout)
                if seeded is not None:
                    run.seeded_allocated, run.seeded_reserved = seeded
            del pred
            t1 = time.monotonic()
            clock = StepClock(TIMED_FROM if stand_in else TIMED_TO)
            tracer = AllocatorTrace(case, out, device_facts or {})

            def measured() -> None:   # after the measured steps, before the timed ones
                torch.cuda.synchronize()
                run.real_allocated = torch.cuda.max_memory_allocated() - run.baseline_allocated
                run.real_reserved = torch.cuda.max_memory_reserved() - run.baseline_reserved
                used = mgpu.nvml_used_bytes(0)
                run.nvml_used = None if used is None else int(used)
                if used is not None:
                    run.context_now = int(used) - torch.cuda.memory_reserved()
                tracer.stop()
            tracer.start()
            try:
                forced = plain_run(case, model, case.batch, stand_in, measured, clock)
            finally:
                tracer.stop()
                run.trace = tracer.info or None
            if case.kernels_of:
                run.note = ((run.note + "; ") if run.note else "") + (
                    f"{case.kernels_of}'s attention kernels forced on this GPU (sdpa_kernel, call by call): "
                    + (", ".join(f"{k} ×{n}" for k, n in sorted(forced.items())) or "no attention call"))
            run.run_seconds = round(time.monotonic() - t1, 2)
            timed = (f"CUDA events over steps {TIMED_FROM}-{TIMED_TO}" if case.kind != "generate"
                     else "CUDA events around a second generate() call")
            if stand_in:
                run.time_note = (run.time_note or "") + ("; real: not measured on a GPU (the stand-in ran its CUDA events "
                                                          "around one step, on the host's clock)")
            else:
                run.real_step_s = clock.seconds
                run.time_note = (run.time_note or "") + f"; real: {timed}"
            run.predicted_process = run.baseline_reserved + run.predicted_reserved + context_assumed
            if case.kind == "generate":
                run.serve = serve_figures(case, model, device)
            run.status = "ran"
    except CaseTimeout as exc:
        run.status, run.error = "timed out", str(exc)
    except Exception as exc:  # noqa: BLE001 - the case's result, the run goes on
        run.status = ("out of memory: " if is_oom(exc) else "error: ") + _short(exc)
        run.error = gv._error(exc)
        if stand_in and "meta tensor" in run.error:
            run.error += " (a limit of the stand-in: its GPU tensors are meta tensors, whose values cannot be read)"
    finally:
        _reset_fraction()
        free_memory()
    if do_fit and case.fit_cards and run.ran:
        left = case_limit - (time.monotonic() - t_case)
        for card in case.fit_cards:
            if left < MIN_CASE_S:
                run.fit.append(FitCheck(card, verdict="not measured: the case's time limit was spent"))
                continue
            say(f"  fit check on {card}")
            t2 = time.monotonic()
            run.fit.append(fit_check(case, card, stand_in, left, device))
            left -= time.monotonic() - t2
    return run


def serve_figures(case: Case, model, device=None) -> dict[str, int] | None:
    """``gpulab.serve``'s figures for the generation's whole context (beside the comparison), for
    this device's card (else an H100)."""
    import gpulab
    try:
        s = gpulab.serve(model, device if device is not None else "H100",
                         context_len=case.prompt_len + case.new_tokens, batch=case.batch, dtype=case.dtype or "bf16")
    except Exception:  # noqa: BLE001 - a figure beside the check, not the check
        return None
    return {"weights_bytes": s.weights_bytes, "kv_cache_bytes": s.kv_cache_bytes,
            "prefill_one_bytes": s.prefill_one_bytes, "decode_bytes": s.decode_bytes}


# ---- fit on an emulated card ---------------------------------------------------------------------

def _reset_fraction() -> None:
    import torch
    try:
        torch.cuda.set_per_process_memory_fraction(1.0)
    except Exception:  # noqa: BLE001 - nothing was limited
        pass


def _try_batch(case: Case, model, batch: int, stand_in: bool, f: FitCheck | None = None) -> str:
    """"ran", "OOM" or "error: ..." for two plain steps at ``batch``; memory freed after. A run
    that ran leaves its reserved peak (above ``f.baseline_reserved``) in ``f.real_reserved``."""
    import torch
    try:
        plain_run(case, model, batch, stand_in)
        if f is not None and f.baseline_reserved is not None:
            f.real_reserved[str(batch)] = torch.cuda.max_memory_reserved() - f.baseline_reserved
        return "ran"
    except CaseTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - an OOM is the expected answer at b + 1
        return ("OOM" if is_oom(exc) else "error: " + _short(exc))
    finally:
        free_memory()


def fit_check(case: Case, card_name: str, stand_in: bool, seconds: float, device=None) -> FitCheck:
    """fit's batch b for ``card_name``, then plain steps at b and b + 1 with the allocator limited
    to the card's total less the context measured now; further probes say by how much it missed."""
    import gpulab
    import torch
    from gpulab.predict.replay import beyond_allocator_bytes
    f = FitCheck(card_name)
    try:
        with time_limit(seconds):
            free_memory()
            ctx = beyond_allocator_bytes(0).get("bytes")
            if ctx is None:
                f.verdict = "not measured: no NVML (the context cannot be measured)"
                return f
            f.context_bytes = int(ctx)
            card = emulated_card(card_name, device, f.context_bytes)
            f.card_bytes = card.reported_total_bytes
            f.baseline_reserved = int(torch.cuda.memory_reserved())
            total = torch.cuda.get_device_properties(0).total_memory
            # the card this device is (an H100 on an H100): CUDA's totals differ by a few MiB between boards
            f.limit_bytes = min(f.card_bytes, total) - f.context_bytes
            if f.limit_bytes <= 0 or f.card_bytes > total * 1.005:
                f.verdict = (f"not emulated: the card ({gv._mib(f.card_bytes)}) is larger than this device "
                             f"({gv._mib(total)})" if f.card_bytes > total else "not emulated: no room after the context")
                return f
            _, model = model_arg(case)
            t0 = time.monotonic()
            # fit is given the context measured here; the cuBLAS workspaces (inside the limit below,
            # in baseline_reserved) it predicts itself for the card's capability
            res = gpulab.fit(model, card, optimizer=case.optimizer, dtype=case.dtype, seq_len=case.seq_len,
                             context_bytes=f.context_bytes, **_step_options(case))
            f.fit_workspace_bytes = getattr(res, "workspace_bytes", None)
            f.kernels = getattr(res, "kernels", "") or ""
            f.fit_seconds = round(time.monotonic() - t0, 2)
            f.fit_batch = b = res.largest_batch
            for c in res.checks:
                if c.batch in (b, b + 1):
                    f.predicted_reserved[str(c.batch)] = c.reserved_bytes
                    f.predicted_fits[str(c.batch)] = c.fits
            f.fraction = f.limit_bytes / total
            torch.cuda.set_per_process_memory_fraction(f.fraction)

            def attempt(n: int) -> bool:
                if n < 1:
                    return True   # batch 0 "runs": nothing to run
                f.tried[str(n)] = _try_batch(case, model, n, stand_in, f)
                if f.tried[str(n)].startswith("error"):
                    raise RuntimeError(f"batch {n}: {f.tried[str(n)]}")
                return f.tried[str(n)] == "ran"

            ok_b = attempt(b)
            if ok_b:
                if not attempt(b + 1):
                    f.real_largest, f.real_largest_exact, f.verdict = b, True, "PASS"
                else:   # fit was too cautious: how far does the real run go?
                    n = b + 1
                    for _ in range(FIT_PROBES):
                        if not attempt(n + 1):
                            f.real_largest, f.real_largest_exact = n, True
                            break
                        n += 1
                    else:
                        f.real_largest, f.bound = n, "≥"   # n ran: at least n
                    f.verdict = (f"MISS: too few by {f.real_largest - b}" if f.real_largest_exact
                                 else f"MISS: too few by at least {f.real_largest - b}")
            else:        # fit said b fits and it does not: one too many (or more)
                n = b - 1
                for _ in range(FIT_PROBES):
                    if attempt(n):
                        f.real_largest, f.real_largest_exact = n, True
                        break
                    n -= 1
                else:
                    f.real_largest, f.bound = n, "≤"   # n + 1 ran out of memory too: at most n
                f.verdict = (f"MISS: too many by {b - f.real_largest} (batch {b} ran out of memory)"
                             if f.real_largest_exact else
                             f"MISS: too many by at least {b - f.real_largest} (batch {b} ran out of memory)")
    except CaseTimeout as exc:
        f.error, f.verdict = str(exc), "not measured: timed out"
    except Exception as exc:  # noqa: BLE001
        f.error, f.verdict = gv._error(exc), "error: " + _short(exc)
    finally:
        _reset_fraction()
        free_memory()
    return f


# ---- the command ---------------------------------------------------------------------------------

def validate(out: pathlib.Path, md: pathlib.Path | None = None, *, cases: Sequence[Case] | None = None,
             quick: bool = False, names: Sequence[str] | None = None, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
             case_limit: float = DEFAULT_CASE_LIMIT_S, do_fit: bool = True, commit: str | None = None,
             command: Sequence[str] | None = None, merge: bool = False,
             progress: Callable[[str], None] | None = None, sweep: bool | None = None) -> Report:
    """Every case on CUDA device 0, then the cuDNN workspace sweep (``WORKSPACE_SWEEP``, ``QUICK_SWEEP``
    with ``quick``; ``sweep``: None runs it unless ``cases`` or ``names`` picks cases), the report rewritten after
    each. ``cases``: the list (default ``CASES``, scaled down with ``quick``); ``names``: only these.
    ``merge``: keep the cases of ``out``'s earlier report (same GPU) that this run does not run again."""
    from gpulab.predict.context import context_assumption
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    say = progress or (lambda _m: None)
    out = pathlib.Path(out).resolve()
    todo = list(cases if cases is not None else CASES)
    if quick and cases is None:
        todo = quick_cases(todo)
    if names:
        unknown = [n for n in names if n not in {c.name for c in todo}]
        if unknown:
            raise ValueError(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(c.name for c in todo)}")
        todo = [c for c in todo if c.name in names]
    report = Report(device={}, started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    quick=quick, time_limit=time_limit_s)
    try:
        report.device = gv.device_facts(command or ["benchmarks/practitioner_validation.py"], commit)
    except Exception as exc:  # noqa: BLE001
        report.device = {"gpu_name": "unknown", "error": gv._error(exc)}
    stand_in = gv.is_stand_in(report.device)
    try:
        device = device_card()
    except Exception:  # noqa: BLE001 - predictions then follow gpulab's default kernels
        device = None
    report.kernels = (device.kernel_target.text if device is not None and hasattr(device, "kernel_target")
                      else "gpulab's default (sm80 rules): this device is no card gpulab knows")

    try:
        old = Report.from_dict(json.loads((out / JSON_NAME).read_text())) if merge else None
    except (OSError, ValueError, TypeError, KeyError):
        old = None

    def save() -> None:
        report.seconds = time.monotonic() - t0
        if old is not None:
            merge_earlier(report, old)
        write_report(report, out, md)

    report.context_before = gv.cuda_context("before the cases")
    try:
        report.warm_up = warm_up()
    except Exception as exc:  # noqa: BLE001
        report.warm_up = {"error": gv._error(exc)}
    context_assumed = context_assumption("lazy").nbytes
    try:   # CPU tensors only (with the stand-in's modes on, they pass through them)
        report.t4_cpu = t4_dropout_on_cpu()
    except Exception as exc:  # noqa: BLE001 - a section of the report, not a case
        report.t4_cpu = {"error": gv._error(exc)}
    save()
    for case in todo:
        left = deadline - time.monotonic()
        if left < MIN_CASE_S:
            report.not_run.append(f"{case.name}: time limit reached")
            continue
        say(f"case {case.name} ({case.recipe_text()}, batch {case.batch})")
        r = measure_case(case, stand_in=stand_in, context_assumed=context_assumed, do_fit=do_fit,
                         case_limit=min(case_limit, left), say=say, device=device, out=out,
                         device_facts=report.device)
        report.cases.append(r)
        say(f"  {r.status}" + (f": allocated {gv._pct(allocated_check(r).difference)}, reserved "
                               f"{gv._pct(reserved_check(r).difference)}, process {gv._pct(process_check(r).difference)}"
                               if r.ran else "")
            + "".join(f"; fit {f.card}: {f.verdict}" for f in r.fit))
        save()
    do_sweep = (cases is None and not names) if sweep is None else sweep
    for setting in (QUICK_SWEEP if quick else WORKSPACE_SWEEP) if do_sweep else ():
        if deadline - time.monotonic() < MIN_SWEEP_S:
            report.not_run.append(f"cuDNN workspace sweep {setting.name}: time limit reached")
            continue
        say(f"cuDNN workspace sweep: {setting.name}")
        report.workspaces.append(workspace_setting_run(setting))
        save()
    save()
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="practitioner_validation.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="practitioner-validation", help="folder for the JSON and the markdown")
    p.add_argument("--md", default=None,
                   help="also write the section into this markdown file, under its own heading (e.g. docs/gpu-validation.md)")
    p.add_argument("--quick", action="store_true", help="tiny configs and small batches (the stand-in's run)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds for the whole run (default {DEFAULT_TIME_LIMIT_S}); later cases are reported as not run")
    p.add_argument("--case-limit", type=float, default=DEFAULT_CASE_LIMIT_S,
                   help=f"seconds one case may take, fit checks included (default {DEFAULT_CASE_LIMIT_S})")
    p.add_argument("--no-fit", action="store_true", help="leave the fit checks out")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="the cuDNN workspace sweep after the cases (default: on, off when --cases picks cases)")
    p.add_argument("--commit", default=None, help="gpulab's git commit, where the machine has no .git")
    p.add_argument("--merge", action="store_true",
                   help="keep the cases of OUT's earlier report (same GPU) that this run does not run again")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not gv.cuda_available():
        print("practitioner_validation: error: the practitioner validation needs a CUDA GPU "
              "(torch.cuda.is_available() is False); nothing was measured", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    md = pathlib.Path(args.md) if args.md else None
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or None
    try:
        report = validate(out, md, quick=args.quick, names=names, time_limit_s=args.time_limit,
                          case_limit=args.case_limit, do_fit=not args.no_fit, commit=args.commit, merge=args.merge,
                          sweep=args.sweep,
                          command=["benchmarks/practitioner_validation.py", *(sys.argv[1:] if argv is None else argv)],
                          progress=lambda msg: print(f"[practitioner] {msg}", flush=True))
    except ValueError as exc:
        print(f"practitioner_validation: error: {exc}", file=sys.stderr)
        return 2
    bad = missed(report)
    print(f"[practitioner] report: {out / MD_NAME}" + (f" and {md}" if md else "")
          + f"; raw figures: {out / JSON_NAME} ({report.seconds:.0f} s); "
          + (f"MISS: {', '.join(bad)}" if bad else "every target PASS"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
