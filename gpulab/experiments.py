"""Named experiments shared by the lessons, the widgets and the CLI.

* ``breakdown(model, ...)``: per-layer table (output shape, params, output bytes, FLOPs) from
  one forward pass on the meta device: shapes only, instant at any size.
* ``training_step(model, ...)``: one (or more) real training steps on an engine, tracked
  by category, next to the formulas' prediction of the same categories.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import formulas as F
from .engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from .models import ModelSpec, build_model, check_image_size, resolve_model
from .tracking import CATEGORIES, Category
from .units import dtype_name, parse_dtype

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad")


def validate_batch(batch: int) -> int:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise ValueError(f"batch size must be a positive integer, got {batch!r}")
    return batch


# --- per-layer formulas --------------------------------------------------------------------------

def params_by_formula(module: nn.Module) -> int | None:
    """A leaf module's parameter count from its hyper-parameters alone (gpulab.formulas),
    or None for a type without a formula here. Tests compare it with ``numel()``."""
    if isinstance(module, nn.Conv2d):
        return F.conv2d_params(module.in_channels, module.out_channels, module.kernel_size,
                               module.groups, module.bias is not None)
    if isinstance(module, nn.Linear):
        return F.linear_params(module.in_features, module.out_features, module.bias is not None)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return F.batchnorm_params(module.num_features, module.affine)
    if isinstance(module, nn.LayerNorm):
        return F.layernorm_params(module.normalized_shape, module.elementwise_affine,
                                  getattr(module, "bias", None) is not None)
    if isinstance(module, nn.Embedding):
        return F.embedding_params(module.num_embeddings, module.embedding_dim)
    if not any(True for _ in module.parameters(recurse=False)):
        return 0  # ReLU, pooling, dropout, flatten: no parameters
    return None


def flops_by_formula(module: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> int:
    """Forward FLOPs of a leaf (convention of gpulab.formulas: 2 per multiply-add).
    Layers other than Conv2d and Linear count 0, as in torch.utils.flop_counter."""
    if isinstance(module, nn.Conv2d):
        return F.conv2d_flops(out.shape[0], module.in_channels, module.out_channels,
                              tuple(out.shape[-2:]), module.kernel_size, module.groups)
    if isinstance(module, nn.Linear):
        return F.linear_flops(out.numel() // out.shape[-1], module.in_features, module.out_features)
    return 0


# --- breakdown ------------------------------------------------------------------------------------

@dataclass
class LayerRow:
    name: str
    type: str
    output_shape: list[int]
    params: int
    params_formula: int | None
    param_bytes: int
    output_bytes: int
    flops: int


@dataclass
class Breakdown:
    model: str
    input_shape: list[int]
    dtype: str
    total_params: int
    param_tensors: int
    param_bytes: int
    buffer_bytes: int
    forward_flops: int
    total_output_bytes: int
    layers: list[LayerRow] = field(default_factory=list)
    label: str = "formula (shapes from a meta-device forward pass)"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(r) for r in self.layers]
        return d

    def _repr_html_(self) -> str:
        from .views import breakdown_html
        return breakdown_html(self)

    def __repr__(self) -> str:
        return (f"Breakdown({self.model}, input={self.input_shape}, {self.dtype}, "
                f"params={self.total_params:,}, layers={len(self.layers)})")


def breakdown(model: str | ModelSpec, batch: int = 1, image_size: int | None = None,
              dtype: str | torch.dtype = "float32") -> Breakdown:
    """Leaf modules in execution order, with output shape, params and FLOPs.

    Runs on the meta device (shapes only). A module used twice appears twice. ResNet's
    residual additions happen outside leaf modules and are not rows."""
    spec = resolve_model(model)
    validate_batch(batch)
    dt = parse_dtype(dtype)
    size = image_size or spec.default_image_size
    check_image_size(spec, size)
    net = build_model(spec, size, device="meta", dtype=dt)
    x = torch.empty(batch, 3, size, size, dtype=dt, device="meta")
    names = {m: n for n, m in net.named_modules()}
    rows: list[LayerRow] = []

    def hook(mod, args, out):
        if any(True for _ in mod.children()) or not isinstance(out, torch.Tensor):
            return
        inp = args[0] if args else None
        n_params = sum(p.numel() for p in mod.parameters(recurse=False))
        rows.append(LayerRow(
            name=names.get(mod, type(mod).__name__), type=type(mod).__name__,
            output_shape=list(out.shape), params=n_params, params_formula=params_by_formula(mod),
            param_bytes=sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False)),
            output_bytes=out.numel() * out.element_size(),
            flops=flops_by_formula(mod, inp, out)))

    handles = [m.register_forward_hook(hook) for m in net.modules()]
    try:
        with torch.no_grad():
            net.eval()(x)
    finally:
        for h in handles:
            h.remove()
    return Breakdown(
        model=spec.name, input_shape=list(x.shape), dtype=dtype_name(dt),
        total_params=sum(p.numel() for p in net.parameters()),
        param_tensors=sum(1 for _ in net.parameters()),
        param_bytes=sum(p.numel() * p.element_size() for p in net.parameters()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in net.buffers()),
        forward_flops=sum(r.flops for r in rows),
        total_output_bytes=sum(r.output_bytes for r in rows), layers=rows)


# --- a training step -----------------------------------------------------------------------------

def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    key = str(name).lower()
    if key == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if key == "momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if key == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    if key == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(OPTIMIZERS)}")


@dataclass
class StepResult(Measured):
    """A tracked training step next to the formulas' view of it."""
    model: str
    batch: int
    image_size: int
    optimizer: str
    dtype: str
    steps: int
    measurement: Measurement
    predicted: dict[str, int | None]
    predicted_label: str = LABEL_FORMULA

    @property
    def tensor_bytes_by_category(self) -> dict[str, int]:
        """Peak live bytes per category, unrounded: what the formulas count (numel × element
        size). On cuda the tracker's peak rounds each storage up to 512 B, as the allocator does;
        a formula is compared with these bytes, like with like (BatchNorm's six small buffers are
        784 B of tensors but 3,072 B of 512-byte blocks)."""
        t = self.measurement.tracking
        if t is None:
            return {}
        if not t.rounded:
            return dict(t.peak_by_category)
        return dict(type(t).build(t.records, t.events, t.device, rounded=False).peak_by_category)

    def as_dict(self) -> dict[str, Any]:
        m = self.measurement
        d: dict[str, Any] = {
            "model": self.model, "batch": self.batch, "image_size": self.image_size,
            "optimizer": self.optimizer, "dtype": self.dtype, "steps": self.steps,
            "engine": m.engine, "engine_reason": m.reason, "device": m.device, "label": m.label,
            "kernels": m.kernels,
            "peak_bytes": m.peak_bytes, "peak_phase": m.tracking.peak_phase if m.tracking else "",
            "peak_by_category": m.peak_by_category,
            "peak_tensor_bytes_by_category": self.tensor_bytes_by_category,   # unrounded, vs formulas
            "final_by_category": dict(m.tracking.final_by_category) if m.tracking else {},
            # live tensors just after the last optimizer step (the "after step" snapshot),
            # while the model, its gradients and the optimizer state still exist
            "after_step_by_category": next((dict(s.by_category) for s in m.snapshots
                                            if s.name == "after step"), {}),
            "predicted": dict(self.predicted), "predicted_label": self.predicted_label,
            "seconds": round(m.seconds, 4), "oom": m.oom, "error": m.error,
        }
        if m.allocator is not None:
            d["allocator"] = dict(m.allocator)
            d["beyond_tensors"] = dict(m.beyond_tensors or {})
        if m.blocks is not None:   # the live tensors as the allocator counts them (cuda)
            d["allocator_blocks"] = {"peak_bytes": m.blocks.peak_bytes, "final_bytes": m.blocks.final_bytes,
                                     "label": m.blocks.label}
        return d

    def _repr_html_(self) -> str:
        from .views import step_html
        return step_html(self)

    def __repr__(self) -> str:
        return (f"StepResult({self.model}, batch={self.batch}, {self.optimizer}, engine={self.engine}, "
                f"peak={self.peak_bytes:,} B)")


def predict_step(model: str | ModelSpec, batch: int, image_size: int | None = None, optimizer: str = "sgd",
                 dtype: str | torch.dtype = "float32", count_step_counters: bool = True, *,
                 bd: Breakdown | None = None) -> dict[str, int | None]:
    """The formulas' view of a training step, per category (bytes).

    parameters / buffers / gradients / optimizer_state / inputs are exact formulas;
    activations is the reference articles' view (every layer's output kept for backward:
    the sum of leaf outputs), which lesson 03 puts to the test; temporaries has no formula
    (None). ``bd``: this model's breakdown at this batch, size and dtype, if already made."""
    if bd is None:
        bd = breakdown(model, batch, image_size, dtype)
    n_tensors = bd.param_tensors
    return {
        Category.PARAMETERS.value: bd.param_bytes,
        Category.BUFFERS.value: bd.buffer_bytes,
        Category.INPUTS.value: F.tensor_bytes(bd.input_shape, bd.dtype) + F.tensor_bytes([batch], "int64"),
        Category.OPTIMIZER_STATE.value: F.optimizer_state_bytes(bd.param_bytes, n_tensors, optimizer,
                                                                count_step_counters),
        Category.GRADIENTS.value: bd.param_bytes,
        Category.ACTIVATIONS.value: bd.total_output_bytes,
        Category.TEMPORARIES.value: None,
    }


def step_experiment(spec: ModelSpec, batch: int, image_size: int, optimizer: str, dtype: torch.dtype,
                    steps: int = 1):
    """The experiment function ``run`` calls: fresh model, ``steps`` training steps."""
    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"):
            net = build_model(spec, image_size, device=ctx.device, dtype=dtype)
            opt = make_optimizer(optimizer, net.parameters())
            n_classes = spec.num_classes
            x = ctx.label(torch.randn(batch, 3, image_size, image_size, device=ctx.device, dtype=dtype))
            y = ctx.label(torch.randint(0, n_classes, (batch,), device=ctx.device))
        for i in range(steps):
            if i:
                opt.zero_grad(set_to_none=True)
            with ctx.phase("forward"):
                loss = nn.functional.cross_entropy(net(x), y)
            with ctx.phase("backward"):
                loss.backward()
            del loss
            with ctx.phase("optimizer"):
                opt.step()
        ctx.snapshot("after step")
        return {"n_param_tensors": sum(1 for _ in net.parameters())}
    return experiment


def training_step(model: str | ModelSpec, batch: int | None = None, image_size: int | None = None,
                  optimizer: str = "sgd", dtype: str | torch.dtype = "float32",
                  engine: str = "auto", steps: int = 1, fake_target: str = "cuda",
                  **engine_limits) -> StepResult:
    """Track ``steps`` training steps of a fresh ``model`` (forward, backward, step).

    ``fake_target``: on the fake engine, whose kernels to follow. "cuda" (the default: a
    step's memory is a GPU-capacity question) makes CUDA's choices (foreach optimizers, bool
    dropout masks, 512-byte blocks, step counters on the host); "cpu" equals the cpu engine."""
    spec = resolve_model(model)
    batch = validate_batch(spec.default_batch if batch is None else batch)
    size = image_size or spec.default_image_size
    check_image_size(spec, size, batch)
    opt_key = str(optimizer).lower()
    if opt_key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZERS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    dt = parse_dtype(dtype)
    bd = breakdown(spec, batch, size, dt)
    predicted = predict_step(spec, batch, size, opt_key, dt, bd=bd)
    known = sum(v for v in predicted.values() if v)
    m = run(step_experiment(spec, batch, size, opt_key, dt, steps), engine,
            predicted_bytes=known, predicted_flops=3 * bd.forward_flops * steps, fake_target=fake_target,
            **engine_limits)
    if m.kernels == "cuda":  # CUDA keeps Adam-style step counters on the CPU
        predicted = predict_step(spec, batch, size, opt_key, dt, count_step_counters=False, bd=bd)
    return StepResult(spec.name, batch, size, opt_key, dtype_name(dt), steps, m, predicted)


def category_names() -> list[str]:
    return [c.value for c in CATEGORIES]
