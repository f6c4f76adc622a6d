"""Real GPU seconds for the LLM lessons (issue 48 item 4): a small language model's training step
timed at growing batches (throughput: tokens a second against the batch) and with checkpointing
off, full and selective at one batch (its time cost), each with its peak memory.

Each point is a plain step (no tracker: its dispatch mode and hooks would slow the step it times):
the model built by the library's own workload (``models.workload``, checkpointing and the rest as
``training.loop.recipe_workload`` builds them), ``zero_grad(set_to_none=True)``, forward, loss,
backward, ``optimizer.step()``, timed by ``checkpoint.time_fn`` (warm-up calls untimed, then each
call between ``torch.cuda.synchronize`` calls, every sample kept, as nanoGPT's ``bench.py``); the
peak is the allocator's own ``max_memory_allocated`` above what was allocated before the model was
built (cuBLAS's workspaces made before, by a small matmul, so that the first point does not hold them). A batch the device cannot hold is recorded as out of memory (its memory given back), and the
sweep goes on. ``gpulab record`` stores the result as data; a lesson shows it labelled with the
record's provenance.
"""
from __future__ import annotations

import gc
import math
from typing import Any

import torch

from gpulab.record.kinds import record_kind
from gpulab.record.runs.checkpoint import time_fn

__all__ = ["POLICIES", "record_checkpoint_cost", "record_throughput", "timed_point"]

POLICIES = ("none", "full", "selective")   # checkpointing in the cost sweep ("none": off)


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def _warm_workspaces(dev: torch.device, dtype: torch.dtype) -> None:
    """A small matmul forward and backward, so that cuBLAS's workspaces (made by the first matmul on
    a handle and stream, kept for the process's life) exist before a point's peak is counted."""
    x = torch.randn(64, 64, device=dev, dtype=dtype, requires_grad=True)
    (x @ x).sum().backward()
    del x


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed_point(model: str, batch: int, seq_len: int, dtype: str, optimizer: str, checkpointing: str,
                warmup: int, repeats: int, device: str = "cuda") -> dict[str, Any]:
    """One plain training step of ``model`` at ``batch`` × ``seq_len`` timed ``repeats`` times after
    ``warmup`` untimed steps: the samples, their median and minimum, tokens a second at the median,
    and the allocator's peak above the start; ``status`` "ran" or "out of memory: ..."."""
    from gpulab.models.workload import forward, resolve_workload
    from gpulab.training.loop import recipe_workload, user_recipe
    from gpulab.training.optimizers import make_optimizer
    from gpulab.units import parse_dtype
    point: dict[str, Any] = {"batch": batch, "seq_len": seq_len, "checkpointing": checkpointing}
    dev = torch.device(device)
    _warm_workspaces(dev, parse_dtype(dtype))
    _free()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    held: list[Any] = []
    try:
        dt = parse_dtype(dtype)
        w = resolve_workload(model, batch=batch, seq_len=seq_len)
        recipe = user_recipe(optimizer, checkpointing=False if checkpointing == "none" else checkpointing)
        net = recipe_workload(w, recipe).build(dev, dt)
        opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
        with torch.device(dev):
            data = w.inputs(batch, dt)
        held += [net, opt, data]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            output = forward(net, data)
            loss = w.loss(output, data)
            del output
            loss.backward()
            del loss
            opt.step()
        timing = time_fn(step, warmup=warmup, repeats=repeats, device=dev)
        median = timing.median
        point.update(status="ran", samples_s=list(timing.samples), median_s=median, min_s=timing.min,
                     tokens_per_s=(batch * seq_len / median) if median > 0 else None, timing_device=timing.device)
        if dev.type == "cuda":
            point["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            point["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    except Exception as exc:  # noqa: BLE001 - an out-of-memory is this point's answer; the sweep goes on
        if not _is_oom(exc):
            raise
        point["status"] = "out of memory: " + str(exc).split("\n")[0][:200]
    finally:
        held.clear()
        _free()
    return point


@record_kind("throughput")
def record_throughput(p: dict[str, Any]) -> dict[str, Any]:
    """Throughput against the batch on the GPU: one ``timed_point`` per batch (checkpointing off)."""
    points = [timed_point(p["model"], b, p["seq_len"], p["dtype"], p["optimizer"], "none", p["warmup"], p["repeats"])
              for b in p["batches"]]
    return {"engine": "cuda", "device": "cuda:0", "label": "plain steps timed (time_fn: synchronized, median)",
            **p, "points": points}


@record_kind("checkpoint cost")
def record_checkpoint_cost(p: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing's time cost on the GPU: one ``timed_point`` per policy at one batch, and each
    policy's median step time over the one without checkpointing (``slowdown``)."""
    points = [timed_point(p["model"], p["batch"], p["seq_len"], p["dtype"], p["optimizer"], policy, p["warmup"],
                          p["repeats"]) for policy in p["policies"]]
    off = next((x for x in points if x["checkpointing"] == "none" and x["status"] == "ran"), None)
    for x in points:
        x["slowdown"] = (x["median_s"] / off["median_s"] if off and x["status"] == "ran" and off["median_s"] > 0
                         and math.isfinite(x["median_s"]) else None)
    return {"engine": "cuda", "device": "cuda:0", "label": "plain steps timed (time_fn: synchronized, median)",
            **p, "points": points}
