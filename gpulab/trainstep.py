"""``gpulab.step(model, ...)``: the memory of training *any* model, by category.

The model may be a registered name, a transformer config, your ``nn.Module`` or a function
that builds one (``gpulab.workload``). The default is the steady state: two training steps,
since the optimizer state exists from the first ``step()`` on and every later step holds it;
each step's own peak is reported (``StepResult.step_peaks``), the first beside the last.

A real run (cpu or cuda engine) is first predicted on the fake engine and refused, with the
numbers, when it would not fit in the memory that run may use (``gpulab.guard``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .engines import FAKE_TARGETS, choose_engine, run, validate_fake_target
from .experiments import (OPTIMIZERS, StepResult, breakdown, predict_step, step_peaks, train_experiment,
                          validate_amp, validate_batch)
from .guard import check_fits
from .units import dtype_name, parse_dtype
from .workload import Workload, resolve_workload, step_failed

DEFAULT_STEPS = 2
MAX_STEPS = 10   # tracked steps of one call: each repeats the steady state of step 2


def step(model: Any, inputs: Any = None, *, batch: int | None = None, input_shape: tuple[int, ...] | None = None,
         optimizer: str = "adam", steps: int = DEFAULT_STEPS, engine: str = "auto", dtype: str | torch.dtype | None = None,
         amp: str | None = None, loss: Callable | None = None, seq_len: int | None = None,
         image_size: int | None = None, fake_target: str = "cuda", guard: bool = True,
         **engine_limits) -> StepResult:
    """Track ``steps`` training steps of ``model`` and return them by category, next to the
    formulas' prediction (see the module docstring for what ``model``, ``inputs`` and ``loss``
    may be).

    ``dtype``: the model's (and a float input's) dtype, e.g. "bf16" for pure bf16 training;
    None keeps float32. ``amp``: "fp16" or "bf16" runs the forward under ``torch.autocast``.
    ``fake_target``: on the fake engine, follow CUDA's kernels ("cuda", the default) or this
    CPU's. ``guard``: refuse a cpu/cuda run the fake engine predicts would not fit (ValueError).
    Bad input raises ``ValueError`` with what to do instead."""
    if batch is not None:
        validate_batch(batch)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r} (the steady "
                         f"state is reached at step 2: the optimizer state exists from then on, and later "
                         f"steps repeat it)")
    w = resolve_workload(model, inputs, batch=batch, input_shape=input_shape, seq_len=seq_len,
                         image_size=image_size, loss=loss)
    batch = validate_batch(w.default_batch if batch is None else batch)
    opt = str(optimizer).lower()
    if opt not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZERS)}")
    if fake_target not in FAKE_TARGETS:
        validate_fake_target(fake_target)
    dt = parse_dtype(dtype) if dtype is not None else torch.float32
    amp_key = validate_amp(amp)
    try:
        bd = breakdown(w, batch, dtype=dt)
    except ValueError:
        raise
    except Exception as exc:   # the forward pass fails on shapes alone: the input does not suit the model
        raise ValueError(step_failed(w, batch, "on the meta device (shapes only)", exc)) from exc
    input_bytes = None if w.kind == "image" else _input_bytes(w, batch, dt)
    predicted = predict_step(w.name, batch, optimizer=opt, dtype=dt, bd=bd, input_bytes=input_bytes)
    known = sum(v for v in predicted.values() if v)
    flops = 3 * bd.forward_flops * steps
    choice = choose_engine(engine, known, flops, **engine_limits)
    try:
        if guard and choice.name != "fake":
            fake = run(train_experiment(w, [batch] * steps, opt, dt, amp_key), "fake",
                       fake_target="cuda" if choice.name == "cuda" else "cpu")
            refused = check_fits(fake.peak_bytes, choice.name)
            if refused:
                raise _Refused(refused)
        m = run(train_experiment(w, [batch] * steps, opt, dt, amp_key), engine, predicted_bytes=known,
                predicted_flops=flops, fake_target=fake_target, **engine_limits)
    except _Refused as refused:
        raise ValueError(str(refused)) from None
    except Exception as exc:
        raise ValueError(step_failed(w, batch, f"on the {choice.name} engine", exc)) from exc
    if m.kernels == "cuda":  # CUDA keeps Adam-style step counters in host memory
        predicted = predict_step(w.name, batch, optimizer=opt, dtype=dt, count_step_counters=False, bd=bd,
                                 input_bytes=input_bytes)
    return StepResult(w.name, batch, w.image_size or 0, opt, dtype_name(dt), steps, m, predicted,
                      step_peaks=step_peaks(m), kind=w.kind, input_text=w.describe_input(batch),
                      seq_len=w.seq_len, amp=amp_key)


class _Refused(Exception):
    """The guard's refusal, kept apart from the run's own errors."""


def _input_bytes(w: Workload, batch: int, dt: torch.dtype) -> int:
    """The bytes of one batch as the workload makes it (made on the meta device: free)."""
    with torch.device("meta"):
        args, kwargs = w.inputs(batch, dt)
    seen, total = set(), 0
    for t in [*args, *kwargs.values()]:   # input_ids passed twice (as labels) is one tensor
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


