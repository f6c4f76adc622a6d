"""What a model is made of, from shapes alone: per-layer output shapes, parameters and FLOPs
(``breakdown``, one forward pass on the meta device), and the formulas' view of a training
step by category (``predict_step``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.categories import Category
from gpulab.measure.shape_kernels import shape_kernels
from gpulab.models.registry import ModelSpec
from gpulab.units import dtype_bytes, dtype_name, parse_dtype

__all__ = [
    "Breakdown", "LayerRow", "breakdown", "flops_by_formula", "params_by_formula", "predict_step",
    "validate_batch"
]


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
    trainable_shapes: list[tuple[int, ...]] = field(default_factory=list)   # per trainable tensor

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(r) for r in self.layers]
        return d

    def _repr_html_(self) -> str:
        from gpulab.views import breakdown_html
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
    from gpulab.models.workload import forward, resolve_workload
    validate_batch(batch)
    dt = parse_dtype(dtype)
    w = resolve_workload(model, inputs, batch=None, input_shape=input_shape, seq_len=seq_len, image_size=image_size)
    try:
        net, data = _shapes_only(w, batch, dt, "meta")
        with shape_kernels():
            rows = _leaf_rows(net, lambda: forward(net, data))
    except Exception:   # a model that looks at values on the way (a mask's .all(), .item()): fake tensors
        from torch._subclasses.fake_tensor import FakeTensorMode

        from gpulab.measure.fake_mode import quiet_fake_log
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
        trainable_param_tensors=sum(1 for p in net.parameters() if p.requires_grad),
        trainable_shapes=[tuple(p.shape) for p in net.parameters() if p.requires_grad])


def _shapes_only(w, batch: int, dt: torch.dtype, device: str):
    from gpulab.training.routing import install_routing
    net = w.build(device, dt)
    install_routing(net, None)   # eager experts (data-dependent shapes) under the default routing; grouped_mm as is
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
        Category.OPTIMIZER_STATE.value: (
            F.shaped_optimizer_state_bytes(bd.trainable_shapes, optimizer, dtype_bytes(bd.dtype), count_step_counters)
            if optimizer in F.RECIPE_OPTIMIZERS else
            F.optimizer_state_bytes(trained, n_tensors, optimizer, count_step_counters)),
        Category.GRADIENTS.value: trained,
        Category.ACTIVATIONS.value: bd.total_output_bytes,
        Category.TEMPORARIES.value: None,
    }
