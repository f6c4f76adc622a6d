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
from typing import Any, Callable, Iterable, Sequence

import torch

from .engines import label_recorded, release_cuda_memory, run
from .experiments import OPTIMIZERS
from .files import write_atomic
from .models import MODELS

RECORD_FORMAT = 1
ENV_DIR = "GPULAB_RECORDED_DIR"   # points the loader at another folder (tests, instructors)
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent / "recorded"

# Provenance every record must carry (validate_record checks each one is present).
PROVENANCE_FIELDS = ("gpu_name", "gpu_total_bytes", "driver", "cuda_runtime", "cudnn", "torch",
                     "torchvision", "gpulab_version", "gpulab_commit", "date", "command", "stand_in")
# What a GPU that is not one says in its name (tests/cuda_standin.py's "stand-in GPU (no CUDA)").
STAND_IN_MARKERS = ("stand-in", "no cuda")


@dataclass(frozen=True)
class RecordExperiment:
    """One entry of the record set: data only, run by ``run_experiment``."""
    name: str
    kind: str                      # "step", "fragmentation", "allocator timeline", "rounding",
                                   # "tensor bytes", "layer build", "model build", "implementations",
                                   # "modelsize", "depthwise", "forward table", "inference vs training", "inplace", "grad modes",
                                   # "lifetimes", "checkpoint", "precision"
    params: dict[str, Any] = field(default_factory=dict)
    serves: str = ""               # the lesson panel that shows it
    quick: bool = False            # part of ``--quick``


def _step(name: str, model: str, batch: int, image_size: int, optimizer: str, serves: str,
          quick: bool = False, steps: int = 1) -> RecordExperiment:
    return RecordExperiment(name, "step", {"model": model, "batch": batch, "image_size": image_size,
                                           "optimizer": optimizer, "dtype": "float32", "steps": steps},
                            serves, quick)


CHECKPOINT_SEGMENTS = "every k from 1 to N"   # the checkpoint panel's default choice of k


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

def _fragmentation_experiment(n: int, block_mib: int, big_mib: int):
    """``replay.fragmentation_events`` made of real tensors (same sizes, same order)."""
    from .replay import fragmentation_events

    def experiment(ctx) -> None:
        live: dict[int, torch.Tensor] = {}
        for ev in fragmentation_events(n, block_mib, big_mib):
            if ev["kind"] == "alloc":
                live[ev["sid"]] = torch.empty(ev["nbytes"], dtype=torch.uint8, device=ctx.device)
            else:
                del live[ev["sid"]]
        ctx.snapshot("end")
    return experiment


def run_experiment(exp: RecordExperiment) -> dict[str, Any]:
    """Run one entry on the cuda engine; its result as a JSON-able dict."""
    if exp.kind == "step":
        from .experiments import training_step
        return training_step(engine="cuda", **exp.params).as_dict()
    if exp.kind == "fragmentation":
        m = run(_fragmentation_experiment(**exp.params), engine="cuda")
        from .replay import fragmentation_events, replay_events
        sim = replay_events(fragmentation_events(**exp.params))
        return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
                "allocator": dict(m.allocator or {}), "seconds": round(m.seconds, 4), "oom": m.oom,
                "error": m.error, "simulated_peak_allocated": sim.peak_allocated,
                "simulated_peak_reserved": sim.peak_reserved}
    if exp.kind == "allocator timeline":
        return _allocator_timeline(**exp.params)
    if exp.kind == "tensor bytes":
        from .tensor_run import operation, tensor_as_dict, tensor_experiment
        from .units import parse_dtype
        p = exp.params
        shape = tuple(int(v) for v in p["shape"].split(","))
        m = run(tensor_experiment(shape, parse_dtype(p["dtype"]), operation(p["operation"])), engine="cuda")
        return {**p, **tensor_as_dict(m)}
    if exp.kind == "rounding":
        from .rounding_run import rounding_as_dict, rounding_experiment
        from .units import parse_dtype
        dt = parse_dtype(exp.params["dtype"])
        elements = list(range(exp.params["max_elements"] + 1))
        m = run(rounding_experiment(elements, dt), engine="cuda")
        return rounding_as_dict(m, elements, [e * dt.itemsize for e in elements])
    if exp.kind == "implementations":
        from .models import resolve_model
        from .optimizer_run import implementations_as_dict
        p = exp.params
        return {**p, **implementations_as_dict(resolve_model(p["model"]), p["optimizer"], p["batch"],
                                               p["image_size"], "cuda", steps=p["steps"])}
    if exp.kind == "layer build":
        from .params_run import build_as_dict, layer_experiment, layer_repr
        from .units import parse_dtype
        p = exp.params
        shape = (p["kind"], p["in_size"], p["out_size"], p["kernel"], p["groups"], p["bias"])
        if layer_repr(*shape) != p["layer"]:
            raise ValueError(f"the layer entry names {p['layer']!r} but builds {layer_repr(*shape)!r}")
        return {**p, **build_as_dict(run(layer_experiment(parse_dtype(p["dtype"]), *shape), engine="cuda"))}
    if exp.kind == "model build":
        from .models import resolve_model
        from .params_run import build_as_dict, build_experiment
        from .units import parse_dtype
        m = run(build_experiment(resolve_model(exp.params["model"]), parse_dtype(exp.params["dtype"])), engine="cuda")
        return {**exp.params, **build_as_dict(m)}
    if exp.kind == "depthwise":
        from .activations_run import depthwise_as_dict, depthwise_experiment
        from .units import parse_dtype
        p = exp.params
        m = run(depthwise_experiment(p["in_channels"], p["out_channels"], p["image_size"], p["batch"], p["bn_relu"],
                                     parse_dtype(p["dtype"])), engine="cuda")
        return {**p, **depthwise_as_dict(m)}
    if exp.kind == "modelsize":
        from .activations_run import modelsize_as_dict
        from .units import parse_dtype
        p = exp.params
        return {**p, **modelsize_as_dict(p["models"], p["batch"], parse_dtype(p["dtype"]), "cuda")}
    if exp.kind in ("forward table", "inference vs training"):
        from .activations_run import (
            forward_pair_as_dict,
            forward_table_as_dict,
            forward_table_experiment,
            run_forward_pair,
        )
        from .models import resolve_model
        from .units import parse_dtype
        p = exp.params
        args = (resolve_model(p["model"]), p["batch"], p["image_size"], parse_dtype(p["dtype"]))
        if exp.kind == "forward table":
            return {**p, **forward_table_as_dict(run(forward_table_experiment(*args), engine="cuda"))}
        return {**p, **forward_pair_as_dict(*run_forward_pair(*args, "cuda"))}
    if exp.kind == "inplace":
        from .inplace_run import inplace_as_dict, run_inplace_pair
        runs = run_inplace_pair(engine="cuda", **exp.params)
        first = runs[False].measurement
        return {"engine": first.engine, "device": first.device, "label": first.label, **exp.params,
                "runs": inplace_as_dict(runs)}
    if exp.kind == "grad modes":
        from .inference_run import modes_as_dict, run_modes
        runs = run_modes(engine="cuda", **exp.params)
        first = next(iter(runs.values()))
        return {"engine": first.engine, "device": first.device, "label": first.label, **exp.params,
                "runs": modes_as_dict(runs)}
    if exp.kind == "lifetimes":
        from .inference_run import lifetimes_as_dict, run_lifetimes
        runs = run_lifetimes(engine="cuda", **exp.params)
        first = next(iter(runs.values()))
        return {"engine": first.engine, "device": first.device, "label": first.label, **exp.params,
                "runs": lifetimes_as_dict(runs)}
    if exp.kind == "checkpoint":
        from .checkpoint_run import run_checkpoint_sweep
        p = exp.params
        if p["segments"] != CHECKPOINT_SEGMENTS:
            raise ValueError(f"the checkpoint record runs {CHECKPOINT_SEGMENTS!r}, got {p['segments']!r}")
        return run_checkpoint_sweep(p["n_blocks"], p["width"], p["batch"], list(range(1, p["n_blocks"] + 1)),
                                    "cuda", repeats=p["repeats"]).as_dict()
    if exp.kind == "precision":
        from .models import resolve_model
        from .precision_run import modes, run_precision_modes, runs_as_dict
        p = exp.params
        runs = run_precision_modes(resolve_model(p["model"]), p["batch"], p["image_size"], p["optimizer"],
                                   modes(p["low"]), "cuda", p["steps"])
        first = runs["fp32"].measurement
        return {"engine": first.engine, "device": first.device, "label": first.label, **p,
                "runs": runs_as_dict(runs)}
    raise ValueError(f"unknown record kind {exp.kind!r}")


def _allocator_timeline(workload: str, model: str, batch: int, steps: int, optimizer: str,
                        expandable_segments: bool, empty_cache: bool) -> dict[str, Any]:
    """Lesson 09's training step on the GPU: the real allocator read after every op, and the
    simulator's replay of the same run's tracked events."""
    from .models import resolve_model
    from .real_timeline import AllocatorSampler, sampled, timeline
    from .replay import _steps_experiment, replay_events, tracked_events
    if workload != "training step" or expandable_segments or empty_cache:
        raise ValueError("the allocator timeline records the default training-step workload only")
    sampler = AllocatorSampler(0)
    m = run(sampled(_steps_experiment(resolve_model(model), [batch] * steps, optimizer), sampler), engine="cuda")
    sim = replay_events(tracked_events(m)) if m.tracking is not None and not m.oom else None
    return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
            "peak_by_category": dict(m.peak_by_category), "allocator": dict(m.allocator or {}),
            "seconds": round(m.seconds, 4), "oom": m.oom, "error": m.error,
            "timeline": timeline(sampler).as_dict(),
            "simulated_peak_allocated": sim.peak_allocated if sim else None,
            "simulated_peak_reserved": sim.peak_reserved if sim else None}


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


def is_stand_in(gpu_name: str) -> bool:
    low = str(gpu_name).lower()
    return any(m in low for m in STAND_IN_MARKERS)


def provenance(command: Sequence[str] | None = None, device: int = 0) -> dict[str, Any]:
    """Where a record comes from: the GPU, driver, CUDA runtime, cuDNN, torch, torchvision, gpulab
    (version and commit), the date (UTC) and the command."""
    import importlib.metadata

    import torchvision

    from .gpu import device_report
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
    from .replay import beyond_allocator_bytes
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


# --- reading records back -----------------------------------------------------------------------

def validate_record(data: Any) -> list[str]:
    """What is wrong with a record (empty: it may ship and be shown). A stand-in GPU's record,
    a missing provenance field or a missing result is refused."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    problems = []
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        return ["no provenance"]
    missing = [f for f in PROVENANCE_FIELDS if f not in prov]
    if missing:
        problems.append(f"provenance lacks {', '.join(missing)}")
    for f in ("gpu_name", "date", "torch", "driver"):
        if f in prov and not prov[f]:
            problems.append(f"provenance field {f} is empty")
    if prov.get("stand_in") or is_stand_in(prov.get("gpu_name", "")):
        problems.append(f"recorded on a stand-in, not a GPU ({prov.get('gpu_name')})")
    exps = data.get("experiments")
    if not isinstance(exps, list) or not exps:
        problems.append("no experiments")
    else:
        for i, e in enumerate(exps):
            if not isinstance(e, dict) or not {"kind", "params", "result"} <= e.keys() \
                    or not isinstance(e["params"], dict) or not isinstance(e["result"], dict):
                problems.append(f"experiment {i} lacks kind, params or result")
            elif e["result"].get("engine") != "cuda":
                problems.append(f"experiment {i} was not measured on the cuda engine")
    return problems


@dataclass
class Record:
    path: pathlib.Path
    data: dict[str, Any]

    @property
    def provenance(self) -> dict[str, Any]:
        return self.data["provenance"]

    @property
    def label(self) -> str:
        return record_label(self.provenance)


def record_label(prov: dict[str, Any]) -> str:
    """``recorded on <GPU name>, <date>, torch <version>``."""
    return label_recorded(prov["gpu_name"], prov["date"], prov["torch"])


def records_dir(directory: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder records are read from: ``directory``, else $GPULAB_RECORDED_DIR, else the package's."""
    if directory is not None:
        return pathlib.Path(directory)
    return pathlib.Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else PACKAGE_DIR


def scan_records(directory: str | os.PathLike | None = None) -> tuple[list[Record], dict[str, list[str]]]:
    """Every ``*.json`` in the folder: the valid records, and the refused files with why."""
    good, refused = [], {}
    folder = records_dir(directory)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            refused[path.name] = [f"unreadable: {exc}"]
            continue
        problems = validate_record(data)
        if problems:
            refused[path.name] = problems
        else:
            good.append(Record(path, data))
    return good, refused


def load_records(directory: str | os.PathLike | None = None) -> list[Record]:
    """The valid records (stand-ins and files without full provenance are skipped)."""
    return scan_records(directory)[0]


@dataclass
class RecordLookup:
    """``find_record``'s answer: the recorded result and its label, or None and why. When records
    exist but none has these settings, ``mismatch`` says what was recorded instead (the part of
    ``reason`` after ``NO_MATCH``), for views that word the sentence their own way."""
    result: dict[str, Any] | None
    label: str = ""
    reason: str = ""
    provenance: dict[str, Any] | None = None
    mismatch: str = ""

    def __bool__(self) -> bool:
        return self.result is not None


NO_RECORDS = "no GPU recordings ship with this version of gpulab yet"
NO_MATCH = "no record for these settings"
_PLURALS = {"batch": "batch sizes", "image_size": "image sizes", "n_blocks": "block counts N",
            "low": "16-bit dtypes", "steps": "step counts", "expandable_segments": "expandable_segments settings",
            "empty_cache": "empty_cache settings", "max_elements": "largest element counts",
            "grad_mode": "modes", "layer": "layers"}


def _values(entries: Iterable[dict[str, Any]], key: str) -> str:
    vals = sorted({tuple(v) if isinstance(v, list) else v for v in (e["params"].get(key) for e in entries)},
                  key=lambda v: (str(type(v)), v))
    return ", ".join(str(v) for v in vals)


def find_record(kind: str, directory: str | os.PathLike | None = None, **params: Any) -> RecordLookup:
    """The recorded result of ``kind`` with exactly these parameters (the first record that has
    one), or a ``RecordLookup`` with ``result=None`` whose ``reason`` says what was recorded
    instead ("no record for these settings: recorded batch sizes for cnn, sgd are 8, 16, 32")."""
    records = load_records(directory)
    if not records:
        return RecordLookup(None, reason=NO_RECORDS)
    entries = [(r, e) for r in records for e in r.data["experiments"] if e["kind"] == kind]
    if not entries:
        return _no_match(f"no {kind} experiment was recorded")
    matched: list[str] = []
    for key, want in params.items():
        left = [(r, e) for r, e in entries if e["params"].get(key) == want]
        if not left:
            where = f" for {', '.join(matched)}" if matched else ""
            name = _PLURALS.get(key, key.replace("_", " ") + "s")
            return _no_match(f"({key} {want}): recorded {name}{where} are "
                             f"{_values((e for _, e in entries), key)}")
        entries = left
        matched.append(f"{key} {want}")
    rec, entry = entries[0]
    return RecordLookup(entry["result"], rec.label, "", rec.provenance)


def find_allocator_record(run: Any, directory: str | os.PathLike | None = None) -> RecordLookup:
    """The recorded GPU run of a lesson-09 workload (``replay.workload``'s ``AllocatorRun``: its
    workload, settings, expandable_segments, empty_cache_every_step), or why there is none."""
    flags = {"expandable_segments": run.expandable_segments, "empty_cache": run.empty_cache_every_step}
    if run.workload == "fragmentation":
        if any(flags.values()):
            if not load_records(directory):
                return RecordLookup(None, reason=NO_RECORDS)
            return _no_match("(expandable segments or empty_cache): the fragmentation scenario was "
                             "recorded with neither")
        return find_record("fragmentation", directory, **run.settings)
    return find_record("allocator timeline", directory, workload=run.workload, **run.settings, **flags)


def find_record_series(kind: str, key: str, values: Sequence[Any], directory: str | os.PathLike | None = None,
                       **params: Any) -> RecordLookup:
    """``find_record`` for each of ``values`` of ``key`` (e.g. every batch of a sweep), the other
    parameters fixed: ``result["points"]`` holds the recorded results in that order, labelled by
    the first one's record; when one is missing, that lookup (its note names what was recorded)."""
    points, first = [], None
    for v in values:
        hit = find_record(kind, directory, **params, **{key: v})
        if not hit:
            return hit
        first = first or hit
        points.append(hit.result)
    if first is None:
        return RecordLookup(None, reason=f"{NO_MATCH}: no {key} given")
    return RecordLookup({"points": points}, first.label, "", first.provenance)


def _no_match(what: str) -> RecordLookup:
    """No record has these settings; ``what`` says what was recorded instead."""
    sep = " " if what.startswith("(") else ": "
    return RecordLookup(None, reason=f"{NO_MATCH}{sep}{what}", mismatch=what)
