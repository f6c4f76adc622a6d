"""``gpulab record``: measure a fixed set of experiments on a real GPU, and read such records back.

A CPU-only student sees real GPU numbers only through **recorded runs**: JSON files that
``gpulab record`` wrote on a GPU and that ship in ``gpulab/recorded/`` (see its README.md). Every
figure read from one is labelled ``recorded on <GPU>, <date>, torch <version>``
(``engines.label_recorded``).

The record set (``EXPERIMENTS``, plain data: name, kind, parameters, the lesson panel it serves)
holds only what the library itself runs, so the command never imports the course:

* ``step`` (lesson 04's step panel, ``gpulab step``): one training step of every CLI model (vgg16,
  alexnet, resnet18, cnn, mlp) × sgd / momentum / adam, float32, at the model's default batch and
  image size, plus the step panel's default (cnn, batch 32, adam); every step entry names its
  ``steps``;
* ``step`` at growing batch sizes (lesson 04's batch sweep and largest-batch check): cnn at batch
  8 … 256 and resnet18 at batch 1 … 32, sgd, float32; the sweep panel's default (cnn, adam,
  batch 4, 8, 16, 32, two steps each: its steady state);
* ``step`` of mlp at batch 8 with each of ``OPTIMIZERS`` (lesson 05's optimizer panel, its default);
* ``implementations`` (lesson 05's implementation panel, its default): ``optimizer_run``'s two
  adam steps of mlp at batch 8 with the for-loop, foreach and fused implementations;
* ``fragmentation`` (lesson 09's allocator panel): the scenario of
  ``replay.fragmentation_events`` allocated for real on the GPU (8 × 6 MiB, every other freed,
  then 4 × 12 MiB), with the allocator's own counters;
* ``allocator timeline`` (lesson 09: the allocator panel's default and the lesson's step): two
  tracked sgd steps of cnn at batch 32 (``replay``'s "training step" workload), with the real
  ``memory_allocated`` / ``memory_reserved`` read after every op (``real_timeline``, at most
  2000 points) and the simulator's replay of the same run's events;
* ``tensor bytes`` (lesson 01's tensor-bytes panel, its default): ``tensor_run``'s
  ``x = torch.empty(256, 3, 100, 100)``, ``y = x[:1]``, ``del x`` on the GPU;
* ``rounding`` (lesson 01's 512-byte panel, its default): float32 tensors of 0 … 300 elements,
  ``memory_allocated`` after each (``rounding_run``);
* ``layer build`` (lesson 02's one-layer panel, its default): ``params_run.make_layer``'s
  Conv2d(64, 128, 3) built on the GPU, float32;
* ``model build`` (lesson 02's parameters panel, on vgg16 and alexnet as the lesson opens it):
  ``params_run`` builds the model on the GPU, float32; live parameter and buffer bytes, the
  allocator's counters;
* ``forward table`` and ``inference vs training`` (lesson 03's forward-table and inference panels,
  their defaults): ``activations_run``'s traced forward of vgg16 at batch 1, 224×224, float32, under
  ``no_grad`` (eval), and with grad (train);
* ``depthwise`` (lesson 03's depthwise panel, its default): a standard 3×3 block and a
  depthwise-separable one, 64 → 128 channels, 56×56, batch 8, with BN + ReLU;
* ``modelsize`` (lesson 03's modelsize panel, its default): every lesson model at its default
  image size, batch 1, float32: what autograd saves, the backward peak, the no_grad peak;
* ``inplace`` (lesson 06's in-place panel, its default): ``inplace_run``'s conv-ReLU stack (4 blocks,
  16 channels, batch 8, 32×32, a training step) with ``ReLU(inplace=False)`` and ``inplace=True``;
* ``grad modes`` and ``lifetimes`` (lesson 06's grad-mode and lifetimes panels, their defaults):
  ``inference_run``'s forward in each train/eval × grad/no_grad/inference_mode mode (batch 64, 32
  channels, 32×32), and its small U-Net written with names kept and with ``del`` (no_grad forward,
  batch 8, 16 channels, 64×64);
* ``checkpoint`` (lesson 07's checkpoint panel, its default): ``checkpoint_run`` over every k
  from 1 to 16 blocks of Linear(128, 128) + ReLU at batch 512, peaks per k and step times;
* ``precision`` (lesson 08's mixed-precision panel, its default): ``precision_run``'s fp32,
  autocast bf16 and pure bf16 steps of cnn at batch 32 with adam;
* ``throughput`` and ``checkpoint cost`` (lessons 04, 07 and 11: real GPU seconds, issue 48): a plain
  AdamW step of Qwen2.5-0.5B in bf16 at 1024 positions timed (``record.runs.llm_time``: warm-up, then
  synchronized calls, the median) at batch 1, 2, 4, 8 and 16 (tokens a second, the allocator's peak; a
  batch that does not fit is recorded as out of memory), and at batch 8 with checkpointing off, full
  and selective (each policy's slowdown over none);
* the CUDA context estimate (lesson 09, lesson 00): NVML used − ``memory_reserved`` before the
  experiments, in the record's ``device`` section.

NB: lesson 03's FLOPs panel (formulas and meta tensors only) and lesson 04's largest-batch panel
(fake tensors, and a real run only on a GPU of the chosen size) are not recorded.
``--quick`` records a small subset (the two small models with one optimizer, the fragmentation
scenario, the allocator timeline) to check the command itself.

Each result is a plain JSON-able dict: a step's is ``StepResult.as_dict()`` (per-category peaks,
the allocator's ``memory_allocated`` / ``max_memory_allocated`` / ``memory_reserved`` peaks and
baselines of the run, NVML used, timings). Records from the test suite's stand-in GPU are refused
by ``validate_record``: only a real GPU's numbers may ever be shown as recorded.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gpulab.measure.engines import release_cuda_memory
from gpulab.training.optimizers import OPTIMIZERS
from gpulab.files import write_atomic
from gpulab.models.registry import MODELS

from gpulab.record.kinds import kinds
from gpulab.record.lookup import RECORD_FORMAT, is_stand_in
from gpulab.record.runs.checkpoint import CHECKPOINT_SEGMENTS
from gpulab.record.runs.llm_time import POLICIES

LLM_TIME_MODEL = "hf:qwen2.5-0.5b"   # the throughput and checkpoint-cost sweeps' model (lessons 07, 11)

__all__ = [
    "CHECKPOINT_SEGMENTS", "EXPERIMENTS", "RecordExperiment", "experiment_set", "provenance",
    "record", "record_path", "run_experiment", "slug", "write_record"
]

@dataclass(frozen=True)
class RecordExperiment:
    """One entry of the record set: data only, run by ``run_experiment``."""
    name: str
    kind: str                      # "step", "fragmentation", "allocator timeline", "rounding",
                                   # "tensor bytes", "layer build", "model build", "implementations",
                                   # "modelsize", "depthwise", "forward table", "inference vs training", "inplace", "grad modes",
                                   # "lifetimes", "checkpoint", "precision", "throughput", "checkpoint cost"
    params: dict[str, Any] = field(default_factory=dict)
    serves: str = ""               # the lesson panel that shows it
    quick: bool = False            # part of ``--quick``


def _step(name: str, model: str, batch: int, image_size: int, optimizer: str, serves: str,
          quick: bool = False, steps: int = 1) -> RecordExperiment:
    return RecordExperiment(name, "step", {"model": model, "batch": batch, "image_size": image_size,
                                           "optimizer": optimizer, "dtype": "float32", "steps": steps},
                            serves, quick)


def _experiments() -> tuple[RecordExperiment, ...]:
    defaults = {"vgg16": (1, 224), "alexnet": (1, 224), "resnet18": (1, 224), "cnn": (32, 32), "mlp": (32, 32)}
    out = []
    for model, (batch, size) in defaults.items():
        for opt in ("sgd", "momentum", "adam"):
            out.append(_step("step", model, batch, size, opt, "lesson 04 step panel, lesson 05, gpulab step",
                             quick=model in ("cnn", "mlp") and opt == "sgd"))
    out.append(_step("step", "cnn", 32, 32, "adam", "lesson 04 step panel (its default)"))
    for b in (8, 16, 64, 128, 256):
        out.append(_step("batch sweep", "cnn", b, 32, "sgd", "lesson 04 batch sweep, largest batch"))
    for b in (2, 4, 8, 16, 32):
        out.append(_step("batch sweep", "resnet18", b, 224, "sgd", "lesson 04 batch sweep, largest batch"))
    for b in (4, 8, 16, 32):      # the sweep panel's default: largest 32, two steps each
        out.append(_step("sweep panel", "cnn", b, 32, "adam", "lesson 04 sweep panel (its default)", steps=2))
    for opt in OPTIMIZERS:        # the optimizer panel's default: mlp, batch 8, one step each
        out.append(_step("optimizer panel", "mlp", 8, 32, opt, "lesson 05 optimizer panel (its default)"))
    out.append(RecordExperiment("fragmentation", "fragmentation", {"n": 8, "block_mib": 6, "big_mib": 12},
                                "lesson 09 allocator panel (fragmentation)", quick=True))
    out.append(RecordExperiment("allocator timeline", "allocator timeline",
                                {"workload": "training step", "model": "cnn", "batch": 32, "steps": 2,
                                 "optimizer": "sgd", "expandable_segments": False, "empty_cache": False},
                                "lesson 09 allocator panel (its default), lesson 09's reserved timeline", quick=True))
    out.append(RecordExperiment("tensor bytes", "tensor bytes",
                                {"shape": "256,3,100,100", "dtype": "float32", "operation": "slice"},
                                "lesson 01 tensor-bytes panel (its default)"))
    out.append(RecordExperiment("512-byte blocks", "rounding", {"dtype": "float32", "max_elements": 300},
                                "lesson 01 rounding panel (its default)"))
    out.append(RecordExperiment("optimizer implementations", "implementations",
                                {"model": "mlp", "optimizer": "adam", "batch": 8, "image_size": 32, "steps": 2},
                                "lesson 05 implementation panel (its default)"))
    out.append(RecordExperiment("layer build", "layer build",
                                {"layer": "Conv2d(64, 128, kernel_size=(3, 3), stride=(1, 1))", "kind": "Conv2d",
                                 "in_size": 64, "out_size": 128, "kernel": 3, "groups": 1, "bias": True,
                                 "dtype": "float32"}, "lesson 02 one-layer panel (its default)"))
    for model in ("vgg16", "alexnet"):   # lesson 02 opens the parameters panel on both
        out.append(RecordExperiment("model build", "model build", {"model": model, "dtype": "float32"},
                                    "lesson 02 parameters panel (its defaults)"))
    vgg = {"model": "vgg16", "batch": 1, "image_size": 224, "dtype": "float32"}
    out.append(RecordExperiment("forward table", "forward table", dict(vgg), "lesson 03 forward-table panel (its default)"))
    out.append(RecordExperiment("inference vs training", "inference vs training", dict(vgg),
                                "lesson 03 inference panel (its default)"))
    out.append(RecordExperiment("depthwise-separable", "depthwise",
                                {"in_channels": 64, "out_channels": 128, "image_size": 56, "batch": 8, "bn_relu": True,
                                 "dtype": "float32"}, "lesson 03 depthwise panel (its default)"))
    out.append(RecordExperiment("modelsize", "modelsize", {"models": list(MODELS), "batch": 1, "dtype": "float32"},
                                "lesson 03 modelsize panel (its default)"))
    out.append(RecordExperiment("ReLU(inplace=True)", "inplace",
                                {"block": "conv-relu", "depth": 4, "channels": 16, "batch": 8, "image_size": 32,
                                 "mode": "train step"}, "lesson 06 inplace panel (its default)"))
    out.append(RecordExperiment("grad modes", "grad modes", {"batch": 64, "channels": 32, "image_size": 32},
                                "lesson 06 grad-mode panel (its default)"))
    out.append(RecordExperiment("del in forward", "lifetimes",
                                {"grad_mode": "no_grad forward", "batch": 8, "channels": 16, "image_size": 64},
                                "lesson 06 lifetimes panel (its default)"))
    out.append(RecordExperiment("checkpoint sweep", "checkpoint",
                                {"n_blocks": 16, "width": 128, "batch": 512, "segments": CHECKPOINT_SEGMENTS,
                                 "repeats": 7}, "lesson 07 checkpoint panel (its default)"))
    out.append(RecordExperiment("autocast", "precision",
                                {"model": "cnn", "batch": 32, "image_size": 32, "optimizer": "adam",
                                 "low": "bfloat16", "steps": 2}, "lesson 08 mixed-precision panel (its default)"))
    llm = {"model": LLM_TIME_MODEL, "seq_len": 1024, "dtype": "bf16", "optimizer": "adamw", "warmup": 2, "repeats": 5}
    out.append(RecordExperiment("throughput sweep", "throughput", {**llm, "batches": [1, 2, 4, 8, 16]},
                                "lessons 04 and 11: throughput against the batch (real GPU seconds)"))
    out.append(RecordExperiment("checkpointing's time cost", "checkpoint cost",
                                {**llm, "batch": 8, "policies": list(POLICIES)},
                                "lessons 07 and 11: checkpointing's time cost (real GPU seconds)"))
    seen, unique = set(), []
    for e in out:   # the step panel's default repeats an entry of the grid: keep one
        key = (e.kind, json.dumps(e.params, sort_keys=True))
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return tuple(unique)


EXPERIMENTS: tuple[RecordExperiment, ...] = _experiments()


def experiment_set(quick: bool = False) -> tuple[RecordExperiment, ...]:
    return tuple(e for e in EXPERIMENTS if e.quick) if quick else EXPERIMENTS


# --- running ------------------------------------------------------------------------------------

def run_experiment(exp: RecordExperiment) -> dict[str, Any]:
    """Run one entry on the cuda engine through the kind's runner (``record.kinds``); its result
    as a JSON-able dict."""
    table = kinds()
    if exp.kind not in table:
        raise ValueError(f"unknown record kind {exp.kind!r}; known: {', '.join(sorted(table))}")
    return table[exp.kind](dict(exp.params))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=pathlib.Path(__file__).parent,
                               capture_output=True, timeout=30, check=False).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty else "")   # -dirty: gpulab/ differs from that commit


def provenance(command: Sequence[str] | None = None, device: int = 0) -> dict[str, Any]:
    """Where a record comes from: the GPU, driver, CUDA runtime, cuDNN, torch, torchvision, gpulab
    (version and commit), the date (UTC) and the command."""
    import importlib.metadata

    import torchvision

    from gpulab.measure.gpu import device_report
    report = device_report()
    gpu = next((g for g in report.gpus if g.index == device), None)
    name = torch.cuda.get_device_name(device)
    try:
        version = importlib.metadata.version("gpulab")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError as exc:   # e.g. a cuDNN too new for the device's compute capability
        cudnn = f"unusable: {exc}"
    return {
        "gpu_name": name,
        "gpu_total_bytes": int(gpu.total_bytes) if gpu else int(torch.cuda.get_device_properties(device).total_memory),
        "compute_capability": gpu.compute_capability if gpu else None,
        "driver": gpu.driver if gpu else "unknown",
        "cuda_runtime": torch.version.cuda, "cudnn": cudnn,
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "gpulab_version": version, "gpulab_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(command if command is not None else ["gpulab", *sys.argv[1:]]),
        "stand_in": is_stand_in(name),
    }


def record(quick: bool = False, command: Sequence[str] | None = None,
           progress: Callable[[int, int, RecordExperiment], None] | None = None) -> dict[str, Any]:
    """Run the record set on CUDA device 0; the whole record as a JSON-able dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("gpulab record needs a CUDA GPU (torch.cuda.is_available() is False)")
    from gpulab.predict.replay import beyond_allocator_bytes
    exps = experiment_set(quick)
    release_cuda_memory(0)
    data: dict[str, Any] = {"format": RECORD_FORMAT, "provenance": provenance(command),
                            "device": {"cuda_context_estimate": beyond_allocator_bytes(0)},
                            "quick": quick, "experiments": []}
    for i, exp in enumerate(exps):
        if progress:
            progress(i, len(exps), exp)
        data["experiments"].append({"name": exp.name, "kind": exp.kind, "params": dict(exp.params),
                                    "serves": exp.serves, "result": run_experiment(exp)})
    return data


def slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"


def record_path(out_dir: str | os.PathLike, gpu_name: str) -> pathlib.Path:
    """Where the record of ``gpu_name`` goes: ``<out_dir>/<gpu-slug>.json`` (one file per device)."""
    return pathlib.Path(out_dir) / f"{slug(gpu_name)}.json"


def write_record(data: dict[str, Any], out_dir: str | os.PathLike = ".", *, overwrite: bool = False,
                 flag: str = "overwrite=True") -> pathlib.Path:
    """Write ``<out_dir>/<gpu-slug>.json`` whole or not at all (``files.write_atomic``); an
    existing file is refused unless ``overwrite``. Returns its path."""
    path = record_path(out_dir, data["provenance"]["gpu_name"])
    return write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n", overwrite=overwrite, flag=flag)


