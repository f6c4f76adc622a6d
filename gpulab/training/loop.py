"""The one training loop every tracked step of the library runs.

``train_experiment(workload, batches, dtype, recipe)`` builds a fresh model from a workload and
runs one forward, backward and optimizer step per entry of ``batches``, each part in the
tracker's phase. Where lessons differ, the ``LoopRecipe`` says how:

* ``optimizer`` and ``implementation`` (torch's default, for-loop, foreach or fused: lesson 05);
* ``amp`` (autocast's dtype for the forward) and ``grad_scaler`` (fp16: scale, unscale, step
  through the scaler: lesson 08);
* ``zero_grad``: at the top of every step from the second on (``"top"``: ``gpulab.step``, lesson
  08), the same inside the optimizer phase (``"top, optimizer phase"``: lesson 05, which marks
  the moment after it), or right after ``optimizer.step()`` (``"after step"``: lesson 09's
  replays); ``set_to_none`` (lesson 05 compares both);
* ``accumulate``: micro-batches per optimizer step (gradient accumulation: each backward adds into
  the same gradients, the loss divided by their number); ``clip_grad_norm``: clip the gradients'
  total norm before the step (``torch.nn.utils.clip_grad_norm_``, after unscaling with a
  GradScaler, as PyTorch's AMP recipe does);
* ``optimizer_in_backward``: one optimizer per parameter, stepped (and its gradient dropped) by a
  ``register_post_accumulate_grad_hook`` as soon as backward has accumulated that gradient, as
  torchtune's ``optimizer_in_bwd`` does: at most a few gradients exist at once; no accumulation,
  clipping or GradScaler with it (they need every gradient at the end of backward);
* ``offload_activations``: the forward under activation offloading (``save_on_cpu(pin_memory=True)``'s
  behaviour, through the tracker: ``RunContext.offloading``): what autograd saves is copied to host
  memory, reported apart, and copied back for backward;
* ``chunked_loss``: K > 0 computes a language model's loss K chunks of positions at a time, the
  output head included (torchtune's ``CEWithChunkedOutputLoss``: ``training.chunked_loss``);
* ``use_cache``: None runs a language model as its config says (transformers builds its KV cache
  in a training forward too when ``config.use_cache`` is true, the default of most configs);
  False passes ``use_cache=False`` to every forward (the lever that turns it off);
* ``compile``: the model under ``torch.compile`` with inductor's own front end (``compile_fx``: its
  decompositions, joint-graph passes and min-cut partitioner choose the forward and backward graphs
  and what is saved for backward) and no code generation (``training.inductor_plan``): each graph is
  lowered and scheduled as inductor would for the run's device (CUDA on the fake engine's CUDA
  target), and its buffers read in its kernels' order (``InductorPlans``: the experiment returns them
  as ``inductor``); the measured steps run the same graphs op by op, so the tracker's peak is the
  upper bound where every intermediate is allocated, and ``inductor_step_peaks`` puts inductor's
  plan in each compiled call's place. The capture and first run at each batch size happen with the
  tracker paused (a warm-up). Inside the compiled region ops are attributed to the whole model. With
  ``chunked_loss`` (torchtune compiles both) the chunked loss function is compiled whole: the
  body, the head chunk by chunk and each chunk's cross-entropy, one graph partitioned as one
  (``recipe_loss``);
* ``checkpointing``: the model's own activation checkpointing (transformers' gradient checkpointing)
  under a policy (``models.adapt``): "full" (each block recomputed in backward from its saved
  input), "selective" (matmul and attention outputs kept, the rest recomputed), "torchtitan-op"
  (torchtitan's op-level SAC: every other matmul recomputed) or "every-K"; ``lora`` (a rank) and ``lora_targets``:
  peft's LoRA adapters on a frozen base, only they trained, ``lora_dropout`` on their inputs;
  ``lora_dtype``: the adapters in fp32 (peft's default) or in the model's dtype ("base", torchtune's);
  ``quantize``: the base's linear layers stored as bitsandbytes stores them, "nf4" (with LoRA:
  QLoRA), "fp4" (``Linear4bit``'s own default type) or "int8" (``models.adapt``,
  ``models.quantized``), 4-bit with or without ``double_quant`` and computing in
  ``quant_compute_dtype`` ("fp32", transformers' default, "bf16" or "fp16"; "input": the input's dtype);
* ``routing``: a mixture of experts' routing, a named assumption (``training.routing``: None or
  "balanced", "capacity:F", "worst", exact counts): the experts run on that many token rows each,
  static shapes a fake run can follow; refused for a model without routed experts;
* ``fp8``: None, "tensorwise" or "rowwise": the model's linear layers (not the output head, nor one
  whose dims do not divide by 16, as torchtitan) swapped for torchao's ``Float8Linear`` right after
  the model is built (``training.fp8``): each matmul casts its input and weight to float8 with
  their scales, and backward casts again;
* ``param_dtype``, ``reduce_dtype``, ``fp8_all_gather``: FSDP2's settings, carried for
  ``predict.sharding`` (the loop runs one GPU's step; ``gpulab.fit`` runs it in ``param_dtype``);
* ``cp`` / ``ep``: one rank of a context-parallel group (its sequence shard: ``training.context_parallel``)
  or of an expert-parallel group (its experts, tokens dispatched by all-to-all on the fake process
  group: ``training.expert_parallel``);
* ``fresh_batch``: a new batch every step, dropped right after backward (lesson 09's replays,
  whose batch size changes from step to step), or one batch kept while the size stays;
* ``seed``, ``register_model`` (label the model before the optimizer exists), ``teardown`` (free
  everything in a phase of its own at the end, so the optimizer's frees are not read as the
  step's: lesson 05).

The experiment returns ``step_marks`` (the tracker's event count at the start of each step and
at the end, so each step's own peak can be read off the timeline), ``n_param_tensors``, and what
``report(ctx, net, optimizer, scaler)`` adds. ``moment(ctx, name)`` is called at named points ("after
setup", "after zero_grad i", "before step i", "after step i", counting steps from 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from gpulab.measure.engines import Measurement, RunContext
from gpulab.measure.fake_mode import scalars_read_as_one
from gpulab.options import (Layout, Recipe, check_layout_degrees, check_mixed_precision, check_precision_policy,
                            check_step_options, check_together)
from gpulab.models.adapt import adapted, check_checkpointing, check_lora
from gpulab.models.quantized import COMPUTE_DTYPES, FOUR_BIT
from gpulab.models.registry import ModelSpec
from gpulab.models.workload import Workload, forward, image_workload
from gpulab.training.chunked_loss import check_chunks, chunked_lm_loss
from gpulab.training.context_parallel import check_context_parallel, sequence_shard
from gpulab.training.expert_parallel import (check_expert_parallel, expert_shard_workload, install_expert_parallel,
                                             total_experts)
from gpulab.training.inductor_plan import InductorPlans, planned_peak
from gpulab.training.fp8 import check_fp8, check_fp8_for, check_fp8_workload, fp8_convert
from gpulab.training.optimizers import build_optimizer, check_implementation, check_optimizer, make_optimizer
from gpulab.training.pipeline import check_pipeline, pipeline_stage, run_in_flight, stage_step
from gpulab.training.routing import Routing, install_routing, is_moe, parse_routing
from gpulab.training.moe_parallel import check_moe_tensor_parallel, moe_blocks, moe_tensor_parallel, tp_ep_meshes
from gpulab.training.tensor_parallel import (check_tensor_parallel, fake_world, loss_parallel_context, materialize_shards,
                                             tensor_parallel)

__all__ = ["AMP_DTYPES", "RECIPE_DEFAULTS", "ZERO_GRAD", "LoopRecipe", "inductor_step_peaks", "loop_recipe", "step_experiment",
           "step_peaks", "train_experiment",
           "changed_options", "check_recipe_for", "recipe_loss", "user_recipe"]

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ZERO_GRAD = ("top", "top, optimizer phase", "after step")


@dataclass(frozen=True)
class LoopRecipe:
    """How the loop runs each step (see the module docstring); the defaults are ``gpulab.step``'s."""
    optimizer: str = "sgd"
    implementation: str = "default"
    amp: torch.dtype | None = None
    grad_scaler: bool = False
    zero_grad: str = "top"
    set_to_none: bool = True
    fresh_batch: bool = False
    seed: int | None = None
    register_model: bool = False
    teardown: bool = False
    accumulate: int = 1
    clip_grad_norm: float | None = None
    optimizer_in_backward: bool = False
    offload_activations: bool = False
    chunked_loss: int = 0
    use_cache: bool | None = None
    compile: bool = False
    checkpointing: bool | str = False   # False or a policy (models.adapt.check_checkpointing)
    lora: int = 0
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = 0.0
    quantize: str | None = None
    lora_dtype: str = "fp32"
    double_quant: bool = True
    quant_compute_dtype: str = "input"
    routing: Routing | str | None = None   # None: balanced where the model has routed experts
    tp: int = 1                          # tensor-parallel ranks (training.tensor_parallel: a fake process group)
    sequence_parallel: bool = False      # with tp: the norms and the residual stream on a sequence shard
    loss_parallel: bool = False          # with tp: the logits and the cross-entropy sharded on the vocabulary
    cp: int = 1                          # context-parallel ranks: the run is one rank's sequence shard (training.context_parallel)
    ep: int = 1                          # expert-parallel ranks: the run holds E/ep experts (training.expert_parallel)
    pp: int = 1                          # pipeline stages (training.pipeline): the run is one stage's
    microbatches: int | None = None      # with pp: micro-batches per step (None: pp)
    schedule: str = "1f1b"               # with pp: "1f1b", "gpipe" or "interleaved" (how many micro-batches a stage holds)
    virtual_stages: int = 1              # with the interleaved schedule: model chunks per rank (Megatron's virtual pipeline size)
    pp_stage: int = 0                    # with pp: the stage this run measures (gpulab.fit runs each that differs)
    fp8: str | None = None               # torchao's float8 training recipe: "tensorwise" or "rowwise"
    # FSDP2's settings (options.check_fsdp_policy: fsdp2 only): the loop runs one GPU's step in the model's
    # dtype; predict.sharding makes one rank's bytes of them (fit runs the step in param_dtype)
    fp8_all_gather: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self):
        # the same checks as the public Recipe and Layout (gpulab.options), on the fields the loop shares
        check_chunks(self.chunked_loss)
        object.__setattr__(self, "fp8", check_fp8(self.fp8))
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, check_mixed_precision(name, getattr(self, name)))
        check_precision_policy(self)
        check_layout_degrees(self)
        check_together(self, self)
        if self.pp > 1 and self.microbatches is None:   # a pipeline's default: one micro-batch per stage
            object.__setattr__(self, "microbatches", self.pp)
        object.__setattr__(self, "routing", parse_routing(self.routing))
        object.__setattr__(self, "checkpointing", check_checkpointing(self.checkpointing))
        object.__setattr__(self, "optimizer", check_optimizer(self.optimizer, recipes=True))
        object.__setattr__(self, "implementation", check_implementation(self.implementation))
        if self.zero_grad not in ZERO_GRAD:
            raise ValueError(f"zero_grad must be one of {', '.join(ZERO_GRAD)}, got {self.zero_grad!r}")
        check_step_options(self, fp16_autocast=self.amp == torch.float16)


def _loop_options() -> dict[str, Any]:
    """The recipe options gpulab.step, gpulab.fit and the CLI take, and their defaults: the fields of
    the public ``Recipe`` and ``Layout`` that the loop's recipe carries too, read off the dataclasses
    (``optimizer`` and ``amp`` are named apart; ``dtype`` and the layout's GPUs are not the loop's), in
    the dataclasses' order (the order an answer lists the options it changed in)."""
    loop = {f.name for f in dataclasses.fields(LoopRecipe)} - {"optimizer", "amp"}
    return {f.name: f.default for cls in (Recipe, Layout) for f in dataclasses.fields(cls) if f.name in loop}


RECIPE_DEFAULTS = _loop_options()


def user_recipe(optimizer: str, amp: str | None = None, **options: Any) -> LoopRecipe:
    """The loop's recipe of ``gpulab.step`` / ``gpulab.fit`` from their flat arguments (``amp``: "fp16",
    "bf16" or None; ``options``: any of ``RECIPE_DEFAULTS``, the rest keep their defaults), through the
    public ``Recipe`` and ``Layout`` (``gpulab.options``), which check them: bad values raise
    ``ValueError`` saying what is allowed."""
    unknown = sorted(set(options) - set(RECIPE_DEFAULTS))
    if unknown:
        raise TypeError(f"user_recipe() got unexpected option(s) {', '.join(unknown)}; valid: {', '.join(RECIPE_DEFAULTS)}")
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
    recipe = Recipe(optimizer, amp=amp, **{k: v for k, v in options.items() if k in recipe_fields})
    layout = Layout(**{k: v for k, v in options.items() if k not in recipe_fields})
    check_together(recipe, layout)
    return loop_recipe(recipe, layout)


def loop_recipe(recipe: Recipe, layout: Layout) -> LoopRecipe:
    """How the loop runs the step a public ``Recipe`` describes in a ``Layout`` (both checked when
    made; ``check_together`` says what they cannot do together). ``recipe.dtype`` is the model's,
    which the loop takes apart (``train_experiment``'s ``dtype``); the layout's GPUs and strategy are
    ``predict.sharding``'s: the loop runs one rank."""
    check_together(recipe, layout)
    return LoopRecipe(recipe.optimizer, implementation=recipe.implementation,
                      amp=AMP_DTYPES[recipe.amp] if recipe.amp else None, grad_scaler=recipe.grad_scaler,
                      set_to_none=recipe.set_to_none, accumulate=recipe.accumulate,
                      clip_grad_norm=recipe.clip_grad_norm, optimizer_in_backward=recipe.optimizer_in_backward,
                      offload_activations=recipe.offload_activations, chunked_loss=recipe.chunked_loss,
                      use_cache=recipe.use_cache, compile=recipe.compile, checkpointing=recipe.checkpointing,
                      lora=recipe.lora, lora_targets=recipe.lora_targets, lora_dropout=recipe.lora_dropout,
                      quantize=recipe.quantize, lora_dtype=recipe.lora_dtype, double_quant=recipe.double_quant,
                      quant_compute_dtype=recipe.quant_compute_dtype, routing=recipe.routing, fp8=recipe.fp8,
                      fp8_all_gather=recipe.fp8_all_gather, param_dtype=recipe.param_dtype,
                      reduce_dtype=recipe.reduce_dtype,
                      tp=layout.tp, sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel,
                      cp=layout.cp, ep=layout.ep,
                      pp=layout.pp, microbatches=layout.microbatches, schedule=layout.schedule,
                      virtual_stages=layout.virtual_stages, pp_stage=layout.pp_stage)


def check_recipe_for(r: LoopRecipe, w: Workload, dtype: torch.dtype | None = None) -> None:
    """Refuse, before anything runs, a recipe this workload cannot take in ``dtype`` (ValueError saying why)."""
    if r.fp8:   # torchao's float8 linear layers: a model or dtype they cannot train (built on meta: free)
        check_fp8_workload(w, dtype)
    for name, on in (("chunked_loss", r.chunked_loss), ("use_cache", r.use_cache is not None)):
        if on and w.kind != "tokens":
            raise ValueError(f"{name} is for language models (an hf: model or a transformers config); {w.name} "
                             f"is a {w.kind} model: leave {name} out")
    if r.checkpointing and w.kind == "image":
        raise ValueError(f"checkpointing turns on a transformers model's own gradient checkpointing; {w.name} is an "
                         f"image model (lesson 07 checkpoints one by hand): leave checkpointing out")
    if r.quantize and w.kind == "image":
        raise ValueError(f"quantize stores a transformer's linear layers as bitsandbytes does; {w.name} is an image "
                         f"model: leave quantize out")
    if r.lora and w.kind == "image":
        raise ValueError(f"LoRA adapts a transformer's linear layers; {w.name} is an image model: leave lora out")
    if r.routing is not None and (w.kind == "image" or w.config is not None and not is_moe(w.config)):
        raise ValueError(f"routing is a mixture of experts' assumption; {w.name} has no routed experts: leave routing out")
    if r.tp > 1:
        check_tensor_parallel(w.config, r.tp, r.sequence_parallel, r.loss_parallel)
    if r.pp > 1:
        check_pipeline(w.config if w.kind == "tokens" else None, r.pp, r.virtual_stages)
    if r.cp > 1:
        check_context_parallel(w, r.cp, r.tp, r.sequence_parallel)
    if r.ep > 1:
        check_expert_parallel(w.config, r.ep, r.routing)
    if r.tp > 1 and w.kind == "tokens" and is_moe(w.config):
        check_moe_tensor_parallel(w, r.tp, r.cp, r.ep)
    if r.chunked_loss and w.facts.task != "causal-lm":   # read once, when the model was resolved
        raise ValueError(f"chunked_loss splits a causal language model's head from its body; {w.name} is trained "
                         f"as a {w.facts.task}: leave chunked_loss out")
    if r.lora:   # targets and rank against the model's own linear layers (built on meta), before any run
        check_lora(w, r.lora, r.lora_targets)


def recipe_workload(w: Workload, r: LoopRecipe) -> Workload:
    """The model ``r`` trains: ``w`` checkpointed and/or with LoRA adapters when ``r`` asks
    (``models.adapt.adapted``). ``train_experiment`` builds through it; a caller that reads the
    model's shapes (``predict.breakdown``) uses it too. With cp or ep: one rank's (its sequence
    shard; its share of the experts)."""
    w = expert_shard_workload(sequence_shard(w, r.cp), r.ep)
    return adapted(w, lora=r.lora, lora_targets=r.lora_targets, lora_dropout=r.lora_dropout,
                   checkpointing=r.checkpointing, quantize=r.quantize, lora_dtype=r.lora_dtype,
                   double_quant=r.double_quant, quant_compute_dtype=COMPUTE_DTYPES.get(r.quant_compute_dtype))


def changed_options(r: LoopRecipe) -> dict[str, Any]:
    """The user-facing options ``r`` sets away from their defaults (empty for the plain loop), and
    the choices an answer depends on whenever their option is on, defaults included: LoRA's
    ``lora_dtype``, a 4-bit base's ``double_quant`` and ``quant_compute_dtype``."""
    shown = {k: getattr(r, k) for k, v in RECIPE_DEFAULTS.items() if getattr(r, k) != v}
    if r.routing is not None:
        shown["routing"] = r.routing.text
    if r.pp > 1:   # a pipeline's answer always names its schedule and micro-batches
        shown.update(schedule=r.schedule, microbatches=r.microbatches)
        if r.schedule == "interleaved":
            shown["virtual_stages"] = r.virtual_stages
    if r.lora:
        shown["lora_dtype"] = r.lora_dtype
    if r.quantize in FOUR_BIT:
        shown.update(double_quant=r.double_quant, quant_compute_dtype=r.quant_compute_dtype)
    return shown


def train_experiment(w: Workload, batches: Sequence[int], dtype: torch.dtype | None, recipe: LoopRecipe = LoopRecipe(), *,
                     moment: Callable[[RunContext, str], None] | None = None,
                     report: Callable[[RunContext, torch.nn.Module, torch.optim.Optimizer, Any], dict[str, Any]]
                     | None = None):
    """The experiment ``engines.run`` calls: a fresh model from ``w`` in ``dtype``, then one
    training step per entry of ``batches`` as ``recipe`` says."""
    r = recipe
    w = recipe_workload(w, r)
    moment = moment or (lambda ctx, name: None)

    def experiment(ctx: RunContext) -> dict[str, Any]:
        return _in_layout(r, ctx, steps)

    def steps(ctx: RunContext, parallel: Callable[[torch.nn.Module], torch.nn.Module]) -> dict[str, Any]:
        with ctx.phase("setup"):
            if r.seed is not None:
                torch.manual_seed(r.seed)
            net = _rank_model(w, r, ctx.device, dtype, parallel)
            if r.register_model or r.compile:   # compile: the tracker's parameter hooks exist before dynamo guards
                ctx.tracker.register(net)
            plans = _plans(ctx) if r.compile else None
            step_loss = recipe_loss(w, r, net, plans) if r.pp == 1 else stage_step(net, w.config.hidden_size, r)
            opt = _optimizers(r, net, ctx.engine == "fake")
        scaler = torch.amp.GradScaler(ctx.device.type) if r.grad_scaler else None
        data, data_batch, marks, warmed = None, None, [], None
        for i, b in enumerate(batches):
            if b != data_batch:
                data = None
                with ctx.phase("setup"), torch.device(ctx.device):
                    data = w.inputs(b, dtype)
                    for t in [*data[0], *data[1].values()]:   # t keeps the last input (the labels) alive
                        if isinstance(t, torch.Tensor):
                            ctx.label(t)
                data_batch = b
            if r.compile and b != warmed:   # capture and compile at this batch size, unrecorded
                warmed = _warm_up(ctx, step_loss, net, data, r, b)
            if i == 0:
                moment(ctx, "after setup")
            marks.append(ctx.mark())
            if i and r.zero_grad != "after step" and not r.optimizer_in_backward:
                with ctx.phase("optimizer") if r.zero_grad == "top, optimizer phase" else contextlib.nullcontext():
                    opt.zero_grad(set_to_none=r.set_to_none)
                moment(ctx, f"after zero_grad {i}")
            run_in_flight(ctx, step_loss, data, r)   # a pipeline stage's micro-batches in flight (none without)
            for _ in range(r.accumulate if r.pp == 1 else 0):   # micro-batches: each backward adds into the gradients
                with ctx.phase("forward"), _autocast(ctx.device, r.amp), \
                        ctx.offloading() if r.offload_activations else contextlib.nullcontext(), \
                        ctx.tracker.without_module_hooks() if r.compile else contextlib.nullcontext():
                    loss = step_loss(data)
                    if r.accumulate > 1:
                        loss = loss / r.accumulate
                with ctx.phase("backward"):
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                del loss
            if r.fresh_batch:   # this batch goes now, in the order it was made: the inputs, then the labels
                data, t, data_batch = None, None, None
            moment(ctx, f"before step {i + 1}")
            with ctx.phase("optimizer"):
                if not r.optimizer_in_backward:   # (in backward: done, parameter by parameter)
                    _optimizer_step(ctx, net, opt, scaler, r.clip_grad_norm)
                    if r.zero_grad == "after step":
                        opt.zero_grad(set_to_none=r.set_to_none)
            moment(ctx, f"after step {i + 1}")
        marks.append(ctx.mark())
        ctx.snapshot("after step")
        out = {"n_param_tensors": sum(1 for _ in net.parameters()), "step_marks": marks} \
            | ({"inductor": plans} if plans is not None else {})
        if report is not None:
            out.update(report(ctx, net, opt, scaler))
        if r.teardown:   # the run's end frees everything: not the optimizer's doing
            with ctx.phase("teardown"):
                data, t = None, None
                del opt, net, step_loss   # step_loss holds the model too
        return out
    return experiment


def _rank_model(w: Workload, r: LoopRecipe, device: torch.device, dtype: torch.dtype | None,
                parallel: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """This rank's model: ``w`` built in ``dtype``, fp8-converted, cut to its pipeline stage, split by
    ``parallel`` and run under its routing assumption. Under tensor parallelism (the fake engine only:
    ``_in_layout``) it is built on meta and split there, then only the rank's shards get storage, as
    torchtitan does (meta, parallelize, to_empty)."""
    net = w.build(torch.device("meta") if r.tp > 1 else device, dtype)
    if r.fp8:   # torchao's Float8Linear in place of the linear layers, before anything reads them
        check_fp8_for(net, dtype, w.name)
        fp8_convert(net, r.fp8)
    net = parallel(pipeline_stage(net, r.pp, r.pp_stage))
    if r.tp > 1:
        net = materialize_shards(net, device)
    _assume_routing(net, w, r)
    return net


def _assume_routing(net: torch.nn.Module, w: Workload, r: LoopRecipe) -> None:
    """A mixture of experts runs under its routing assumption (``training.routing``); a model
    without routed experts refuses an explicit one."""
    if install_routing(net, r.routing) is None and r.routing is not None:
        raise ValueError(f"routing is a mixture of experts' assumption; {w.name} has no routed experts: "
                         f"leave routing out")
    if r.ep > 1:   # rank 0 of the expert-parallel group: its experts, tokens dispatched by all-to-all
        install_expert_parallel(net, r.ep, total_experts(w.config), r.routing)


def _in_layout(r: LoopRecipe, ctx: RunContext, steps: Callable) -> dict[str, Any]:
    """``steps(ctx, parallel)`` on one device, or as rank 0 of ``r.tp`` tensor-parallel ranks in a fake
    process group (``parallel`` splits the model built; every rank of the group is alike)."""
    if r.tp == 1 and r.ep == 1:
        return steps(ctx, lambda net: net)
    if ctx.engine != "fake":
        raise ValueError("tensor and expert parallelism are measured on the fake engine, in PyTorch's fake process group "
                         "(training.tensor_parallel): use engine='fake'")
    if r.tp == 1:   # expert parallelism alone: the world is the ep group
        with fake_world(r.ep):
            return steps(ctx, lambda net: net)
    # rank 0 of a tp group and of an ep group
    with fake_world(math.lcm(r.tp, r.ep)) as world, loss_parallel_context(r.loss_parallel):
        tp_mesh, ep_mesh = tp_ep_meshes(world, r.tp, r.ep)

        def parallel(net: torch.nn.Module) -> torch.nn.Module:
            apply_tp = functools.partial(tensor_parallel, mesh=tp_mesh, sequence_parallel=r.sequence_parallel,
                                         loss_parallel=r.loss_parallel)
            if not moe_blocks(net):
                return apply_tp(net)
            return moe_tensor_parallel(net, tp_mesh, ep_mesh, r.sequence_parallel, apply_tp)
        return steps(ctx, parallel)


class _InBackward:
    """Optimizer-in-backward (torchtune's ``optimizer_in_bwd``): one optimizer per parameter, each
    stepped by the parameter's post-accumulate-grad hook, its gradient dropped (or zeroed) right
    after; ``state`` gathers theirs (what the tracker and reports read)."""

    def __init__(self, r: LoopRecipe, params: list[torch.nn.Parameter], fake: bool):
        self.per_param = {p: _one_optimizer(r, [p]) for p in params}
        self.set_to_none, self.fake = r.set_to_none, fake
        me = weakref.ref(self)   # the parameters' hooks must not keep their optimizers alive (a cycle)
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(_step_in_backward, me))
                        for p in params]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.per_param.values() for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.per_param.values():
            opt.zero_grad(set_to_none=set_to_none)

    def __del__(self) -> None:
        for h in getattr(self, "handles", ()):
            h.remove()


def _step_in_backward(owner: "weakref.ref[_InBackward]", p: torch.nn.Parameter) -> None:
    """A parameter's gradient is complete: step its optimizer, then drop (or zero) the gradient."""
    me = owner()
    if me is not None:
        opt = me.per_param[p]
        with _reads_answered(me.fake):
            opt.step()
        opt.zero_grad(set_to_none=me.set_to_none)


def _one_optimizer(r: LoopRecipe, params: list) -> torch.optim.Optimizer:
    if r.implementation == "default":
        return make_optimizer(r.optimizer, params)
    return build_optimizer(r.optimizer, params, r.implementation)


def _optimizers(r: LoopRecipe, net: torch.nn.Module, fake: bool):
    """The run's optimizer over the trainable parameters (no name kept for the list: teardown
    frees the model), or one per parameter, stepped in backward."""
    params = [p for p in net.parameters() if p.requires_grad]
    return _InBackward(r, params, fake) if r.optimizer_in_backward else _one_optimizer(r, params)


def recipe_loss(w: Workload, r: LoopRecipe, net: torch.nn.Module,
                plans: InductorPlans | None = None) -> Callable[[Any], torch.Tensor]:
    """What the loop's forward phase runs on one batch: ``data -> loss``. The model's own forward
    and ``w.loss``, or ``chunked_lm_loss`` in ``r.chunked_loss`` chunks; with ``r.compile`` the
    model, or with a chunked loss the whole chunked function (body, head chunk by chunk and
    cross-entropy: one graph that AOTAutograd partitions), under ``torch.compile``, each graph's
    plan kept in ``plans`` (none given: planned for the model's own device)."""
    if r.compile and plans is None:
        plans = InductorPlans(next(net.parameters()).device.type)
    if r.chunked_loss:
        chunked = _compiled(chunked_lm_loss, plans) if r.compile else chunked_lm_loss
        return lambda data: chunked(net, _forward_options(data, r), r.chunked_loss)
    run_net = _compiled(net, plans) if r.compile else net

    def own_loss(data):
        output = forward(run_net, _forward_options(data, r))
        loss = w.loss(output, data)
        del output
        return loss
    return own_loss


def _compiled(fn: Callable, plans: InductorPlans) -> Callable:
    """``fn`` (the model, or the chunked loss) under ``torch.compile`` with inductor's front end and
    its plans instead of code (``plans.backend()``); dynamo's caches emptied first (each run builds a
    fresh model, and dynamo would count every one as a recompile of the same code, then fall back to
    eager after its limit)."""
    torch._dynamo.reset()
    return torch.compile(fn, backend=plans.backend())


def _plans(ctx: RunContext) -> InductorPlans:
    """Where this run's compiled graphs are planned: CUDA when it follows CUDA's kernels (the card's
    compute capability: ``measure.cuda_card.current_target``), else its own device."""
    from gpulab.measure.cuda_card import current_target
    if ctx.kernels == "cuda":
        return InductorPlans("cuda", current_target().rules, ctx.mark)
    return InductorPlans(ctx.device.type, mark=ctx.mark)


def inductor_step_peaks(m: Measurement) -> list[int]:
    """With ``compile``: each training step's peak with inductor's plan in each compiled call's place
    (``training.inductor_plan.planned_peak``); [] without."""
    value = m.value if isinstance(m.value, dict) else {}
    plans, marks = value.get("inductor"), value.get("step_marks")
    if plans is None or not marks or m.tracking is None or m.oom:
        return []
    t = m.tracking
    totals = [sum(s.values()) for s in t.series]
    return [planned_peak(t.events, totals, plans, t.rounded, a, b) for a, b in zip(marks, marks[1:])]


def _warm_up(ctx: RunContext, step_loss: Callable[[Any], torch.Tensor], net: torch.nn.Module, data,
             r: LoopRecipe, batch: int) -> int:
    """One forward and backward of the compiled model with the tracker paused (dynamo captures,
    AOTAutograd partitions), then the gradients dropped: the measured steps run the compiled graphs.
    Returns ``batch``, the size now compiled for."""
    with ctx.tracker.paused():
        with _autocast(ctx.device, r.amp):
            loss = step_loss(data)
        loss.backward()
        del loss
        net.zero_grad(set_to_none=True)
    return batch


def _forward_options(data, r: LoopRecipe):
    """The batch as the forward gets it: with ``use_cache`` when the recipe sets it (no name may
    keep the batch alive past the step: a fresh batch is freed right after backward)."""
    return data if r.use_cache is None else (data[0], {**data[1], "use_cache": r.use_cache})


def _reads_answered(fake: bool):
    """On the fake engine an optimizer's reads of values (Adafactor's norms) answer 1: they steer
    its arithmetic, not what it allocates (``measure.fake_mode.scalars_read_as_one``)."""
    return scalars_read_as_one() if fake else contextlib.nullcontext()


def _optimizer_step(ctx: RunContext, net: torch.nn.Module, opt: torch.optim.Optimizer, scaler,
                    clip: float | None) -> None:
    if scaler is None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        with _reads_answered(ctx.engine == "fake"):
            opt.step()
        return
    scaler.unscale_(opt)
    if clip is not None:   # on unscaled gradients (PyTorch's AMP examples: unscale_, clip, step)
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    if ctx.engine == "fake":   # GradScaler.step reads found_inf with .item(): it needs real values
        with _reads_answered(True):
            opt.step()
    else:
        scaler.step(opt)
    scaler.update()


def step_experiment(spec: ModelSpec, batch: int, image_size: int, optimizer: str, dtype: torch.dtype,
                    steps: int = 1):
    """``steps`` training steps of a registered image model at one batch size."""
    return train_experiment(image_workload(spec, image_size), [batch] * steps, dtype, LoopRecipe(optimizer))


def _autocast(device: torch.device, amp: torch.dtype | None):
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp)


def step_peaks(m: Measurement) -> list[int]:
    """Each training step's own peak, from the step marks the experiment returned."""
    marks = (m.value or {}).get("step_marks") if isinstance(m.value, dict) else None
    if not marks or m.tracking is None or m.oom:
        return []
    return [m.tracking.peak_between(a, b)[0] for a, b in zip(marks, marks[1:])]
