"""Lesson 06's measuring core for forward passes that do not train: one forward of a small
conv-BN-dropout net (``eval_demo_net``) in each grad/eval mode, and a small U-Net
(``TinyUNet``) whose ``forward`` keeps every intermediate under its own name or reuses one name
with ``del``, each tracked on an engine. It returns data (one ``Measurement`` per mode or style);
``gpulab.course.inference`` adds the formulas, the observed facts, the claims and the views, and
``gpulab record`` stores ``modes_as_dict`` / ``lifetimes_as_dict`` for a real GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as Fn

from gpulab.measure.engines import Measurement, RunContext, run
from gpulab.record.runs.inplace import saved_activation_bytes, saved_tensors
from gpulab.record.kinds import head, record_kind

__all__ = [
    "GRAD_MODES", "MODES", "STYLES", "TinyUNet", "eval_demo_net", "fixed_bytes", "forward_peak",
    "lifetime_experiment", "lifetimes_as_dict", "mode_context", "modes_as_dict", "modes_experiment",
    "record_grad_modes", "record_lifetimes", "run_lifetimes", "run_modes"
]

MODES = ("train() + grad", "eval() + grad", "train() + no_grad", "eval() + no_grad",
         "eval() + inference_mode")
STYLES = ("names kept", "del / reuse")
GRAD_MODES = ("no_grad forward", "train step")


# --- grad and eval modes ---------------------------------------------------------------------------

def eval_demo_net(channels: int = 32, image_size: int = 32, p: float = 0.5,
                  num_classes: int = 10) -> nn.Sequential:
    """conv 3x3 -> BatchNorm -> ReLU -> max-pool 2 -> flatten -> Dropout(p) -> Linear: the
    two layers that behave differently in train() and eval() (BN, dropout) in one small net."""
    if image_size < 2 or image_size % 2:
        raise ValueError(f"image size must be an even number >= 2, got {image_size}")
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(p), nn.Linear(channels * (image_size // 2) ** 2, num_classes))


def mode_context(mode: str):
    if mode.endswith("no_grad"):
        return torch.no_grad()
    if mode.endswith("inference_mode"):
        return torch.inference_mode()
    return contextlib.nullcontext()


def modes_experiment(mode: str, batch: int, channels: int, image_size: int):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(0)
            net = eval_demo_net(channels, image_size)
            ctx.tracker.register(net)
            x = ctx.label(torch.randn(batch, 3, image_size, image_size))
        net.train(mode.startswith("train"))
        with ctx.phase("forward"), mode_context(mode):
            out = net(x)
        held = ctx.snapshot("output held").tracked_bytes
        saved = saved_tensors(out, list(net.parameters()) + list(net.buffers()) + [x])
        return {"held": held, "fixed": fixed_bytes(net, x), "saved": saved, "requires_grad": out.requires_grad,
                "grad_fn": None if out.grad_fn is None else out.grad_fn.name(),
                "is_inference": out.is_inference()}
    return experiment


def fixed_bytes(net: nn.Module, *inputs: torch.Tensor) -> int:
    """Parameters, buffers and inputs: what exists before the forward starts."""
    tensors = list(net.parameters()) + list(net.buffers()) + list(inputs)
    return sum(t.untyped_storage().nbytes() for t in tensors)



# --- del and name reuse inside forward -------------------------------------------------------------

class TinyUNet(nn.Module):
    """Three levels down, two up, skip connections by concatenation: the shape of network the
    reference articles' ``del`` advice is about. ``style`` picks how ``forward`` is written;
    both compute the same function with the same modules."""

    def __init__(self, channels: int = 8, style: str = "names kept"):
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; valid styles: {', '.join(STYLES)}")
        c = channels
        self.style = style
        self.enc1 = nn.Conv2d(3, c, 3, padding=1)
        self.enc2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.enc3 = nn.Conv2d(2 * c, 4 * c, 3, padding=1)
        self.dec2 = nn.Conv2d(4 * c + 2 * c, 2 * c, 3, padding=1)
        self.dec1 = nn.Conv2d(2 * c + c, c, 3, padding=1)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "names kept":
            return self._forward_names(x)
        return self._forward_reuse(x)

    def _forward_names(self, x):
        # every intermediate has its own name and lives until forward returns
        c1 = self.enc1(x)
        e1 = Fn.relu(c1)
        p1 = Fn.max_pool2d(e1, 2)
        c2 = self.enc2(p1)
        e2 = Fn.relu(c2)
        p2 = Fn.max_pool2d(e2, 2)
        c3 = self.enc3(p2)
        e3 = Fn.relu(c3)
        u3 = Fn.interpolate(e3, scale_factor=2.0, mode="nearest")
        k2 = torch.cat([u3, e2], 1)
        c4 = self.dec2(k2)
        d2 = Fn.relu(c4)
        u2 = Fn.interpolate(d2, scale_factor=2.0, mode="nearest")
        k1 = torch.cat([u2, e1], 1)
        c5 = self.dec1(k1)
        d1 = Fn.relu(c5)
        return self.head(d1)

    def _forward_reuse(self, x):
        # one working name; skips deleted after their last use
        x = Fn.relu(self.enc1(x))
        e1 = x
        x = Fn.relu(self.enc2(Fn.max_pool2d(x, 2)))
        e2 = x
        x = Fn.relu(self.enc3(Fn.max_pool2d(x, 2)))
        x = torch.cat([Fn.interpolate(x, scale_factor=2.0, mode="nearest"), e2], 1)
        del e2
        x = Fn.relu(self.dec2(x))
        x = torch.cat([Fn.interpolate(x, scale_factor=2.0, mode="nearest"), e1], 1)
        del e1
        x = Fn.relu(self.dec1(x))
        return self.head(x)


def lifetime_experiment(style: str, grad_mode: str, batch: int, channels: int, image_size: int):
    def experiment(ctx: RunContext) -> int:
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(0)
            net = TinyUNet(channels, style)
            ctx.tracker.register(net)
            x = ctx.label(torch.randn(batch, 3, image_size, image_size))
        if grad_mode == "no_grad forward":
            with ctx.phase("forward"), torch.no_grad():
                out = net(x)
            del out
            return fixed_bytes(net, x)
        with ctx.phase("forward"):
            loss = net(x).mean()
        with ctx.phase("backward"):
            loss.backward()
        return fixed_bytes(net, x)
    return experiment


def run_modes(batch: int, channels: int, image_size: int, engine: str, modes: tuple[str, ...] = MODES,
              **run_kwargs: Any) -> dict[str, Measurement]:
    """One tracked forward of ``eval_demo_net`` per mode on ``engine`` (``run_kwargs`` go to
    ``engines.run``). Raises ``MemoryError`` when a run goes out of memory."""
    out = {}
    for mode in modes:
        m = run(modes_experiment(mode, batch, channels, image_size), engine, **run_kwargs)
        if m.oom:
            raise MemoryError(m.error)
        out[mode] = m
    return out


def modes_as_dict(runs: dict[str, Measurement]) -> dict[str, Any]:
    """Plain JSON-able data per mode (what ``gpulab record`` stores): the peak, what stays alive
    while the output is held (beyond parameters, buffers and input), what autograd saved, the
    allocator's counters on CUDA."""
    return {mode: {"peak_bytes": m.peak_bytes, "held_bytes": m.value["held"] - m.value["fixed"],
                   "saved_bytes": saved_activation_bytes(m.value["saved"]),
                   "requires_grad": m.value["requires_grad"], "grad_fn": m.value["grad_fn"],
                   "allocator": dict(m.allocator or {})} for mode, m in runs.items()}


def run_lifetimes(grad_mode: str, batch: int, channels: int, image_size: int, engine: str,
                  **run_kwargs: Any) -> dict[str, Measurement]:
    """``TinyUNet`` in both forward styles, tracked on ``engine``; each value is the bytes that
    exist before the forward (parameters, input). Raises ``MemoryError`` on out of memory."""
    out = {}
    for style in STYLES:
        m = run(lifetime_experiment(style, grad_mode, batch, channels, image_size), engine, **run_kwargs)
        if m.oom:
            raise MemoryError(m.error)
        out[style] = m
    return out


def forward_peak(m: Measurement) -> int:
    """The activation side of a lifetimes run: live bytes beyond parameters and input at the
    forward's peak."""
    return m.tracking.by_phase_peak().get("forward", 0) - m.value


def lifetimes_as_dict(runs: dict[str, Measurement]) -> dict[str, Any]:
    """Plain JSON-able data per style (what ``gpulab record`` stores)."""
    return {style: {"peak_bytes": m.peak_bytes, "forward_peak": forward_peak(m),
                    "allocator": dict(m.allocator or {})} for style, m in runs.items()}


@record_kind("grad modes")
def record_grad_modes(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 06's grad-mode panel default on the GPU."""
    runs = run_modes(engine="cuda", **p)
    return {**head(next(iter(runs.values()))), **p, "runs": modes_as_dict(runs)}


@record_kind("lifetimes")
def record_lifetimes(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 06's lifetimes panel default on the GPU."""
    runs = run_lifetimes(engine="cuda", **p)
    return {**head(next(iter(runs.values()))), **p, "runs": lifetimes_as_dict(runs)}
