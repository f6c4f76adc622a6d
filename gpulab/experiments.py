"""Named experiments shared by the lessons, the widgets and the CLI.

* ``breakdown(model, ...)``: per-layer table (output shape, params, output bytes, FLOPs) from
  one forward pass on the meta device: shapes only, instant at any size.
* ``training_step(model, ...)``: one (or more) real training steps on an engine, tracked
  by category, next to the formulas' prediction of the same categories.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from . import formulas as F
from .engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from .fake_mode import shape_kernels
from .models import ModelSpec, check_image_size, resolve_model
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
    trainable_param_bytes: int | None = None   # parameters with requires_grad (None: all of them)
    trainable_param_tensors: int | None = None

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


def breakdown(model: Any, batch: int = 1, image_size: int | None = None,
              dtype: str | torch.dtype = "float32", *, inputs: Any = None, input_shape: tuple[int, ...] | None = None,
              seq_len: int | None = None) -> Breakdown:
    """Leaf modules in execution order, with output shape, params and FLOPs.

    ``model``: anything ``gpulab.step`` takes (a name, ``hf:NAME``, a transformers config, an
    ``nn.Module``, a function that builds one). Runs on the meta device (shapes only), or on
    fake tensors where a model computes with data on the way. A module used twice appears
    twice. ResNet's residual additions happen outside leaf modules and are not rows."""
    from .workload import forward, resolve_workload
    validate_batch(batch)
    dt = parse_dtype(dtype)
    w = resolve_workload(model, inputs, batch=None, input_shape=input_shape, seq_len=seq_len, image_size=image_size)
    try:
        net, data = _shapes_only(w, batch, dt, "meta")
        with shape_kernels():
            rows = _leaf_rows(net, lambda: forward(net, data))
    except Exception:   # a model that looks at values on the way (a mask's .all(), .item()): fake tensors
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .fake_mode import quiet_fake_log
        with FakeTensorMode(), quiet_fake_log():
            net, data = _shapes_only(w, batch, dt, "cpu")
            rows = _leaf_rows(net, lambda: forward(net, data))
    first = next((t for t in [*data[0], *data[1].values()] if isinstance(t, torch.Tensor)), None)
    return Breakdown(
        model=w.name, input_shape=list(first.shape) if first is not None else [], dtype=dtype_name(dt),
        total_params=sum(p.numel() for p in net.parameters()),
        param_tensors=sum(1 for _ in net.parameters()),
        param_bytes=sum(p.numel() * p.element_size() for p in net.parameters()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in net.buffers()),
        forward_flops=sum(r.flops for r in rows),
        total_output_bytes=sum(r.output_bytes for r in rows), layers=rows,
        trainable_param_bytes=sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad),
        trainable_param_tensors=sum(1 for p in net.parameters() if p.requires_grad))


def _shapes_only(w, batch: int, dt: torch.dtype, device: str):
    net = w.build(device, dt)
    with torch.device(device):
        data = w.inputs(batch, dt)
    return net, data


def _leaf_rows(net: nn.Module, call) -> list[LayerRow]:
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
            net.eval()
            call()
    finally:
        for h in handles:
            h.remove()
    return rows


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
    step_peaks: list[int] = field(default_factory=list)   # each step's own peak (live bytes), in order
    kind: str = "image"            # the workload's kind: image, tokens, module
    input_text: str = ""           # what one batch was ("token ids (8, 512) int64 ...")
    seq_len: int | None = None
    amp: str | None = None

    @property
    def first_step_peak_bytes(self) -> int:
        """The first step's peak: before it, no optimizer state exists."""
        return self.step_peaks[0] if self.step_peaks else self.peak_bytes

    @property
    def steady_peak_bytes(self) -> int:
        """The last step's peak: every step from the second on holds the optimizer state (the
        steady state a training run lives in)."""
        return self.step_peaks[-1] if self.step_peaks else self.peak_bytes

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
            "kind": self.kind, "input": self.input_text, "seq_len": self.seq_len, "amp": self.amp,
            "step_peaks": list(self.step_peaks), "first_step_peak_bytes": self.first_step_peak_bytes,
            "steady_peak_bytes": self.steady_peak_bytes,
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
                 bd: Breakdown | None = None, input_bytes: int | None = None) -> dict[str, int | None]:
    """The formulas' view of a training step, per category (bytes).

    parameters / buffers / gradients / optimizer_state / inputs are exact formulas;
    activations is the reference articles' view (every layer's output kept for backward:
    the sum of leaf outputs), which lesson 03 puts to the test; temporaries has no formula
    (None). ``bd``: this model's breakdown at this batch, size and dtype, if already made.
    ``input_bytes``: the batch's bytes, when it is not an image batch with labels. Gradients
    and optimizer state count the trainable parameters only (``requires_grad``)."""
    if bd is None:
        bd = breakdown(model, batch, image_size, dtype)
    trained = bd.param_bytes if bd.trainable_param_bytes is None else bd.trainable_param_bytes
    n_tensors = bd.param_tensors if bd.trainable_param_tensors is None else bd.trainable_param_tensors
    if input_bytes is None:   # an image batch and its int64 labels
        input_bytes = F.tensor_bytes(bd.input_shape, bd.dtype) + F.tensor_bytes([batch], "int64")
    return {
        Category.PARAMETERS.value: bd.param_bytes,
        Category.BUFFERS.value: bd.buffer_bytes,
        Category.INPUTS.value: input_bytes,
        Category.OPTIMIZER_STATE.value: F.optimizer_state_bytes(trained, n_tensors, optimizer,
                                                                count_step_counters),
        Category.GRADIENTS.value: trained,
        Category.ACTIVATIONS.value: bd.total_output_bytes,
        Category.TEMPORARIES.value: None,
    }


def step_experiment(spec: ModelSpec, batch: int, image_size: int, optimizer: str, dtype: torch.dtype,
                    steps: int = 1):
    """The experiment function ``run`` calls: fresh model, ``steps`` training steps."""
    from .workload import image_workload
    return train_experiment(image_workload(spec, image_size), [batch] * steps, optimizer, dtype)


AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def train_experiment(w, batches: Sequence[int], optimizer: str, dtype: torch.dtype | None, amp: str | None = None):
    """Fresh model from the workload ``w``, then one training step per entry of ``batches``
    (forward, backward, optimizer step; from the second step on the gradients are set to None
    first). ``amp``: run forward under ``torch.autocast`` in fp16 or bf16. The value returned
    holds ``step_marks``: the tracker's event count at the start of each step and at the end,
    so each step's own peak can be read off the timeline."""
    from .workload import forward

    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"):
            net = w.build(ctx.device, dtype)
            opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
        data, data_batch, marks = None, None, []
        for i, b in enumerate(batches):
            if b != data_batch:
                data = None
                with ctx.phase("setup"), torch.device(ctx.device):
                    data = w.inputs(b, dtype)
                    for t in [*data[0], *data[1].values()]:
                        if isinstance(t, torch.Tensor):
                            ctx.label(t)
                data_batch = b
            marks.append(ctx.mark())
            if i:
                opt.zero_grad(set_to_none=True)
            with ctx.phase("forward"), _autocast(ctx.device, amp):
                output = forward(net, data)
                loss = w.loss(output, data)
                del output
            with ctx.phase("backward"):
                loss.backward()
            del loss
            with ctx.phase("optimizer"):
                opt.step()
        marks.append(ctx.mark())
        ctx.snapshot("after step")
        return {"n_param_tensors": sum(1 for _ in net.parameters()), "step_marks": marks}
    return experiment


def _autocast(device: torch.device, amp: str | None):
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])


def validate_amp(amp: str | None) -> str | None:
    if amp is None or str(amp).lower() in ("", "none", "off", "no"):
        return None
    key = str(amp).lower()
    if key not in AMP_DTYPES:
        raise ValueError(f"unknown --amp {amp!r}; valid: {', '.join(AMP_DTYPES)} (or leave it out for no autocast)")
    return key


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
    return StepResult(spec.name, batch, size, opt_key, dtype_name(dt), steps, m, predicted,
                      step_peaks=step_peaks(m), input_text=f"images ({batch}, 3, {size}, {size}) and labels")


def step_peaks(m: Measurement) -> list[int]:
    """Each training step's own peak, from the step marks the experiment returned."""
    marks = (m.value or {}).get("step_marks") if isinstance(m.value, dict) else None
    if not marks or m.tracking is None or m.oom:
        return []
    return [m.tracking.peak_between(a, b)[0] for a, b in zip(marks, marks[1:])]


def category_names() -> list[str]:
    return [c.value for c in CATEGORIES]
