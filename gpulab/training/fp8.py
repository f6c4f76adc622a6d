"""FP8 training as torchao does it: ``convert_to_float8_training`` on the model's linear layers.

``fp8_convert(net, recipe)`` swaps each eligible ``nn.Linear`` for torchao's ``Float8Linear``
(``torchao.float8``) configured by ``Float8LinearConfig.from_recipe_name``: "tensorwise" (one fp32
scale per tensor, e4m3 for input and weight, e5m2 for the output's gradient) or "rowwise" (one
fp32 scale per row or column, e4m3 throughout, scales rounded to powers of 2). The weights stay
in their dtype (fp32 or bf16 master weights, as before); each forward casts the input and the
weight to float8 with a scale from ``max(abs(x))`` and multiplies them with ``torch._scaled_mm``;
backward casts the output's gradient, the weight and the input again for its two matmuls.

Which layers: as torchtitan (``torchtitan/components/quantization``: ``module_filter_fn``), a
linear layer whose weight's two dims are not both divisible by 16 (the FP8 tensor cores' rule)
stays in high precision, and so does the output head (torchtitan's ``filter_fqns=["output"]``;
here the model's ``get_output_embeddings()``, transformers' ``lm_head``). ``fp8_layers`` names
what was converted and what was kept.

What it saves for backward, read in torchao's source (0.18, ``float8_linear.py``,
``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(input_hp, weight_hp_t)``): the
high-precision input and weight, not their float8 copies; the casts are made, used and freed, and
backward casts again. Eager FP8 therefore keeps the same activations as bf16 and adds casts
(1 byte per element of input and weight, in forward; of the gradient, weight and input, in
backward), their scales, and the ``abs``/``amax`` temporaries that compute the scales. Under
``torch.compile`` the partitioner may choose to save float8 casts instead (gpulab's
``compile`` runs AOTAutograd's partitioner, not Inductor).

``fp8_added(tracking)`` reads, off a tracked run, the storages FP8 made: float8 tensors (the
casts) and the fp32 scales beside them, by phase.

NB: a fake run's ``_scaled_mm`` follows its meta kernel: an output of the input's dtype, no
workspace. On CPU, torch's ``_scaled_mm`` runs too (gpulab's cpu engine measures a real step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FP8_RECIPES", "FP8_DTYPES", "KINDS", "Fp8Added", "check_fp8", "check_fp8_for", "check_fp8_workload", "fp8_added",
           "fp8_convert", "fp8_layers", "float8_numel"]

from gpulab.options import FP8_RECIPES, check_fp8   # torch-free: the CLI checks --fp8 first

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # _scaled_mm's output dtypes
INSTALL = "pip install torchao"
TORCHAO_FLOOR = (0, 18)   # the release whose float8_linear.py the module docstring reads (what it saves)


def _torchao_version() -> tuple[int, ...] | None:
    """torchao's installed release as numbers (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        text = version("torchao")
    except PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def _torchao_float8():
    """``torchao.float8``, or a one-line error naming the install: torchao missing, or older than the
    release this module was read against (Colab ships torchao 0.10; gpulab's install asks for 0.18).
    (The pytree deprecation notice torchao's import makes torch 2.15 log is dropped for every
    importer by gpulab/__init__.py.)"""
    have = _torchao_version()
    floor = ".".join(map(str, TORCHAO_FLOOR))
    if have is not None and have < TORCHAO_FLOOR:
        raise ValueError(f"fp8 training follows torchao >= {floor}'s float8 layers (what they save for backward); "
                         f"this has torchao {'.'.join(map(str, have))}: pip install -U 'torchao>={floor}'")
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError(f"fp8 training runs torchao's float8 conversion, and torchao is not installed: "
                         f"{INSTALL}") from None
    return float8


def _head(net: nn.Module) -> nn.Module | None:
    get = getattr(net, "get_output_embeddings", None)
    return get() if callable(get) else None


def _eligible(module: nn.Module) -> bool:
    """torchtitan's rule: a linear layer whose weight's dims are both divisible by 16."""
    out_f, in_f = module.weight.shape
    return in_f % 16 == 0 and out_f % 16 == 0


def fp8_layers(net: nn.Module) -> tuple[list[str], list[str]]:
    """(converted, kept): the names of the linear layers ``fp8_convert`` turns to float8, and of those
    it keeps in high precision (the output head; dims not divisible by 16)."""
    head = _head(net)
    converted, kept = [], []
    for name, m in net.named_modules():
        if type(m) is nn.Linear:
            (converted if m is not head and _eligible(m) else kept).append(name)
    return converted, kept


def float8_numel(net: nn.Module) -> int:
    """The elements of the weights ``fp8_convert`` turns to float8 in ``net`` (``fp8_layers``' converted
    layers): what FSDP2's float8 all-gather gathers at 1 byte an element (``predict.sharding``)."""
    return sum(net.get_submodule(name).weight.numel() for name in fp8_layers(net)[0])


def check_fp8_for(net: nn.Module, dtype: torch.dtype | None, name: str) -> None:
    """Refuse, in one line, a model or dtype FP8 cannot train: weights in a dtype ``_scaled_mm``
    cannot return, or no linear layer to convert."""
    dt = dtype or torch.float32
    if dt not in _HP_DTYPES:
        raise ValueError(f"fp8 casts fp32, bf16 or fp16 weights to float8 for torch._scaled_mm; {name} is in "
                         f"{dt}: train it in fp32 or bf16 (dtype='bf16')")
    converted, kept = fp8_layers(net)
    if not converted:
        raise ValueError(f"fp8 converts linear layers whose dims are divisible by 16 (the output head stays); "
                         f"{name} has none ({len(kept)} kept in high precision): leave fp8 out")


def check_fp8_workload(w, dtype: torch.dtype | None) -> None:
    """``check_fp8_for`` before anything runs: the workload's model built on the meta device (free);
    a model gpulab cannot build unplaced (your own instance) is checked when its run builds it."""
    _torchao_float8()
    if w.make is None:
        return
    with torch.device("meta"):
        check_fp8_for(w.make(dtype), dtype, w.name)


def fp8_convert(net: nn.Module, recipe: str) -> nn.Module:
    """``net`` with its eligible linear layers swapped for torchao's ``Float8Linear`` (in place)."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    head = _head(net)
    return float8.convert_to_float8_training(
        net, config=config, module_filter_fn=lambda m, fqn: m is not head and _eligible(m))


KINDS = ("float8 casts", "scales", "cast work")


@dataclass
class Fp8Added:
    """What FP8's layers made beyond their matmuls during a tracked run, by kind and phase (bytes
    allocated over the run, each storage once): the float8 casts, their fp32 scales, and the work
    that made them (``abs`` and ``amax`` for the scale, the fp32 copy, its scaling and clamp); and
    the bytes of each kind alive at the run's peak. Tensor bytes, unrounded (numel × element size)."""
    made: dict[str, dict[str, int]]        # kind -> phase -> bytes
    at_peak: dict[str, int]                # kind -> bytes alive at the peak
    counts: dict[str, int]                 # kind -> storages

    def total(self, kind: str) -> int:
        return sum(self.made.get(kind, {}).values())

    def as_dict(self) -> dict:
        return {"made": {k: dict(v) for k, v in self.made.items()}, "at_peak": dict(self.at_peak),
                "counts": dict(self.counts)}


def _kind(rec, fp8_names: set[str]) -> str | None:
    """Which of FP8's additions a storage made inside a converted layer is (None: its matmul's output,
    a gradient, or anything a plain linear layer makes too)."""
    if rec.dtype in fp8_names:
        return "float8 casts"
    if rec.category.value not in ("temporaries", "activations") or rec.op in ("_scaled_mm", "mm", "addmm"):
        return None
    if rec.dtype == "float32" and (not rec.shape or (1 in rec.shape and len(rec.shape) >= 2)):
        return "scales"       # one per tensor (tensorwise), or per row or column (rowwise, keepdim)
    if rec.dtype == "float64":   # amax_to_scale computes the scale in float64 first
        return "scales"
    return "cast work"


def fp8_added(tracking, converted: list[str]) -> Fp8Added:
    """What the converted layers (``fp8_layers(net)[0]``) made in a tracked run
    (``measure.records.TrackingResult``), by kind (``KINDS``): read off the storages each made."""
    fp8_names = {str(d).removeprefix("torch.") for d in FP8_DTYPES}
    suffixes = tuple("." + n for n in converted)
    kinds = {}
    for sid, rec in tracking.records.items():
        if rec.module.endswith(suffixes) or rec.module in converted:
            kind = _kind(rec, fp8_names)
            if kind:
                kinds[sid] = kind
    made = {k: {} for k in KINDS}
    counts = dict.fromkeys(KINDS, 0)
    for sid, kind in kinds.items():
        rec = tracking.records[sid]
        made[kind][rec.phase] = made[kind].get(rec.phase, 0) + rec.nbytes
        counts[kind] += 1
    at_peak = dict.fromkeys(KINDS, 0)
    if tracking.peak_index >= 0:
        for rec in tracking.live_at(tracking.peak_index):
            if rec.sid in kinds:
                at_peak[kinds[rec.sid]] += rec.nbytes
    return Fp8Added(made, at_peak, counts)
