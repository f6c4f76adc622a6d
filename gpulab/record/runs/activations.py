"""Lesson 03's measuring core: a forward pass traced layer by layer on an engine (forward hooks
on every leaf module: output shape, the storage it allocated, live memory after it), eval under
``no_grad`` or train with grad (optionally with backward). It returns data (the ``Measurement``,
its value holding the ``LayerOut`` rows); ``gpulab.course.activations`` adds the formulas, the
claims and the views, and ``gpulab record`` stores ``forward_table_as_dict`` /
``forward_pair_as_dict`` for a real GPU.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gpulab.measure.engines import Measurement, RunContext, run
from gpulab.predict.breakdown import flops_by_formula
from gpulab.models.registry import ModelSpec, build_model, build_model_from
from gpulab.categories import CATEGORIES, Category
from gpulab.record.kinds import record_kind
from gpulab.units import parse_dtype
from gpulab.models.registry import resolve_model

__all__ = [
    "ACTIVATION_SIDE", "DEPTHWISE_BLOCKS", "LayerOut", "NON_PARAM", "TEMPLATE_BYTES", "build_in", "cpu_model", "depthwise_as_dict",
    "depthwise_experiment", "forward_allocated", "forward_experiment", "forward_pair_as_dict",
    "forward_table_as_dict", "forward_table_experiment", "live", "modelsize_as_dict",
    "peak_non_param", "peak_since", "record_depthwise", "record_forward_pair",
    "record_forward_table", "record_modelsize", "remove", "run_forward_pair", "saved_by_dtype",
    "separable_block", "standard_block", "trace"
]

NON_PARAM = tuple(c.value for c in CATEGORIES if c not in (Category.PARAMETERS, Category.BUFFERS))
# what backward holds on the activation side: saved tensors, activation gradients (temporaries),
# the input; the weights' gradients are left out (they are the weights' memory, lesson 04)
ACTIVATION_SIDE = (Category.ACTIVATIONS.value, Category.TEMPORARIES.value, Category.INPUTS.value)


def live(ctx: RunContext) -> dict[str, int]:
    """Bytes alive now per category (``MemoryTracker.live_by_category``: the result's final split, unbuilt)."""
    return ctx.tracker.live_by_category(str(ctx.device))


def saved_by_dtype(ctx: RunContext) -> dict[str, int]:
    """Bytes of the live storages autograd has saved (category activations), by dtype."""
    res = ctx.tracker.result(device=str(ctx.device))
    out: dict[str, int] = {}
    for r in res.alive():
        if r.category == Category.ACTIVATIONS:
            out[r.dtype] = out.get(r.dtype, 0) + res.storage_bytes(r)
    return out


# --- tracing a forward pass -----------------------------------------------------------------------

@dataclass
class LayerOut:
    """One leaf module call in a forward pass."""
    index: int
    name: str
    type: str
    input_shape: list[int]
    output_shape: list[int]
    values: int              # elements of the output
    out_bytes: int           # numel x element size of the output
    new_storage: bool        # False: written in place into its input, a view of it, or the input itself
    storage_bytes: int       # bytes of the storage it allocated (0 when not new)
    in_storage_bytes: int    # bytes of its input's storage
    input_is_model_input: bool
    params: int
    flops: int               # formula (gpulab.formulas; 2 per multiply-add)
    inplace: bool
    live_after: int = 0      # tracker: live non-parameter bytes right after this layer
    saved_after: int = 0     # tracker: live bytes saved for backward right after this layer


def trace(net: nn.Module, x: torch.Tensor, rows: list[LayerOut], ctx: RunContext | None = None):
    """Forward hooks on every leaf module that append a ``LayerOut`` per call."""
    names = {m: n for n, m in net.named_modules()}
    x_storage = x.untyped_storage()

    def hook(mod, args, out):
        if any(True for _ in mod.children()) or not isinstance(out, torch.Tensor):
            return
        inp = args[0] if args and isinstance(args[0], torch.Tensor) else None
        in_st = inp.untyped_storage() if inp is not None else None
        out_st = out.untyped_storage()
        new = in_st is None or out_st is not in_st
        row = LayerOut(
            index=len(rows), name=names.get(mod, type(mod).__name__) or type(mod).__name__,
            type=type(mod).__name__, input_shape=list(inp.shape) if inp is not None else [],
            output_shape=list(out.shape), values=out.numel(), out_bytes=out.numel() * out.element_size(),
            new_storage=new, storage_bytes=out_st.nbytes() if new else 0,
            in_storage_bytes=in_st.nbytes() if in_st is not None else 0,
            input_is_model_input=in_st is x_storage,
            params=sum(p.numel() for p in mod.parameters(recurse=False)),
            flops=flops_by_formula(mod, inp, out) if inp is not None else 0,
            inplace=bool(getattr(mod, "inplace", False)))
        if ctx is not None:
            now = live(ctx)
            row.live_after = sum(now.get(k, 0) for k in NON_PARAM)
            row.saved_after = now.get(Category.ACTIVATIONS.value, 0)
        rows.append(row)

    return [m.register_forward_hook(hook) for m in net.modules()]


def remove(handles) -> None:
    for h in handles:
        h.remove()


def forward_table_experiment(spec: ModelSpec, batch: int, size: int, dt: torch.dtype):
    """One eval-mode forward under ``no_grad``, traced (an experiment for ``engines.run``)."""
    def experiment(ctx: RunContext) -> dict[str, Any]:
        net = _fresh_model(spec, size, dt, ctx).eval()
        x = ctx.label(torch.randn(batch, 3, size, size, device=ctx.device, dtype=dt))
        rows: list[LayerOut] = []
        handles = trace(net, x, rows)
        try:
            with torch.no_grad(), ctx.phase("forward"):
                net(x)
        finally:
            remove(handles)
        return {"rows": rows, "params": sum(p.numel() for p in net.parameters()),
                "input_bytes": x.untyped_storage().nbytes()}
    return experiment


def forward_allocated(m: Measurement) -> int:
    """Bytes of every storage allocated during the forward phase."""
    return sum(e.nbytes for e in m.tracking.events if e.kind == "alloc" and e.phase == "forward")


# A real CPU run draws its model's random weights afresh: AlexNet's 61 M in fp16 take about as long
# as its forward (lesson 03's model-size panel builds each model twice per setting). ``cpu_model``
# draws them once per model, image size and dtype and copies them into each fresh build instead; the
# templates kept take at most TEMPLATE_BYTES (the two half-precision AlexNets fit), oldest dropped first.
TEMPLATE_BYTES = 256 * 2**20
_templates: OrderedDict[tuple, nn.Module] = OrderedDict()


def cpu_model(spec: ModelSpec, size: int, dt: torch.dtype, ctx: RunContext | None = None) -> nn.Module:
    """A fresh ``build_model(spec, size, "cpu", dt)``, built the same way (the same storages in the same
    order, which a tracker sees), its values copied from a template drawn once (``build_model_from``).
    ``ctx``: the run it is for; its tracker is paused while a template is drawn (no run holds it). The
    initialisers are skipped by a patch of torch.Tensor's methods while the model is built, inside the
    run's tracker: under ``TRACKER_LOCK``, which every thread that measures or times takes too."""
    key = (spec, size, dt)
    template = _templates.get(key)
    if template is None:
        with ctx.tracker.paused() if ctx is not None else contextlib.nullcontext():
            if _bytes_of(build_model(spec, size, device="meta", dtype=dt)) > TEMPLATE_BYTES:
                template = None
            else:
                template = build_model(spec, size, device="cpu", dtype=dt)
        if template is None:   # too large to keep: drawn afresh each time, as before
            return build_model(spec, size, device="cpu", dtype=dt)
        _templates[key] = template
        while sum(_bytes_of(m) for m in _templates.values()) > TEMPLATE_BYTES:
            _templates.popitem(last=False)
    _templates.move_to_end(key)
    return build_model_from(template, spec, size, device="cpu", dtype=dt)


def _fresh_model(spec: ModelSpec, size: int, dt: torch.dtype, ctx: RunContext) -> nn.Module:
    """The run's model: on the cpu engine (a real run) its weights' values copied (``cpu_model``)."""
    if ctx.engine == "cpu":
        return cpu_model(spec, size, dt, ctx)
    return build_model(spec, size, device=ctx.device, dtype=dt)


def _bytes_of(net: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in (*net.parameters(), *net.buffers()))


def forward_experiment(spec: ModelSpec, batch: int, size: int, dt: torch.dtype, grad: bool, backward: bool = False):
    """A traced forward (train mode with grad, or eval mode under no_grad); with ``backward``
    also ``out.sum().backward()``, recording the peak of the non-weight memory during it."""
    def experiment(ctx: RunContext) -> dict[str, Any]:
        dev = str(ctx.device)
        with ctx.phase("setup"):
            net = _fresh_model(spec, size, dt, ctx)
            net.train(grad)
            x = ctx.label(torch.randn(batch, 3, size, size, device=ctx.device, dtype=dt))
            ctx.tracker.register(model=net)
        rows: list[LayerOut] = []
        handles = trace(net, x, rows, ctx)
        try:
            with torch.set_grad_enabled(grad), ctx.phase("forward"):
                out = net(x)
            end = live(ctx)
            saved = saved_by_dtype(ctx)
        finally:
            remove(handles)
        bw_peak = 0
        if grad and backward:
            start = len(ctx.tracker.result(device=dev).events)
            with ctx.phase("backward"):
                out.sum().backward()
            series = ctx.tracker.result(device=dev).series[max(0, start - 1):]
            bw_peak = max((sum(s_.get(k, 0) for k in ACTIVATION_SIDE) for s_ in series), default=0)
        del out
        return {"rows": rows, "end": end, "saved": saved, "backward_peak": bw_peak}
    return experiment


def peak_non_param(m: Measurement) -> int:
    p = m.peak_by_category
    return sum(p.get(k, 0) for k in NON_PARAM)


def forward_table_as_dict(m: Measurement) -> dict[str, Any]:
    """Plain JSON-able data of a traced no_grad forward (what ``gpulab record`` stores)."""
    return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
            "peak_non_param": peak_non_param(m), "forward_allocated": forward_allocated(m),
            "peak_by_category": dict(m.peak_by_category), "allocator": dict(m.allocator or {})}


def forward_pair_as_dict(inference: Measurement, training: Measurement) -> dict[str, Any]:
    """Plain JSON-able data of the no_grad and with-grad forwards (what ``gpulab record`` stores)."""
    def one(m: Measurement) -> dict[str, Any]:
        return {"peak_bytes": m.peak_bytes, "peak_non_param": peak_non_param(m),
                "saved_bytes": m.value["end"].get(Category.ACTIVATIONS.value, 0),
                "saved_by_dtype": dict(m.value["saved"]), "peak_by_category": dict(m.peak_by_category),
                "allocator": dict(m.allocator or {})}
    return {"engine": training.engine, "device": training.device, "label": training.label,
            "runs": {"no_grad forward (eval)": one(inference), "forward with grad (train)": one(training)}}


def run_forward_pair(spec: ModelSpec, batch: int, size: int, dt: torch.dtype, engine: str,
                     **run_kwargs: Any) -> tuple[Measurement, Measurement]:
    """The no_grad (eval) forward, then the with-grad (train) one, on ``engine``."""
    return tuple(run(forward_experiment(spec, batch, size, dt, grad), engine, **run_kwargs)
                 for grad in (False, True))


def modelsize_as_dict(models: list[str], batch: int, dt: torch.dtype, engine: str) -> dict[str, Any]:
    """Lesson 03's modelsize panel, measured (what ``gpulab record`` stores): each model at its
    default image size, a forward with grad then backward, and a no_grad forward; what autograd
    saved (input included), the activation-side peak during backward, the non-parameter peaks."""
    from gpulab.models.registry import resolve_model
    rows, label, device = {}, None, None
    for name in models:
        spec = resolve_model(name)
        size = spec.default_image_size
        tr = run(forward_experiment(spec, batch, size, dt, True, backward=True), engine)
        inf = run(forward_experiment(spec, batch, size, dt, False), engine)
        saved = tr.value["end"].get(Category.ACTIVATIONS.value, 0)
        rows[spec.name] = {"image_size": size, "saved": saved,
                           "saved_with_input": saved + batch * 3 * size * size * dt.itemsize,
                           "saved_by_dtype": dict(tr.value["saved"]), "backward_peak": tr.value["backward_peak"],
                           "train_peak": peak_non_param(tr), "no_grad_peak": peak_non_param(inf),
                           "allocator": dict(tr.allocator or {})}
        label, device = label or tr.label, device or tr.device
    return {"engine": engine, "device": device, "label": label, "models": rows}


# --- depthwise-separable vs standard ------------------------------------------------------------------

def standard_block(cin: int, cout: int, bn_relu: bool = True) -> nn.Sequential:
    """3×3 convolution (padding 1, no bias) [+ BatchNorm + ReLU]."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=False)]
    if bn_relu:
        layers += [nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


def separable_block(cin: int, cout: int, bn_relu: bool = True) -> nn.Sequential:
    """MobileNet's depthwise-separable block: 3×3 depthwise conv (groups=cin) [+ BN + ReLU],
    then 1×1 pointwise conv [+ BN + ReLU] (Howard et al. 2017, Fig. 3; no bias, as there)."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False)]
    if bn_relu:
        layers += [nn.BatchNorm2d(cin), nn.ReLU(inplace=True)]
    layers.append(nn.Conv2d(cin, cout, 1, bias=False))
    if bn_relu:
        layers += [nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


def build_in(device, dtype: torch.dtype, build: Callable[..., nn.Module], *args) -> nn.Module:
    """Build a module directly on ``device`` in ``dtype`` (no copy; works under FakeTensorMode)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build(*args)
    finally:
        torch.set_default_dtype(old)


def peak_since(res, start: int, base: dict[str, int]) -> int:
    """Highest live non-parameter total reached after event ``start``, minus what was live
    before (``base``): the peak one forward added."""
    floor = sum(base.get(k, 0) for k in NON_PARAM)
    best = floor
    for s in res.series[start:]:
        best = max(best, sum(s.get(k, 0) for k in NON_PARAM))
    return best - floor


DEPTHWISE_BLOCKS = {"standard": standard_block, "separable": separable_block}


def depthwise_experiment(in_channels: int, out_channels: int, image_size: int, batch: int, bn_relu: bool,
                         dt: torch.dtype):
    """Both blocks on the same input shape (an experiment for ``engines.run``): per block, what
    autograd saved at the end of a forward with grad, the output bytes, the peak each forward added
    (with grad, and no_grad in eval), the parameters."""
    shape = (batch, in_channels, image_size, image_size)
    builders = DEPTHWISE_BLOCKS

    def experiment(ctx: RunContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, build in builders.items():
            with ctx.phase("setup"):
                blk = build_in(ctx.device, dt, build, in_channels, out_channels, bn_relu)
                ctx.tracker.register(model=blk)
            base = live(ctx)
            # the block input: inside a network, the previous layer's output (not an "input")
            x = torch.randn(shape, device=ctx.device, dtype=dt, requires_grad=True)
            before = ctx.tracker.result(device=str(ctx.device))
            start = len(before.events)
            with ctx.phase("forward"):
                y = blk(x)
            after = live(ctx)
            res = ctx.tracker.result(device=str(ctx.device))
            grad_peak = peak_since(res, start, base)
            del y, x
            x = torch.randn(shape, device=ctx.device, dtype=dt)
            blk.eval()
            start = len(ctx.tracker.result(device=str(ctx.device)).events)
            with torch.no_grad(), ctx.phase("forward"):
                y = blk(x)
            res = ctx.tracker.result(device=str(ctx.device))
            out[k] = {"saved": after.get(Category.ACTIVATIONS.value, 0),
                      "output": y.numel() * y.element_size(),
                      "no_grad_peak": peak_since(res, start, base),
                      "grad_peak": grad_peak,
                      "params": sum(p.numel() for p in blk.parameters()),
                      "param_bytes": sum(p.untyped_storage().nbytes() for p in blk.parameters())}
            del y, x, blk
        return out

    return experiment


def depthwise_as_dict(m: Measurement) -> dict[str, Any]:
    """Plain JSON-able data of both blocks (what ``gpulab record`` stores)."""
    return {"engine": m.engine, "device": m.device, "label": m.label, "blocks": dict(m.value or {}),
            "allocator": dict(m.allocator or {})}


@record_kind("depthwise")
def record_depthwise(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 03's depthwise panel default on the GPU."""
    m = run(depthwise_experiment(p["in_channels"], p["out_channels"], p["image_size"], p["batch"], p["bn_relu"],
                                 parse_dtype(p["dtype"])), engine="cuda")
    return {**p, **depthwise_as_dict(m)}


@record_kind("modelsize")
def record_modelsize(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 03's modelsize panel default on the GPU."""
    return {**p, **modelsize_as_dict(p["models"], p["batch"], parse_dtype(p["dtype"]), "cuda")}


@record_kind("forward table")
def record_forward_table(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 03's forward-table panel default on the GPU."""
    args = (resolve_model(p["model"]), p["batch"], p["image_size"], parse_dtype(p["dtype"]))
    return {**p, **forward_table_as_dict(run(forward_table_experiment(*args), engine="cuda"))}


@record_kind("inference vs training")
def record_forward_pair(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 03's inference panel default on the GPU."""
    args = (resolve_model(p["model"]), p["batch"], p["image_size"], parse_dtype(p["dtype"]))
    return {**p, **forward_pair_as_dict(*run_forward_pair(*args, "cuda"))}
