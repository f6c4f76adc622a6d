"""What a user asks, checked without importing torch: the public ``Recipe`` and ``Layout``, and the
values their fields take.

``gpulab.fit(model, card, recipe=Recipe(...), layout=Layout(...))`` and ``gpulab.step(model, ...,
recipe=..., layout=...)`` take them; their flat keyword arguments build them (``settings_from``). Each
is a small frozen dataclass, built once (from keywords, or from the command line's flags by
``gpulab.cli``), checked once when it is made (``ValueError`` saying what to do), compared by value
and passed whole. The grouping follows torchtitan's ``JobConfig`` sections (``training``,
``parallelism``) and torchtune's recipe configs:

* ``Recipe``: what one training step does: the optimizer and its implementation, the model's
  dtype, autocast and GradScaler, accumulation, clipping, where gradients go, activation memory
  (offloading, chunked loss, checkpointing, compile, the KV cache), LoRA / QLoRA, an MoE's routing
  assumption, FP8, and FSDP2's precision settings (``param_dtype`` / ``reduce_dtype``: its
  ``MixedPrecisionPolicy``, torchtitan's ``training.mixed_precision_param`` / ``_reduce``;
  ``fp8_all_gather``: float8 weights all-gathered; ``check_fsdp_policy``: fsdp2 only). ``dtype`` is here, not beside the model or the card: the dtype the model is
  built and trained in (pure bf16 training, or fp32 weights under autocast) is a training choice, as
  torchtune's recipe configs hold ``dtype`` and torchtitan's ``training`` section its mixed-precision
  dtypes; the model names an architecture, the card a memory.
* ``Layout``: how the step is spread over GPUs: the data-parallel strategy over ``gpus``, tensor
  (``tp``, ``sequence_parallel``), context (``cp``), expert (``ep``) and pipeline (``pp``,
  ``microbatches``, ``schedule``, ``virtual_stages``; ``pp_stage``: the stage ``step`` measures)
  parallelism. ``dp`` is derived: the data-parallel degree ``gpus / (tp × cp × pp)``, torchtitan's
  ``ParallelDims`` naming (expert parallelism borrows its ranks from the others).

The ``gpulab`` command refuses a bad value before torch and transformers load (half a second
instead of several). The library checks the same values with the same functions, re-exported
where they were first written (``models.adapt.check_checkpointing``,
``training.chunked_loss.check_chunks``, ``training.pipeline.check_pp_options``,
``training.tensor_parallel.check_tp_options``, ``models.lora.check_rank`` ...). What needs the
model (heads that ``tp`` divides, layers that ``pp`` splits) is checked when a workload meets the
recipe (``training.loop.check_recipe_for``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from gpulab.formulas import OPTIMIZER_STATES, RECIPE_OPTIMIZERS, check_optimizer
from gpulab.units import check_model_dtype_name

__all__ = ["Layout", "Recipe", "ALL_OPTIMIZERS", "AMP_NAMES", "CHECKPOINTING_POLICIES", "COMPUTE_DTYPE_NAMES", "FOUR_BIT", "FP8_RECIPES",
           "IMPLEMENTATION_NAMES", "LORA_DTYPES", "MAX_STEPS", "POLICY_TEXT", "QUANTIZATIONS", "SCHEDULES", "STRATEGY_NAMES",
           "MIXED_PRECISION_DTYPES", "check_amp", "check_checkpointing", "check_chunks", "check_cp_ep_options", "check_cp_options",
           "check_ep_options", "check_fp8", "check_fsdp_policy", "check_implementation", "check_lora_dtype", "check_pp_options",
           "check_layout_degrees", "check_mixed_precision", "check_precision_policy", "check_rank", "check_routing_text", "check_step_options", "check_targets",
           "check_together", "check_tp_options", "settings_from"]

# what gpulab.step / gpulab.fit / the CLI take: the lessons' optimizers, then the recipe optimizers
# (training.optimizers.ALL_OPTIMIZERS is the same tuple)
ALL_OPTIMIZERS = (*OPTIMIZER_STATES, *RECIPE_OPTIMIZERS)
AMP_NAMES = ("fp16", "bf16")       # the keys of training.loop.AMP_DTYPES
MAX_STEPS = 10   # tracked steps of one call: each repeats the steady state of step 2
SCHEDULES = ("1f1b", "gpipe", "interleaved")   # training.pipeline.SCHEDULES: the pipeline schedules gpulab measures

CHECKPOINTING_POLICIES = ("full", "selective", "torchtitan-op", "every-K")
POLICY_TEXT = ("full (every block), selective (op-level selective activation checkpointing, SAC: matmul and "
               "attention outputs kept, the rest recomputed), torchtitan-op (torchtitan's op-level SAC: its save "
               "list, every other matmul recomputed) or every-K (every K-th block, e.g. every-2)")


def check_checkpointing(value) -> str | bool:
    """A checkpointing choice as the recipe keeps it: False (none), "full", "selective",
    "torchtitan-op" or "every-K" with K ≥ 2 ("every-1" is "full"). True means "full". ``ValueError`` naming the
    choices otherwise."""
    if value is False or value is None:
        return False
    if value is True:
        return "full"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("full", "selective", "torchtitan-op"):
            return v
        if v.startswith("every-") and v[6:].isdigit() and int(v[6:]) >= 1:
            return "full" if int(v[6:]) == 1 else f"every-{int(v[6:])}"
    raise ValueError(f"checkpointing must be True or False, or a policy: {POLICY_TEXT}; got {value!r}")


def check_chunks(chunks) -> int:
    """0 (the model's own loss) or a number of chunks from 2 to 64; anything else is refused."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not (chunks == 0 or 2 <= chunks <= 64):
        raise ValueError(f"chunked_loss must be a number of chunks from 2 to 64 (torchtune uses 8), or 0 for the "
                         f"model's own loss; got {chunks!r}")
    return chunks


FP8_RECIPES = ("tensorwise", "rowwise")   # torchao.float8's Float8LinearRecipeName values gpulab runs


def check_fp8(fp8) -> str | None:
    """None (off) or one of torchao's float8 training recipes; anything else is refused in one line."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 must be one of {', '.join(FP8_RECIPES)} (torchao's float8 training recipes), "
                         f"got {fp8!r}")
    return fp8


# --- FSDP2's MixedPrecisionPolicy and float8 all-gather (predict.sharding) ----------------------------

MIXED_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_mixed_precision(name: str, value: Any) -> str | None:
    """None, or a dtype of FSDP2's ``MixedPrecisionPolicy`` by its short name ("bf16", "fp32", "fp16";
    torch's names "bfloat16", "float32", "float16" are taken too)."""
    if value is None:
        return None
    text = str(value).removeprefix("torch.").lower()
    short = {long: short for short, long in MIXED_PRECISION_DTYPES.items()}.get(text, text)
    if short not in MIXED_PRECISION_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(MIXED_PRECISION_DTYPES)} (FSDP2's MixedPrecisionPolicy), "
                         f"got {value!r}")
    return short


def check_precision_policy(r: Any) -> None:
    """What the FSDP2 settings of a recipe go with, in the recipe alone: the float8 all-gather is the
    tensorwise recipe's (torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``; rowwise
    scales cannot be computed on a shard), and a parameter dtype replaces autocast (FSDP2 casts the
    parameters and the forward's inputs itself)."""
    if r.fp8_all_gather and r.fp8 != "tensorwise":
        raise ValueError("fp8_all_gather all-gathers tensorwise float8 weights (torchao's enable_fsdp_float8_all_gather): "
                         "give fp8='tensorwise' with it (--fp8 tensorwise)")
    if r.param_dtype and r.amp:
        raise ValueError("param_dtype is FSDP2's mixed precision: the unsharded parameters and the inputs cast to "
                         "it, no autocast; leave out amp with it")


def check_fsdp_policy(recipe: Any, layout: Any) -> None:
    """FSDP2's settings need FSDP2: a MixedPrecisionPolicy or the float8 all-gather with --strategy
    fsdp2 over several GPUs (with pp, each stage's ``fully_shard`` gets the policy, as torchtitan's
    ``apply_fsdp_to_decoder`` does per model part: ``predict.pipeline_fit``)."""
    asked = [name for name, on in (("param_dtype", recipe.param_dtype), ("reduce_dtype", recipe.reduce_dtype),
                                   ("fp8_all_gather", recipe.fp8_all_gather)) if on]
    if not asked:
        return
    what = ", ".join(asked)
    if layout.strategy != "fsdp2" or layout.gpus is None:
        raise ValueError(f"{what} {'is' if len(asked) == 1 else 'are'} FSDP2's (fully_shard's MixedPrecisionPolicy, "
                         f"torchao's float8 all-gather): give strategy='fsdp2' and gpus=N (--strategy fsdp2 --gpus N)")


# --- the optimizer's implementation, autocast ------------------------------------------------------

IMPLEMENTATION_NAMES = ("default", "for-loop", "foreach", "fused")   # training.optimizers.IMPL_FLAGS' keys


def check_implementation(impl: str) -> str:
    key = str(impl).lower()
    if key not in IMPLEMENTATION_NAMES:
        raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLEMENTATION_NAMES)}")
    return key


def check_amp(amp: str | None) -> str | None:
    """"fp16" / "bf16" (``AMP_NAMES``), or None for no autocast; anything else is refused."""
    if amp is None or str(amp).lower() in ("", "none", "off", "no"):
        return None
    key = str(amp).lower()
    if key not in AMP_NAMES:
        raise ValueError(f"unknown --amp {amp!r}; valid: {', '.join(AMP_NAMES)} (or leave it out for no autocast)")
    return key


# --- LoRA and a quantized base (models.lora, models.quantized) --------------------------------------

LORA_DTYPES = {"fp32": "fp32 adapters (peft's default)", "base": "adapters in the base's dtype (torchtune's)"}
QUANTIZATIONS = ("nf4", "fp4", "int8")
FOUR_BIT = ("nf4", "fp4")
COMPUTE_DTYPE_NAMES = ("fp32", "bf16", "fp16")   # models.quantized.COMPUTE_DTYPES' keys


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be a non-empty list of module names such as ('q_proj', 'v_proj'), "
                         f"got {targets!r}")
    return tuple(targets)


def check_lora_dtype(value: Any) -> str:
    if value not in LORA_DTYPES:
        raise ValueError(f"lora_dtype must be 'fp32' (peft's default: adapters upcast to float32) or 'base' (the "
                         f"adapters in the model's dtype, as torchtune keeps them), got {value!r}")
    return value


def check_rank(rank: Any) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive whole number, got {rank!r}")
    return rank


# --- a mixture of experts' routing (training.routing) ---------------------------------------------

def check_routing_text(value: Any) -> tuple[str, float]:
    """A routing written as text: ("balanced" | "worst" | "router", 0.0) or ("capacity", F) with F > 0;
    anything else is refused in one line (``training.routing.parse_routing`` builds the ``Routing``)."""
    text = str(value).strip().lower()
    if text in ("balanced", "worst", "router"):
        return text, 0.0
    if text.startswith("capacity"):
        _, _, factor = text.partition(":")
        try:
            f = float(factor)
        except ValueError:
            f = -1.0
        if not 0 < f < float("inf"):
            raise ValueError(f"routing 'capacity:F' takes a capacity factor F > 0 (e.g. capacity:1.25), "
                             f"got {value!r}")
        return "capacity", f
    raise ValueError(f"routing must be 'balanced', 'capacity:F' (e.g. capacity:1.25), 'worst' or 'router', "
                     f"got {value!r}")


# --- the parallel layout's degrees ----------------------------------------------------------------

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")   # predict.sharding.STRATEGIES' keys


def check_tp_options(tp: int, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """ValueError, in one line, for a tensor-parallel degree that is not a whole number >= 1, or
    sequence or loss parallelism without it."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor parallelism must be a whole number of ranks >= 1, got {tp!r}")
    if sequence_parallel and tp < 2:
        raise ValueError("sequence parallelism splits the sequence over the tensor-parallel ranks: give --tp 2 or more")
    if loss_parallel and tp < 2:
        raise ValueError("loss parallelism computes the loss on logits split over the tensor-parallel ranks' "
                         "vocabulary shards: give --tp 2 or more")


def check_cp_options(cp: int) -> None:
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"context parallelism must be a whole number of ranks >= 1, got {cp!r}")


def check_ep_options(ep: int) -> None:
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"expert parallelism must be a whole number of ranks >= 1, got {ep!r}")


def check_cp_ep_options(cp: int, ep: int, tp: int, pp: int = 1) -> None:
    """The context- and expert-parallel degrees, each a whole number of ranks. Every combination of
    them with tp and pp is measured, as torchtitan runs it: ep with tp (the experts whole on each rank,
    torchtitan's default expert tensor-parallel degree 1: ``training.expert_parallel``), ep with cp
    (each rank routes its sequence shard's tokens) and cp with pp (each stage's sequence shard)."""
    check_cp_options(cp)
    check_ep_options(ep)


def check_pp_options(pp: int, microbatches: int | None = None, schedule: str = "1f1b", stage: int = 0,
                     virtual: int = 1) -> None:
    """ValueError, in one line, for a pipeline degree, micro-batch count, schedule, stage or number of
    virtual stages (chunks per rank) that is not one."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline parallelism must be a whole number of stages >= 1, got {pp!r}")
    if microbatches is not None and (not isinstance(microbatches, int) or isinstance(microbatches, bool)
                                     or not 1 <= microbatches <= 1024):
        raise ValueError(f"microbatches must be a whole number from 1 to 1024, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < pp:
        raise ValueError(f"pp_stage must be a stage from 0 to {pp - 1}, got {stage!r}")
    if pp == 1 and (microbatches is not None or schedule != "1f1b" or stage or virtual != 1):
        raise ValueError("microbatches, schedule, pp_stage and virtual_stages are a pipeline's: give --pp 2 or more")
    _check_virtual(schedule, virtual, pp, microbatches)


def _check_virtual(schedule: str, virtual: int, pp: int, microbatches: int | None) -> None:
    """Chunks per rank go with the interleaved schedule only, two or more of them; its micro-batches
    as torch's ScheduleInterleaved1F1B takes them (a multiple of its rounds, max(1, M // pp))."""
    if not isinstance(virtual, int) or isinstance(virtual, bool) or not 1 <= virtual <= 64:
        raise ValueError(f"virtual_stages must be a whole number of model chunks per rank from 1 to 64, got {virtual!r}")
    if schedule != "interleaved":
        if virtual != 1:
            raise ValueError(f"virtual_stages (model chunks per rank) is the interleaved schedule's: add --schedule "
                             f"interleaved, or leave virtual_stages out with {schedule}")
        return
    if virtual < 2:
        raise ValueError("the interleaved schedule puts two or more model chunks on each rank: give --virtual-stages "
                         "2 or more (Megatron-LM's virtual pipeline size)")
    rounds = max(1, (microbatches or pp) // pp)
    if microbatches is not None and microbatches % rounds:
        raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of pp: {microbatches} micro-batches make "
                         f"{rounds} rounds and {rounds} does not divide {microbatches} (torch's "
                         f"ScheduleInterleaved1F1B); use a multiple of {pp}, or fewer than {2 * pp}")


# --- the public objects ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """What one training step does (module docstring); the defaults are ``gpulab.step``'s and ``gpulab.fit``'s.

    >>> Recipe(optimizer="adamw", dtype="bf16", checkpointing="selective")
    Recipe(optimizer='adamw', dtype='bfloat16', checkpointing='selective')
    """
    optimizer: str = "adam"
    implementation: str = "default"          # the optimizer's: "default", "for-loop", "foreach" or "fused"
    dtype: str | None = None                 # the model's dtype ("bf16": pure bf16 training); None keeps float32
    amp: str | None = None                   # autocast's dtype for the forward: "fp16" or "bf16"
    grad_scaler: bool = False                # fp16 autocast's GradScaler
    accumulate: int = 1                      # micro-batches of the batch per optimizer step
    clip_grad_norm: float | None = None      # the gradients' total norm clipped to it before the step
    set_to_none: bool = True                 # False: zero_grad keeps the gradients, zeroed, between steps
    optimizer_in_backward: bool = False      # each parameter stepped as soon as its gradient exists
    offload_activations: bool = False        # saved activations in host memory (save_on_cpu)
    chunked_loss: int = 0                    # a language model's head and loss in K chunks of positions
    use_cache: bool | None = None            # False: the training forward without its KV cache
    compile: bool = False                    # torch.compile: inductor's partition and plan (training.inductor_plan)
    checkpointing: bool | str = False        # False, "full", "selective" or "every-K"
    lora: int = 0                            # LoRA adapters' rank (0: none)
    lora_targets: tuple[str, ...] | None = None   # the layers LoRA adapts (None: peft's default)
    lora_dropout: float = 0.0
    lora_dtype: str = "fp32"                 # the adapters' dtype: "fp32" (peft) or "base" (torchtune)
    quantize: str | None = None              # the base as bitsandbytes stores it: "nf4", "fp4" or "int8"
    double_quant: bool = True                # a 4-bit base's double quantization
    quant_compute_dtype: str = "input"       # a 4-bit base's compute dtype ("input": the input's)
    routing: Any = None                      # an MoE's routing assumption (training.routing); None: balanced
    fp8: str | None = None                   # torchao's float8 training: "tensorwise" or "rowwise"
    fp8_all_gather: bool = False             # with fp8 tensorwise and fsdp2: weights all-gathered in float8
    param_dtype: str | None = None           # fsdp2's MixedPrecisionPolicy: the unsharded parameters' dtype
    reduce_dtype: str | None = None          # fsdp2's MixedPrecisionPolicy: the dtype gradients are reduced in

    def __post_init__(self) -> None:
        for name in ("grad_scaler", "set_to_none", "optimizer_in_backward", "offload_activations", "compile",
                     "double_quant", "fp8_all_gather"):
            _check_bool(name, getattr(self, name))
        if self.use_cache is not None:
            _check_bool("use_cache", self.use_cache)
        _set(self, "optimizer", check_optimizer(self.optimizer, recipes=True))
        _set(self, "implementation", check_implementation(self.implementation))
        if self.dtype is not None:
            _set(self, "dtype", _dtype_name(self.dtype))
        _set(self, "amp", check_amp(self.amp))
        check_chunks(self.chunked_loss)
        _set(self, "checkpointing", check_checkpointing(self.checkpointing))
        _set(self, "fp8", check_fp8(self.fp8))
        for name in ("param_dtype", "reduce_dtype"):
            _set(self, name, check_mixed_precision(name, getattr(self, name)))
        check_precision_policy(self)
        _set(self, "routing", _routing(self.routing))
        self._check_adapters()
        check_step_options(self, fp16_autocast=self.amp == "fp16")
        if self.fp8 and (self.lora or self.quantize):
            raise ValueError("fp8 converts the model's own linear layers to torchao's Float8Linear: leave out lora "
                             "and quantize with fp8 (their layers are not plain nn.Linear)")

    def _check_adapters(self) -> None:
        """LoRA's rank, targets, dropout and dtype, and a quantized base's choices: valid, and only with
        what they change (``training.loop.user_recipe`` said the same)."""
        if self.lora:
            check_rank(self.lora)
        if self.lora_targets is not None:
            if not self.lora:
                raise ValueError("lora_targets names the layers LoRA adapts: give lora=RANK too (e.g. lora=8)")
            _set(self, "lora_targets", check_targets(self.lora_targets))
        d = self.lora_dropout
        if not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1):
            raise ValueError(f"lora_dropout must be a probability from 0 to below 1, got {d!r}")
        _set(self, "lora_dropout", float(d))
        if d and not self.lora:
            raise ValueError("lora_dropout is the dropout on LoRA adapters' inputs: give lora=RANK too (e.g. lora=8)")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)} (the base weights as bitsandbytes "
                             f"stores them), got {self.quantize!r}")
        if self.quantize and not self.lora:
            raise ValueError(f"a {self.quantize} base is frozen: it trains through adapters; add lora=RANK (QLoRA: "
                             f"quantize='nf4', lora=8; on the command line --lora R, or --qlora)")
        if self.quant_compute_dtype is None:
            _set(self, "quant_compute_dtype", "input")
        check_lora_dtype(self.lora_dtype)
        if self.lora_dtype != "fp32" and not self.lora:
            raise ValueError("lora_dtype is the LoRA adapters' dtype: give lora=RANK too (e.g. lora=8)")
        q = self.quant_compute_dtype
        if q != "input" and q not in COMPUTE_DTYPE_NAMES:
            raise ValueError(f"quant_compute_dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)} (bitsandbytes' "
                             f"bnb_4bit_compute_dtype; transformers' default is fp32), or 'input' for the input's "
                             f"dtype (Linear4bit's own default); got {q!r}")
        for name, on in (("double_quant=False", not self.double_quant), ("quant_compute_dtype", q != "input")):
            if on and self.quantize not in FOUR_BIT:
                raise ValueError(f"{name} is a choice of a 4-bit base (bitsandbytes' Linear4bit): give "
                                 f"quantize='nf4' or 'fp4' with it")

    def changed(self) -> dict[str, Any]:
        """The fields set away from their defaults."""
        return _changed(self)

    def __repr__(self) -> str:
        return _repr(self)


@dataclass(frozen=True)
class Layout:
    """How the step is spread over GPUs (module docstring): one GPU by default.

    >>> Layout(gpus=64, strategy="fsdp2", tp=8, pp=4)
    Layout(gpus=64, strategy='fsdp2', tp=8, pp=4, microbatches=4)
    """
    gpus: int | None = None           # the GPUs in all (None: one); the answer is one rank's
    strategy: str | None = None       # data parallelism over them: "ddp", "zero1", "zero2", "zero3" or "fsdp2"
    offload_optimizer: bool = False   # with zero*/fsdp2: the optimizer state in host memory
    tp: int = 1                       # tensor-parallel ranks
    sequence_parallel: bool = False   # with tp: norms and the residual stream on a sequence shard
    loss_parallel: bool = False       # with tp: logits and cross-entropy sharded on the vocabulary
    cp: int = 1                       # context-parallel ranks: each holds a shard of the sequence
    ep: int = 1                       # expert-parallel ranks: each holds experts/ep of every MoE layer
    pp: int = 1                       # pipeline stages
    microbatches: int | None = None   # with pp: micro-batches per step (None: pp)
    schedule: str = "1f1b"            # with pp: "1f1b", "gpipe" or "interleaved"
    virtual_stages: int = 1           # with the interleaved schedule: model chunks per rank
    pp_stage: int = 0                 # with pp: the stage ``gpulab.step`` measures (``fit`` answers every stage)
    dp_replicate: int | None = None   # the mesh's replicas (DDP; HSDP's outer dimension); None: derived
    dp_shard: int | None = None       # the ranks a replica's state is sharded over (FSDP2, ZeRO); None: derived

    def __post_init__(self) -> None:
        g = self.gpus
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
            raise ValueError(f"gpus must be a whole number of GPUs, 1 or more, not {g!r}")
        if self.strategy is not None and self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"unknown strategy {self.strategy!r}: one of {', '.join(STRATEGY_NAMES)}")
        _check_bool("offload_optimizer", self.offload_optimizer)
        _check_bool("sequence_parallel", self.sequence_parallel)
        _check_bool("loss_parallel", self.loss_parallel)
        check_layout_degrees(self)
        if self.pp > 1 and self.microbatches is None:   # a pipeline's default: one micro-batch per stage
            _set(self, "microbatches", self.pp)
        replicate, shard = _mesh_dp(self, self.dp_replicate, self.dp_shard)
        _set(self, "dp_replicate", replicate)
        _set(self, "dp_shard", shard)

    @property
    def dp(self) -> int:
        """The data-parallel degree: ``dp_replicate × dp_shard``, the GPUs over which model replicas (or
        their shards) are spread, ``gpus / (tp × cp × pp)`` (1 on one GPU). Expert parallelism borrows its
        ranks from ``dp_shard × cp`` (torchtitan's ``ParallelDims``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded_over(self) -> int:
        """The ranks a sharding strategy (fsdp2, zero*) splits one rank's parameters, gradients and
        optimizer state over: ``dp_shard × cp``, torchtitan's ``fsdp`` mesh ("when cp is used, FSDP is
        also applied ... even if there may be no data parallelism", ``ParallelDims.build_mesh``); under
        ddp, or with no strategy, the ``dp`` replicas (nothing is split)."""
        if self.strategy in SHARDED_STRATEGIES:
            return self.dp_shard * self.cp
        return self.dp

    @property
    def shard_group(self) -> tuple[tuple[str, int], ...]:
        """``sharded_over`` as the mesh's dimensions it is the product of: (("dp_shard", 4), ("cp", 2))
        under fsdp2/zero*, (("dp_replicate", r), ("dp_shard", s)) otherwise."""
        if self.strategy in SHARDED_STRATEGIES:
            return (("dp_shard", self.dp_shard), ("cp", self.cp))
        return (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The mesh torchtitan's ``ParallelDims`` names, outermost replicas first, and ``ep``."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                "pp": self.pp, "ep": self.ep}

    @property
    def mesh(self) -> str:
        """The mesh in words: "mesh dp_replicate 1 × dp_shard 8 × cp 1 × tp 1 × pp 1 (ep 8 from dp_shard × cp)"."""
        dims = " × ".join(f"{k} {v}" for k, v in self.mesh_dims.items() if k != "ep")
        borrowed = f" (ep {self.ep} from dp_shard × cp{' × tp' if self.tp > 1 else ''})" if self.ep > 1 else ""
        # without gpus (one rank's step) dp_shard is only the least that ep borrows from (_mesh_dp)
        spread = ("" if self.gpus is not None or self.dp == 1 else
                  "; one rank: dp_shard the least the ep group borrows, give gpus for the whole mesh")
        return f"mesh {dims}{borrowed}{spread}"

    @property
    def parallel(self) -> bool:
        """Whether the layout spreads the step at all (more than one GPU in its mesh)."""
        return self.dp * self.cp * self.tp * self.pp > 1

    def changed(self) -> dict[str, Any]:
        """The fields set away from their defaults (the mesh's data-parallel sizes only where they differ
        from what ``gpus`` and ``strategy`` give)."""
        out = _changed(self)
        derived = _mesh_dp(self, None, None)
        for name, value in zip(("dp_replicate", "dp_shard"), derived):
            if out.get(name) == value:
                del out[name]
        return out

    def __repr__(self) -> str:
        return f"Layout({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"


SHARDED_STRATEGIES = ("zero1", "zero2", "zero3", "fsdp2")   # each splits state over the data-parallel ranks


def _whole(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a whole number of ranks >= 1, got {value!r}")


def _mesh_dp(lay: Layout, rep: int | None, shard: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of ``lay``'s mesh (``rep``, ``shard``: as given, None to derive), checked against ``gpus`` as torchtitan's
    ``ParallelDims._validate`` does (``dp_replicate × dp_shard × cp × tp × pp == world size``; expert
    parallelism divides ``dp_shard × cp × tp``), each refusal one line with the product. Not given, they
    come from ``gpus`` and ``strategy``: ddp (or none) replicates, ``dp_replicate = gpus / (cp × tp × pp)``;
    fsdp2 and zero* shard, ``dp_shard`` = that. On one GPU (``gpus`` None) an expert-parallel rank's
    group is the smallest that holds it: ``dp_shard = ep / gcd(ep, cp × tp)``."""
    import math
    g = lay.gpus
    _whole("dp_replicate", rep)
    _whole("dp_shard", shard)
    rest = lay.cp * lay.tp * lay.pp
    if g is None:
        if rep is not None or shard is not None:
            raise ValueError("dp_replicate and dp_shard lay out gpus: give gpus too (gpus = dp_replicate × dp_shard "
                             "× cp × tp × pp)")
        return 1, lay.ep // math.gcd(lay.ep, lay.cp * lay.tp)
    if g % rest:
        named = [(k, v) for k, v in (("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp)) if v > 1]
        what = (f"{named[0][0]}={named[0][1]}" if len(named) == 1 else
                f"{' × '.join(k for k, _ in named)} = {' × '.join(str(v) for _, v in named)} = {rest}")
        raise ValueError(f"gpus={g} is not a multiple of {what}: each model replica takes {rest} GPUs (gpus = dp × "
                         f"{' × '.join(k for k, _ in named)}, dp = dp_replicate × dp_shard); give gpus as a multiple "
                         f"of {rest}")
    dp = g // rest
    sharded = lay.strategy in SHARDED_STRATEGIES
    if rep is None and shard is None:
        rep, shard = (1, dp) if sharded else (dp, 1)
    elif rep is None:
        rep = max(1, dp // shard)
    elif shard is None:
        shard = max(1, dp // rep)
    if rep * shard * rest != g:
        raise ValueError(f"gpus={g} is not dp_replicate × dp_shard × cp × tp × pp = {rep} × {shard} × {lay.cp} × "
                         f"{lay.tp} × {lay.pp} = {rep * shard * rest} (torchtitan's ParallelDims)")
    if shard > 1 and not sharded:
        raise ValueError(f"dp_shard {shard} shards each replica's state: give strategy fsdp2 or zero1/2/3 with it "
                         f"({lay.strategy or 'no strategy'} replicates: dp_replicate = gpus / (cp × tp × pp))")
    if rep > 1 and lay.strategy in ("zero1", "zero2", "zero3"):
        raise ValueError(f"dp_replicate {rep} with {lay.strategy}: DeepSpeed's ZeRO splits over every data-parallel "
                         f"rank; hybrid sharding (replicas of shards, HSDP) is fsdp2's")
    if lay.ep > 1:
        if g % lay.ep:
            raise ValueError(f"--ep {lay.ep} does not divide gpus={g}: expert parallelism borrows its ranks from the "
                             f"data-parallel ones (ep divides dp_shard × cp × tp); give gpus as a multiple of {lay.ep}")
        region = shard * lay.cp * lay.tp
        if region % lay.ep:
            why = (f"; {lay.strategy or 'no strategy'} replicates (dp_replicate {rep}), sharding none: use fsdp2 "
                   f"(or zero1/2/3)" if not sharded else "")
            raise ValueError(f"--ep {lay.ep} does not divide the {region} data-parallel ranks"
                             f"{' of each stage' if lay.pp > 1 else ''} it borrows from: dp_shard × cp × tp = {shard} × "
                             f"{lay.cp} × {lay.tp} = {region} (torchtitan's ParallelDims){why}")
    return rep, shard


def check_layout_degrees(r: Any) -> None:
    """Each parallel degree a whole number, and the combinations gpulab measures (``r``: a ``Layout``,
    or the loop's recipe, which carries the same fields)."""
    check_pp_options(r.pp, r.microbatches, r.schedule, r.pp_stage, r.virtual_stages)
    check_tp_options(r.tp, r.sequence_parallel, r.loss_parallel)
    check_cp_ep_options(r.cp, r.ep, r.tp, r.pp)


def check_step_options(r: Any, fp16_autocast: bool) -> None:
    """The step's own options that go together or not (``r``: a ``Recipe``, or the loop's recipe)."""
    if r.grad_scaler and not fp16_autocast:
        raise ValueError("a GradScaler is for fp16 autocast: add amp='fp16' (on the command line: --amp fp16)")
    if not isinstance(r.accumulate, int) or isinstance(r.accumulate, bool) or not 1 <= r.accumulate <= 64:
        raise ValueError(f"accumulate must be a whole number of micro-batches from 1 to 64, got {r.accumulate!r}")
    c = r.clip_grad_norm
    if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf")):
        raise ValueError(f"clip_grad_norm must be a positive number (the largest total norm), got {c!r}")
    if r.compile and r.offload_activations:
        raise ValueError("compile is measured on the model's own forward and loss: leave out offload_activations "
                         "with it (torch.compile would trace save_on_cpu's hooks too, differently)")
    if r.optimizer_in_backward:
        clash = [name for name, on in (("accumulate", r.accumulate > 1), ("clip_grad_norm", c),
                                       ("grad_scaler", r.grad_scaler)) if on]
        if clash:
            raise ValueError(f"optimizer_in_backward steps each parameter as soon as its gradient exists, so "
                             f"it cannot take {', '.join(clash)} (they need every gradient at the end of "
                             f"backward, as torchtune also says): drop one or the other")


def check_together(recipe: Any, layout: Any) -> None:
    """What a recipe cannot do in a layout: FP8, LoRA, a quantized base, compile or offloading with
    tensor parallelism, what a pipeline stage runs itself (its micro-batches), and FSDP2's settings
    without FSDP2 (``check_fsdp_policy``; ``layout`` a ``Layout``: the loop's recipe has no strategy)."""
    if isinstance(layout, Layout):
        check_fsdp_policy(recipe, layout)
    if recipe.fp8 and (recipe.lora or recipe.quantize):
        raise ValueError("fp8 converts the model's own linear layers to torchao's Float8Linear: leave out lora "
                         "and quantize with fp8 (their layers are not plain nn.Linear)")
    if recipe.fp8 and layout.tp > 1:   # torchtitan runs it: apply_tp(enable_float8_tensorwise_tp=...)
        raise ValueError("fp8 with tp is not measured yet: torchao's float8 tensor-parallel styles (Float8ColwiseParallel, "
                         "Float8RowwiseParallel, PrepareFloat8ModuleInput, as torchtitan applies them) are the missing "
                         "piece; leave out tp or fp8")
    if layout.pp > 1:
        clash = [name for name, on in (("accumulate", recipe.accumulate > 1), ("lora", recipe.lora),
                                       ("quantize", recipe.quantize), ("compile", recipe.compile),
                                       ("offload_activations", recipe.offload_activations),
                                       ("chunked_loss", recipe.chunked_loss),
                                       ("optimizer_in_backward", recipe.optimizer_in_backward),
                                       ("grad_scaler", recipe.grad_scaler)) if on]
        if clash:
            missing = {"accumulate": "a pipeline accumulates over its micro-batches: give --microbatches M instead",
                       "compile": "torch.compile of a pipeline stage (torchtitan compiles each stage's blocks) is not "
                                  "measured yet"}
            why = "; ".join(missing[name] for name in clash if name in missing)
            raise ValueError(f"pipeline parallelism is measured on the model's own stages, micro-batches given by "
                             f"--microbatches: leave out {', '.join(clash)} with pp{f' ({why})' if why else ''}")
    if layout.tp > 1 and (recipe.lora or recipe.quantize or recipe.compile or recipe.offload_activations):
        clash = [name for name, on in (("lora", recipe.lora), ("quantize", recipe.quantize), ("compile", recipe.compile),
                                       ("offload_activations", recipe.offload_activations)) if on]
        why = ("; torch.compile of the DTensor program (torchtitan compiles each block after TP) is not measured yet"
               if recipe.compile else "")
        raise ValueError(f"tensor parallelism is measured on the model's own linear layers: leave out "
                         f"{', '.join(clash)} with tp{why}")


_RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))
_LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))


def settings_from(recipe: Recipe | None, layout: Layout | None, flat: dict[str, Any]) -> tuple[Recipe, Layout]:
    """The (Recipe, Layout) a call asks for: ``recipe`` and ``layout`` as given, else built from the
    flat keyword arguments in ``flat`` (a function's own, by name: ``gpulab.fit`` passes its
    ``locals()``; their defaults are the fields' defaults). A flat argument set away from its default
    beside an object that holds another value for the same field is refused: the call would say two
    things. The two are checked together (``check_together``) before anything runs."""
    for obj, cls in ((recipe, Recipe), (layout, Layout)):
        if obj is not None and not isinstance(obj, cls):
            raise ValueError(f"{cls.__name__.lower()} must be a gpulab.{cls.__name__}, got {type(obj).__name__} "
                             f"(build one: gpulab.{cls.__name__}(...))")
    built = []
    for obj, cls in ((recipe, Recipe), (layout, Layout)):
        fields = [f for f in dataclasses.fields(cls) if f.name in flat]
        if obj is None:
            built.append(cls(**{f.name: flat[f.name] for f in fields}))
            continue
        clash = [f.name for f in fields if not _same(flat[f.name], f.default)
                 and not _same(flat[f.name], getattr(obj, f.name))]
        if clash:
            kind = cls.__name__
            raise ValueError(f"{', '.join(clash)} given both as keyword(s) and in the {kind} passed ({obj!r}): say it "
                             f"once, in the {kind} (dataclasses.replace({kind.lower()}, {clash[0]}=...)) or as a "
                             f"keyword without the {kind}")
        built.append(obj)
    check_together(*built)
    return built[0], built[1]


def _same(a: Any, b: Any) -> bool:
    """The same value, of the same type (``True`` is not ``1``)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:   # noqa: BLE001 - a value that cannot compare (an array) is not the same
        return False


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)   # a frozen dataclass keeps the checked, normalized value


def _dtype_name(value: Any) -> str:
    """A model dtype's canonical name ("bfloat16" for "bf16" or ``torch.bfloat16``), without torch."""
    return check_model_dtype_name(str(value))


def _routing(value: Any) -> Any:
    """A routing as the recipe keeps it: None, its text ("capacity:1.25"), exact counts as a tuple of
    tuples, or a ``training.routing.Routing`` as given (the loop builds one from the rest)."""
    if value is None or dataclasses.is_dataclass(value):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(tuple(layer) for layer in value)
    kind, factor = check_routing_text(value)
    return f"capacity:{factor:g}" if kind == "capacity" else kind


def _changed(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) != f.default}


def _repr(obj: Any) -> str:
    """``Recipe(optimizer='adamw', lora=8)``: the fields set away from their defaults, in field order
    (every field is in ``dataclasses.asdict``; the default of each is in the class)."""
    return f"{type(obj).__name__}({', '.join(f'{k}={v!r}' for k, v in _changed(obj).items())})"
