"""The levers beside a fit answer: batch 1's peak with one change each (bf16, an 8-bit optimizer,
activation checkpointing, LoRA, QLoRA, sharding), by formula from the measured categories at the peak."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.categories import Category
from gpulab.measure.tracking import TrackingResult
from gpulab.models.lora import adapter_params, default_targets
from gpulab.models.workload import Workload
from gpulab.units import format_bytes

__all__ = ["LABEL_LEVER", "Lever", "levers_at_batch_one"]

LABEL_LEVER = "formula (from the measured categories at batch 1)"


@dataclass(frozen=True)
class Lever:
    """What one change would make of batch 1's memory, by formula."""
    name: str
    peak_bytes: int          # the new live-tensor peak at batch 1
    fits: bool
    formula: str
    label: str = LABEL_LEVER


# --- levers -------------------------------------------------------------------------------------

def _optimizer_temporaries(t: TrackingResult) -> int:
    """The bytes, at the peak, of temporaries the optimizer step made (foreach Adam's copies the size of
    the parameters it steps): they go with the parameters the optimizer steps."""
    if t.peak_index < 0 or t.peak_phase != "optimizer":
        return 0
    stepped = {sid for sid, r in t.records.items() if r.category is Category.TEMPORARIES and r.phase == "optimizer"}
    alive: dict[int, int] = {}   # the events' bytes (a rank's timeline resizes events, not records)
    for e in t.events[: t.peak_index + 1]:
        if e.kind == "free":
            alive.pop(e.sid, None)
        elif e.sid in stepped:
            alive[e.sid] = F.cuda_rounded_bytes(e.nbytes) if t.rounded else e.nbytes
    return sum(alive.values())


def levers_at_batch_one(w: Workload, t: TrackingResult, opt: str, dt: torch.dtype, usable: int,
            sharded: bool = False) -> list[Lever]:
    """Batch 1's peak with one change each, by formula from its categories at the peak (``sharded``:
    ``t`` is already one rank's, so no lever shards it again)."""
    c = {k: int(v) for k, v in t.peak_by_category.items()}
    peak = t.peak_bytes
    params, grads, state = c.get(Category.PARAMETERS.value, 0), c.get(Category.GRADIENTS.value, 0), \
        c.get(Category.OPTIMIZER_STATE.value, 0)
    acts = c.get(Category.ACTIVATIONS.value, 0)
    opt_temps = _optimizer_temporaries(t)
    elem = dt.itemsize
    n_params = params // elem if elem else 0
    out: list[Lever] = []

    def add(name: str, new_peak: int, formula: str) -> None:
        out.append(Lever(name, int(new_peak), new_peak <= usable, formula))

    if elem == 4:
        add("bf16 everywhere (weights, gradients, optimizer state, activations)", peak // 2,
            "every fp32 tensor at the peak takes 2 bytes per value instead of 4: peak / 2")
    k = F.optimizer_state_multiplier(opt) if opt in F.OPTIMIZER_STATES else 2   # the recipe optimizers: Adam-like
    if k and state and opt not in F.RECIPE_OPTIMIZERS:
        eight = F.eight_bit_optimizer_state_bytes(n_params, states=k)
        add("8-bit optimizer state (bitsandbytes, blockwise)", peak - state + eight,
            f"optimizer state {format_bytes(state)} → {k} state(s) of 1 byte per parameter + one fp32 absmax per "
            f"256 values: "
            f"{format_bytes(eight)}")
    layers = _layers(w)
    boundary = _boundary_bytes(w, elem)
    if layers and boundary and not acts:
        add(f"activation checkpointing of each of the {layers} layers", peak,
            f"no activations are held at the peak (during {t.peak_phase}): checkpointing does not lower it")
    elif acts and layers and boundary:
        ckpt = F.checkpointed_activation_bytes(acts / layers, layers, boundary)
        add(f"activation checkpointing of each of the {layers} layers", peak - acts + int(ckpt),
            f"activations {format_bytes(acts)} → one layer's ({format_bytes(int(acts / layers))}) plus each layer's "
            f"input ({format_bytes(int(boundary))} × {layers})")
    if params and (grads or state):
        targets = default_targets(w.config) if w.config is not None else ()
        lora = adapter_params(w.config, rank=16, targets=targets) if targets else 0
        if lora:
            lora_bytes = lora * 4 * (2 + k)   # fp32 adapter weights, gradients, optimizer state
            stepped = (f" and no optimizer-step temporaries ({format_bytes(opt_temps)} at the peak)" if opt_temps
                       else "")
            add(f"LoRA (rank 16 on {', '.join(targets)}, as peft adapts by default; base weights frozen)",
                peak - grads - state - opt_temps + lora_bytes,
                f"no gradients or optimizer state for the {'' if sharded else f'{n_params:,} '}base weights{stepped}; "
                f"{lora:,} adapter "
                f"parameters with fp32 weights, gradients and state: {format_bytes(lora_bytes)}")
            qlora = int(F.nf4_weight_bytes(n_params))
            add("QLoRA (4-bit NF4 base weights + LoRA)", peak - grads - state - opt_temps - params + qlora + lora_bytes,
                f"base weights {format_bytes(params)} → NF4 at about 0.52 bytes per parameter "
                f"(double-quantized constants): {format_bytes(qlora)}")
    model_states = params + grads + state + opt_temps
    if model_states and not sharded:
        stepped = " + the optimizer step's temporaries" if opt_temps else ""
        for n in (2, 4, 8, 16, 32, 64):
            per_device = peak - model_states + math.ceil(model_states / n)
            if per_device <= usable or n == 64:
                add(f"sharding over {n} GPUs (ZeRO-3 / FSDP: parameters, gradients and optimizer state split)",
                    per_device, f"(parameters + gradients + optimizer state{stepped}) / {n} + the rest of batch 1's "
                                "peak; ignores the layer being gathered and communication buffers")
                break
    return out


def _layers(w: Workload) -> int:
    if w.kind != "tokens":
        return 0
    return int(_summary(w).get("num_layers") or 0)


def _summary(w: Workload) -> dict[str, Any]:
    return w.facts.summary() if w.facts is not None else {}   # hf_configs.config_summary, read once


def _boundary_bytes(w: Workload, elem: int) -> int:
    s = _summary(w)
    return int((w.seq_len or 0) * int(s.get("hidden_size") or 0) * elem)
