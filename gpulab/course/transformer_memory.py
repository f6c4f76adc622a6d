"""Lesson 11: where a transformer's training memory goes, per parameter.

``TRAINING_RECIPES``, ``bytes_per_param_table``, ``measured_bytes_per_param``: weights, gradients,
optimizer state and master weights under the usual training recipes (fp32 + Adam, the ZeRO
paper's mixed precision, autocast, pure bf16, bf16 weights with fp32 or 8-bit Adam state), and
for the recipes ``gpulab.step`` can run, the same bytes measured after a training step.

The parameter count itself, from the config: ``gpulab.course.transformer_params``; activations
per layer: ``gpulab.course.transformer_activations``.

Results are dataclasses; nothing here prints. Every number is computed (from a config, a
formula or a run) and carries its label: ``formula`` (``gpulab.measure.engines.LABEL_FORMULA``) or the
label of the engine that measured it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.measure.engines import LABEL_FORMULA, Measurement
from gpulab.tables import html_table
from gpulab.categories import Category
from gpulab.units import dtype_bytes
from gpulab.course.transformer_params import counted_params

__all__ = [
    "ADAM_SOURCE", "AUTOCAST_SOURCE", "BYTES_HEADER", "BytesPerParamRow", "EIGHT_BIT_SOURCE", "RECIPES",
    "TRAINING_RECIPES", "TrainingRecipe", "ZERO_SOURCE", "bytes_per_param_table", "live_after_last_step",
    "measured_bytes_per_param", "recipe", "recipe_bytes_per_param"
]


# --- bytes per parameter under training recipes -----------------------------------------------

ZERO_SOURCE = ("Rajbhandari et al., ZeRO (2019, arXiv 1910.02054), §3.1: fp16 weights and gradients, fp32 "
               "master weights, momentum and variance: 2 + 2 + 12 = 16 bytes per parameter")
ADAM_SOURCE = "torch.optim.Adam/AdamW: exp_avg and exp_avg_sq, each in the parameter's dtype (torch/optim/adam.py)"
AUTOCAST_SOURCE = ("torch.autocast (torch.amp docs): parameters, gradients and optimizer state stay fp32; matmuls "
                   "run on 16-bit copies of the weights made in forward")
EIGHT_BIT_SOURCE = ("Dettmers et al., 8-bit Optimizers via Block-wise Quantization (2021, arXiv 2110.02861); "
                    "bitsandbytes Optimizer2State: gpulab.formulas.eight_bit_optimizer_state_bytes")


@dataclass(frozen=True)
class TrainingRecipe:
    """Which dtype each kind of model state has. ``state`` is the dtype of each optimizer
    moment (None: 8-bit blockwise state); ``master`` the dtype of a separate master copy of
    the weights (None: the optimizer updates the weights themselves). ``step_dtype`` /
    ``step_amp``: how ``gpulab.step`` runs the recipe (``dtype=``, ``amp=``), None when it
    cannot (``why_not`` says why)."""
    key: str
    name: str
    weights: str
    gradients: str
    state: str | None
    master: str | None
    source: str
    optimizer: str = "adam"
    step_dtype: str | None = None
    step_amp: str | None = None
    note: str = ""
    why_not: str = ""

    @property
    def measurable(self) -> bool:
        return self.step_dtype is not None


TRAINING_RECIPES: tuple[TrainingRecipe, ...] = (
    TrainingRecipe("fp32", "fp32 + Adam", "float32", "float32", "float32", None, ADAM_SOURCE,
                   step_dtype="float32"),
    TrainingRecipe("zero-mixed", "mixed precision, fp32 master weights (ZeRO)", "float16", "float16", "float32",
                   "float32", ZERO_SOURCE,
                   why_not="gpulab.step keeps no separate master copy of the weights (apex O2, DeepSpeed and "
                           "Megatron-LM do)"),
    TrainingRecipe("autocast", "autocast bf16, fp32 weights", "float32", "float32", "float32", None,
                   AUTOCAST_SOURCE, step_dtype="float32", step_amp="bf16",
                   note="plus the 16-bit copies of the weights autocast makes in forward (saved for backward, "
                        "so they count as activations, not as model state)"),
    TrainingRecipe("pure-bf16", "pure bf16 + Adam", "bfloat16", "bfloat16", "bfloat16", None, ADAM_SOURCE,
                   step_dtype="bfloat16"),
    TrainingRecipe("bf16-fp32-adam", "bf16 weights, fp32 Adam state", "bfloat16", "bfloat16", "float32", None,
                   ADAM_SOURCE + "; the moments kept in fp32 (e.g. a custom or fused optimizer)",
                   why_not="torch.optim keeps Adam's moments in the parameters' dtype; gpulab.step has no "
                           "optimizer with fp32 state for bf16 weights"),
    TrainingRecipe("adam-8bit", "bf16 weights, 8-bit Adam state", "bfloat16", "bfloat16", None, None,
                   EIGHT_BIT_SOURCE,
                   why_not="gpulab.step runs torch.optim optimizers only, not bitsandbytes"),
)
RECIPES = {r.key: r for r in TRAINING_RECIPES}


def recipe(key: str | TrainingRecipe) -> TrainingRecipe:
    """A recipe by key (``"fp32"``, ``"pure-bf16"``, ...) or name; ``ValueError`` lists the keys."""
    if isinstance(key, TrainingRecipe):
        return key
    k = str(key).strip().lower()
    for r in TRAINING_RECIPES:
        if k in (r.key, r.name.lower()):
            return r
    raise ValueError(f"unknown training recipe {key!r}; valid: {', '.join(RECIPES)}")


@dataclass
class BytesPerParamRow:
    """One recipe's model-state bytes per parameter. The per-parameter fields are the byte
    counts divided by ``n_params``; ``step_counter_bytes`` is the part of the optimizer state
    that is Adam's scalar ``step`` tensors (one float32 per parameter tensor, where they live on
    the measured device). A measured row carries the ``formula`` row for the same model."""
    recipe: str
    name: str
    n_params: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    master_bytes: int
    source: str
    label: str
    n_param_tensors: int = 0
    step_counter_bytes: int = 0
    note: str = ""
    model: str = ""
    formula: BytesPerParamRow | None = None
    moment: str = ""   # a measured row: when the live bytes were read

    @property
    def weights(self) -> float:
        return self.weight_bytes / self.n_params

    @property
    def gradients(self) -> float:
        return self.gradient_bytes / self.n_params

    @property
    def optimizer_state(self) -> float:
        return self.optimizer_state_bytes / self.n_params

    @property
    def master_weights(self) -> float:
        return self.master_bytes / self.n_params

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.master_bytes

    @property
    def total(self) -> float:
        return self.total_bytes / self.n_params

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "formula"}
        d.update(weights=self.weights, gradients=self.gradients, optimizer_state=self.optimizer_state,
                 master_weights=self.master_weights, total=self.total, total_bytes=self.total_bytes)
        if self.formula is not None:
            d["formula"] = self.formula.as_dict()
        return d

    def cells(self) -> list[str]:
        return [self.name, f"{self.weights:g}", f"{self.gradients:g}", f"{self.optimizer_state:.6g}",
                f"{self.master_weights:g}", f"{self.total:.6g}", self.label]

    def _repr_html_(self) -> str:
        rows = [self.cells()] + ([self.formula.cells()] if self.formula is not None else [])
        return html_table(BYTES_HEADER, rows, f"{self.model or 'model'}: {self.n_params:,} parameters")


BYTES_HEADER = ["recipe", "weights B/param", "gradients", "optimizer state", "master weights", "total", "source"]


def recipe_bytes_per_param(r: str | TrainingRecipe, n_params: int, n_param_tensors: int = 0,
                           count_step_counters: bool = False, optimizer: str | None = None) -> BytesPerParamRow:
    """The formula row of recipe ``r`` for ``n_params`` parameters in ``n_param_tensors``
    tensors: element sizes from ``gpulab.units.dtype_bytes``; the optimizer state from
    ``gpulab.formulas.optimizer_state_bytes`` (state count x the moments' dtype, plus one 4-byte
    ``step`` scalar per parameter tensor when ``count_step_counters``: the CPU keeps them with
    the state, a GPU in host memory) or, for 8-bit state,
    ``gpulab.formulas.eight_bit_optimizer_state_bytes``.

    NB: the 8-bit state is computed as if all parameters were one tensor (blocks do not span
    tensors, which adds at most 8 bytes per tensor; tensors under 4096 elements keep 32-bit
    state)."""
    r = recipe(r)
    opt = optimizer or r.optimizer
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params!r}")
    if r.state is None:
        state = F.eight_bit_optimizer_state_bytes(n_params, F.optimizer_state_multiplier(opt))
        counters = 0
    else:
        state = F.optimizer_state_bytes(n_params * dtype_bytes(r.state), n_param_tensors, opt, count_step_counters)
        counters = F.optimizer_state_bytes(0, n_param_tensors, opt, count_step_counters)
    return BytesPerParamRow(r.key, r.name, n_params, n_params * dtype_bytes(r.weights),
                            n_params * dtype_bytes(r.gradients), state,
                            n_params * dtype_bytes(r.master) if r.master else 0, r.source, LABEL_FORMULA,
                            n_param_tensors, counters, r.note)


def bytes_per_param_table(n_params: int) -> list[BytesPerParamRow]:
    """Every recipe of ``TRAINING_RECIPES`` for a model of ``n_params`` parameters (formula; no
    step counters: a GPU keeps them in host memory)."""
    return [recipe_bytes_per_param(r, n_params) for r in TRAINING_RECIPES]


def _step_model(config_or_name: Any) -> Any:
    """What ``gpulab.step`` takes: ``hf:NAME`` for a built-in config, a config object as is."""
    if hf_configs.is_config(config_or_name):
        return config_or_name
    return hf_configs.HF_PREFIX + hf_configs.hf_entry(config_or_name).name


def live_after_last_step(m: Measurement) -> dict[str, int]:
    """Live tensor bytes per category (unrounded: numel x element size, as the formulas count)
    on the measured device just after the last ``optimizer.step()`` of a ``gpulab.step`` run,
    when the weights, their gradients and the optimizer state all exist. (At the run's peak a
    gradient may not exist yet: the peak can fall in the backward pass.)"""
    marks = (m.value or {}).get("step_marks") if isinstance(m.value, dict) else None
    if not marks or m.tracking is None:
        raise ValueError("the run has no step marks: it did not finish a training step")
    end = marks[-1]
    out = {c.value: 0 for c in Category}
    for r in m.tracking.records.values():
        if r.created < end and (r.freed is None or r.freed >= end):
            out[r.category.value] += r.nbytes
    return out


def measured_bytes_per_param(config_or_name: Any, r: str | TrainingRecipe = "fp32", engine: str = "cpu",
                             batch: int = 1, seq_len: int | None = None, optimizer: str | None = None,
                             steps: int = 1) -> BytesPerParamRow:
    """Run recipe ``r`` with ``gpulab.step`` (``steps`` training steps, its dtype, autocast and
    optimizer; ``optimizer`` overrides the recipe's, e.g. "adamw", whose state is Adam's) and
    divide the live parameter, gradient and optimizer-state bytes after the last step by the
    parameter count (``counted_params``). One step is enough: the optimizer creates its state in
    its first ``step()``, so right after it the weights, their gradients and the whole state are
    live, as after any later step (a second step frees and remakes the same tensors). Returns the measured row, labelled with the run's
    label, with the formula row for the same model attached (``.formula``), counting Adam's
    ``step`` scalars where the run keeps them on the measured device: the cpu engine does (one
    float32 per parameter tensor, in optimizer state); a GPU, and the fake engine's CUDA target,
    keep them in host memory. A recipe ``gpulab.step`` cannot run raises ``ValueError``."""
    from gpulab.predict.step import step
    r = recipe(r)
    if not r.measurable:
        raise ValueError(f"cannot measure {r.name!r}: {r.why_not}; its bytes per parameter are a formula only "
                         f"(recipe_bytes_per_param)")
    opt = optimizer or r.optimizer
    result = step(_step_model(config_or_name), batch=batch, seq_len=seq_len, engine=engine, dtype=r.step_dtype,
                  amp=r.step_amp, optimizer=opt, steps=steps)
    m = result.measurement
    if m.oom:
        raise MemoryError(f"{r.name} ran out of memory on the {m.engine} engine: {m.error}")
    n, tensors = counted_params(config_or_name)
    live = live_after_last_step(m)
    counters_here = m.kernels != "cuda"
    formula = recipe_bytes_per_param(r, n, tensors, counters_here, opt)
    counters = sum(rec.nbytes for rec in m.tracking.records.values()
                   if rec.state_key == "step" and rec.category == Category.OPTIMIZER_STATE)
    return BytesPerParamRow(r.key, r.name, n, live[Category.PARAMETERS.value], live[Category.GRADIENTS.value],
                            live[Category.OPTIMIZER_STATE.value], 0, r.source, m.label, tensors,
                            counters if counters_here else 0, r.note, model=result.model, formula=formula,
                            moment="live after the last optimizer step")
