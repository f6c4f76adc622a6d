"""Practitioner validation (issue 33, item 3): gpulab's answers for the runs a practitioner makes,
checked on one GPU against plain PyTorch.

The command a GPU session runs (one H100 or H200; it stops starting cases after --time-limit):

    PYTHONPATH=. python benchmarks/practitioner_validation.py --out "$OUT/practitioner" --md docs/gpu-validation.md --time-limit 480 --commit SHA; cp docs/gpu-validation.md "$OUT/practitioner/"

(``$OUT``: the folder the device machine sends back; ``SHA``: ``git rev-parse HEAD`` where the
command is prepared, since that machine's copy has no .git; the ``cp`` brings the updated doc back.
Anywhere else: ``--out DIR`` and drop the ``cp``.)

It needs torch with CUDA, transformers, peft and NVML (pynvml), and bitsandbytes for the QLoRA and
8-bit AdamW cases (without its CUDA kernels they are skipped, and said so). On an NVIDIA H100 80GB
HBM3 (2026-11-27, torch 2.11.0+cu130) the first twelve cases took 147 s, the two FP8 cases 37 s and
the two T4-kernel cases 25 s; the cases run in ``CASES``' order, and what the time limit leaves out
is reported as not run.

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
MiB, GiB = 1 << 20, 1 << 30

ALLOCATED_TOL = 0.01     # fake prediction vs max_memory_allocated
RESERVED_TOL = 0.03      # simulated reserved vs max_memory_reserved
PROCESS_TOL = 0.05       # predicted whole process vs NVML used
FIT_EXACT_SHARE = 0.90   # fit's batch exact in at least this share of the checks, never one too many
FIT_PROBES = 3           # batches tried beyond b + 1 (or below b) to say by how much fit missed

DEFAULT_TIME_LIMIT_S = 480
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


MODELS: dict[str, tuple[str, Callable[[], Any] | str]] = {
    # key: (what the report calls it, a gpulab model name or a function making a config)
    "gpt2": ("GPT-2 124M (hf:gpt2)", "hf:gpt2"),
    "qwen": ("Qwen2.5-0.5B (hf:qwen2.5-0.5b)", "hf:qwen2.5-0.5b"),
    "llama-1b": ("Llama-style 1.2B (Llama 3.2 1B's shapes)", llama_1b_config),
    "llama-8b": ("Llama-3-8B (hf:llama-3-8b)", "hf:llama-3-8b"),
    "resnet50": ("ResNet-50 (torchvision)", "resnet50"),
    # --quick (the stand-in): tiny configs
    "tiny-gpt2": ("tiny GPT-2 (hf:tiny-gpt2)", "hf:tiny-gpt2"),
    "tiny-llama": ("tiny Llama (hf:tiny-llama)", "hf:tiny-llama"),
    "cnn": ("the lessons' small CNN (cnn)", "cnn"),
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

    def recipe_text(self) -> str:
        if self.kind == "generate":
            return f"generate(): prompt {self.prompt_len:,} + {self.new_tokens:,} new tokens, {self.dtype}"
        parts = [self.optimizer, "float32" if self.dtype is None else f"pure {self.dtype}"]
        parts += [f"{k}={v}" for k, v in self.options.items()]
        if self.kernels_of:
            parts.append(f"{self.kernels_of}'s attention kernels")
        return ", ".join(parts)


CASES: tuple[Case, ...] = (   # in the order they run: past the time limit, the last ones are not run
    Case("gpt2-fp32-adamw", "gpt2", 8, seq_len=1024, fit_cards=("T4",)),
    Case("gpt2-bf16-autocast", "gpt2", 8, seq_len=1024, options={"amp": "bf16"}),
    Case("llama8b-bf16-adamw", "llama-8b", 2, seq_len=2048, dtype="bf16", fit_cards=("H100",)),
    Case("llama8b-generate", "llama-8b", 1, kind="generate", dtype="bf16", prompt_len=7936, new_tokens=256),
    Case("qwen-ckpt-full", "qwen", 4, seq_len=2048, dtype="bf16", options={"checkpointing": "full"}),
    Case("qwen-ckpt-selective", "qwen", 4, seq_len=2048, dtype="bf16", options={"checkpointing": "selective"},
         fit_cards=("24GiB",)),
    Case("llama1b-lora", "llama-1b", 4, seq_len=2048, dtype="bf16", options={"lora": 16}, fit_cards=("40GiB",)),
    Case("llama1b-qlora", "llama-1b", 4, seq_len=2048, dtype="bf16", options={"lora": 16, "quantize": "nf4"},
         needs="bitsandbytes"),
    Case("llama1b-adamw8bit", "llama-1b", 2, optimizer="adamw8bit", seq_len=1024, dtype="bf16",
         needs="bitsandbytes"),
    Case("qwen-chunked-loss", "qwen", 4, seq_len=2048, dtype="bf16", options={"chunked_loss": 8}),
    Case("resnet50-fp32-momentum", "resnet50", 64, optimizer="momentum"),
    # inductor's own plan on the fake side (training.inductor_plan); the reserved peak still replays
    # the op-by-op run's events
    Case("gpt2-compile", "gpt2", 8, seq_len=1024, options={"compile": True}),
    # torchao's float8 training (issue 35): eager Float8Linear layers, both recipes; run last
    Case("llama1b-fp8-tensorwise", "llama-1b", 2, seq_len=2048, dtype="bf16", options={"fp8": "tensorwise"}),
    Case("llama1b-fp8-rowwise", "llama-1b", 2, seq_len=2048, dtype="bf16", options={"fp8": "rowwise"}),
    # a T4's attention kernels (issue 33: sm75 has no flash or cuDNN attention, and its memory-efficient
    # kernel takes no bf16): predicted for a T4, and forced on this GPU call by call (``forced_attention``)
    Case("gpt2-t4-kernels-bf16", "gpt2", 8, seq_len=1024, dtype="bf16", kernels_of="T4"),
    Case("gpt2-t4-kernels-fp16", "gpt2", 8, seq_len=1024, dtype="fp16", kernels_of="T4"),
)

# --quick: the same recipes on tiny configs, small batches (the stand-in runs them in seconds)
QUICK_MODEL = {"gpt2": "tiny-gpt2", "qwen": "tiny-llama", "llama-1b": "tiny-llama", "llama-8b": "tiny-llama",
               "resnet50": "cnn"}
# "context+N": a card N larger than the CUDA context measured here (tiny runs fit there on any GPU,
# beside the cuBLAS workspaces: 65 MiB on a Hopper card)
QUICK_CARDS = {"T4": "context+100MiB", "24GiB": "context+120MiB", "40GiB": "context+140MiB", "H100": "context+160MiB"}
RELATIVE = "context+"


def quick_cases(cases: Sequence[Case] = CASES) -> list[Case]:
    """``cases`` scaled down: tiny configs, batch 2 (8 for images), 64 positions, LoRA rank 4, small
    emulated cards (a few tens of MiB beyond the CUDA context measured on the device)."""
    out = []
    for c in cases:
        opts = {k: (4 if k == "lora" else v) for k, v in c.options.items()}
        out.append(dataclasses.replace(
            c, model=QUICK_MODEL.get(c.model, c.model), batch=8 if c.model == "resnet50" else min(c.batch, 2),
            seq_len=None if c.seq_len is None else 64, options=opts,
            fit_cards=tuple(QUICK_CARDS.get(x, x) for x in c.fit_cards),
            prompt_len=min(c.prompt_len, 48), new_tokens=min(c.new_tokens, 4)))
    return out


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
                     "—" if r.predict_seconds is None else f"{r.predict_seconds:.1f}",
                     "—" if r.run_seconds is None else f"{r.run_seconds:.1f}"])
    L += gv._table(["case", "model", "recipe", "batch", "seq", "result", "predicted allocated",
                    "real allocated", "verdict", "predicted reserved", "real reserved", "verdict",
                    "predicted process", "NVML used", "verdict", "predict s", "run s"], rows) + [""]
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

def predict(case: Case, model, device=None) -> dict[str, Any]:
    """The fake engine's answer for the case, following ``device``'s kernels (``device_card``):
    tracker peak, blocks, and its events (replayed for the reserved peak by ``simulated_reserved``,
    once the device's free memory is known)."""
    import gpulab
    from gpulab.measure.engines import allocator_blocks
    if case.kind == "generate":
        from gpulab.measure.cuda_card import kernel_target
        from gpulab.predict.generation import generation_peak
        with kernel_target(getattr(device, "kernel_target", None)):
            g = generation_peak(model, prompt_len=case.prompt_len, new_tokens=case.new_tokens, batch=case.batch,
                                dtype=case.dtype or "bf16")
        return {"tensors": g.peak_bytes, "allocated": g.peak_bytes, "events": g.measurement.tracking.events}
    if case.kernels_of:
        from gpulab.predict.cards import parse_gpu
        device = parse_gpu(case.kernels_of)
    res = gpulab.step(model, batch=case.batch, seq_len=case.seq_len, optimizer=case.optimizer, steps=STEPS,
                      engine="fake", dtype=case.dtype, guard=False, **_step_options(case),
                      **_gpu_keyword(gpulab.step, device))
    m = res.measurement
    if m.oom:
        raise RuntimeError(f"the fake run ran out of memory: {m.error}")
    events = m.tracking.events
    if res.inductor_peak_bytes is not None:   # compile: inductor's own plan (the op-by-op run is its upper bound)
        return {"tensors": res.inductor_peak_bytes, "allocated": res.inductor_peak_bytes, "events": events}
    return {"tensors": res.peak_bytes, "allocated": allocator_blocks(events).peak_bytes, "events": events}


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
    replaced by bitsandbytes' ``Linear4bit`` (NF4, double quantization, computing in ``dtype``,
    quantized as it moves to the GPU), then peft's LoRA adapters (gpulab's ``wrap_lora``: the same
    rank, layers and dropout as the prediction)."""
    import bitsandbytes as bnb
    import torch
    from gpulab.models.lora import default_targets, wrap_lora
    with torch.device(device):
        model = w.make(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False,
                                             compress_statistics=True, quant_type="nf4").to(device)
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


def _plain_optimizer(case: Case, params):
    if case.optimizer == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=1e-3)
    from gpulab.training.optimizers import make_optimizer
    return make_optimizer(case.optimizer, params)


def plain_train(case: Case, model, batch: int, stand_in: bool, after_build: Callable[[], None]) -> None:
    """``STEPS`` training steps of ``case`` at ``batch`` in plain PyTorch on ``cuda``: model,
    optimizer, one batch, then zero_grad / forward / backward / step (the one loop's order:
    ``zero_grad(set_to_none=True)`` at the top of every step from the second on).
    ``after_build()`` is called once the model exists (frees transients, resets the peaks)."""
    import torch
    from gpulab.models.workload import forward, resolve_workload
    from gpulab.training.chunked_loss import chunked_lm_loss
    from gpulab.training.loop import recipe_workload, user_recipe
    opts = _step_options(case)
    amp = opts.pop("amp", None)
    chunks = opts.pop("chunked_loss", 0)
    compiled = opts.pop("compile", False)
    w = resolve_workload(model, batch=batch, seq_len=case.seq_len)
    dev = torch.device("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[case.dtype]
    torch.manual_seed(0)
    if opts.get("quantize"):
        net = _bnb_qlora_model(w, case, dt or torch.float32, dev)
    else:   # LoRA and checkpointing as the prediction's workload builds them (peft, transformers)
        recipe = user_recipe(case.optimizer if case.optimizer != "adamw8bit" else "adamw", **opts)
        net = recipe_workload(w, recipe).build(dev, dt)
    opt = _plain_optimizer(case, [p for p in net.parameters() if p.requires_grad])
    run_net = net
    with torch.device(dev):
        data = w.inputs(batch, dt)
    autocast = (lambda: torch.autocast("cuda", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[amp])) \
        if amp else contextlib.nullcontext
    if compiled:   # inductor on a GPU; the stand-in's meta tensors cannot run generated code
        torch._dynamo.reset()
        run_net = torch.compile(net, backend="aot_eager_decomp_partition" if stand_in else "inductor")
        with autocast():
            loss = w.loss(forward(run_net, data), data)
        loss.backward()
        del loss
        net.zero_grad(set_to_none=True)
    after_build()
    for i in range(STEPS):
        if i:
            opt.zero_grad(set_to_none=True)
        with autocast():
            if chunks:
                loss = chunked_lm_loss(net, data, chunks)
            else:
                output = forward(run_net, data)
                loss = w.loss(output, data)
                del output
        loss.backward()
        del loss
        opt.step()
    torch.cuda.synchronize()


def plain_generate(case: Case, model, after_build: Callable[[], None]) -> None:
    """``model.generate()`` in plain transformers: random weights in ``case.dtype``, a random prompt
    with an all-ones attention mask, greedy, exactly ``new_tokens`` new tokens."""
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
    with torch.no_grad():
        out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=case.new_tokens,
                           min_new_tokens=case.new_tokens, do_sample=False, pad_token_id=0)
    del out
    torch.cuda.synchronize()


def _after_build() -> None:
    import torch
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def plain_run(case: Case, model, batch: int, stand_in: bool) -> dict[str, int]:
    """The case's plain run at ``batch``; refused if a dispatch mode is on (on a GPU none may be:
    the stand-in is one itself). Returns the attention kernels forced (``case.kernels_of``: a
    card's, ``forced_attention``) by name and count; else {}."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    mode = _get_current_dispatch_mode()
    if mode is not None and not stand_in:
        raise RuntimeError(f"a dispatch mode ({type(mode).__name__}) is on: the plain step would not be plain")
    if case.kind == "generate":
        plain_generate(case, model, _after_build)
        return {}
    with forced_attention(case.kernels_of) as used:
        plain_train(case, model, batch, stand_in, _after_build)
    return dict(used)


# ---- one case ------------------------------------------------------------------------------------

def measure_case(case: Case, *, stand_in: bool, context_assumed: int, do_fit: bool = True,
                 case_limit: float = DEFAULT_CASE_LIMIT_S, say: Callable[[str], None] = lambda _m: None,
                 device=None) -> CaseRun:
    """One case: prediction, plain run, comparisons, fit checks. Never raises (but
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
    t_case = time.monotonic()
    try:
        with time_limit(case_limit):
            _, model = model_arg(case)
            t0 = time.monotonic()
            pred = predict(case, model, device)
            run.predict_seconds = round(time.monotonic() - t0, 2)
            run.predicted_tensors, run.predicted_allocated = pred["tensors"], pred["allocated"]
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
            forced = plain_run(case, model, case.batch, stand_in)
            if case.kernels_of:
                run.note = ((run.note + "; ") if run.note else "") + (
                    f"{case.kernels_of}'s attention kernels forced on this GPU (sdpa_kernel, call by call): "
                    + (", ".join(f"{k} ×{n}" for k, n in sorted(forced.items())) or "no attention call"))
            run.run_seconds = round(time.monotonic() - t1, 2)
            run.real_allocated = torch.cuda.max_memory_allocated() - run.baseline_allocated
            run.real_reserved = torch.cuda.max_memory_reserved() - run.baseline_reserved
            used = mgpu.nvml_used_bytes(0)
            run.nvml_used = None if used is None else int(used)
            if used is not None:
                run.context_now = int(used) - torch.cuda.memory_reserved()
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
             progress: Callable[[str], None] | None = None) -> Report:
    """Every case on CUDA device 0, the report rewritten after each. ``cases``: the list (default
    ``CASES``, scaled down with ``quick``); ``names``: only these. ``merge``: keep the cases of
    ``out``'s earlier report (same GPU) that this run does not run again."""
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
    save()
    for case in todo:
        left = deadline - time.monotonic()
        if left < MIN_CASE_S:
            report.not_run.append(f"{case.name}: time limit reached")
            continue
        say(f"case {case.name} ({case.recipe_text()}, batch {case.batch})")
        r = measure_case(case, stand_in=stand_in, context_assumed=context_assumed, do_fit=do_fit,
                         case_limit=min(case_limit, left), say=say, device=device)
        report.cases.append(r)
        say(f"  {r.status}" + (f": allocated {gv._pct(allocated_check(r).difference)}, reserved "
                               f"{gv._pct(reserved_check(r).difference)}, process {gv._pct(process_check(r).difference)}"
                               if r.ran else "")
            + "".join(f"; fit {f.card}: {f.verdict}" for f in r.fit))
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
