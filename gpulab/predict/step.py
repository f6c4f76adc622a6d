"""``gpulab.step(model, ...)``: the memory of training *any* model, by category.

The model may be a registered name, a transformer config, your ``nn.Module`` or a function
that builds one (``gpulab.models.workload``). The default is the steady state: two training steps,
since the optimizer state exists from the first ``step()`` on and every later step holds it;
each step's own peak is reported (``StepResult.step_peaks``), the first beside the last.

A real run (cpu or cuda engine) is first predicted on the fake engine and refused, with the
numbers, when it would not fit in the memory that run may use (``gpulab.predict.guard``).

``cp``, ``ep``: the step of rank 0 of a context- / expert-parallel group, its layout and buffers
in the result's ``recipe`` and label (``training.context_parallel.layout_notes``).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from gpulab.measure.engines import (FAKE_TARGETS, LABEL_FORMULA, Measured, Measurement, choose_engine, run,
                               validate_fake_target)
from gpulab.models.workload import Workload, resolve_workload, step_failed
from gpulab.training.loop import (changed_options, check_recipe_for, inductor_step_peaks, loop_recipe, recipe_workload,
                                  step_peaks, train_experiment)
from gpulab.training.context_parallel import layout_notes
from gpulab.training.tensor_parallel import tp_notes
from gpulab.training.routing import Routing, is_moe, ran_routed, stated_routing
from gpulab.units import dtype_name, model_dtype
from gpulab.predict.breakdown import breakdown, predict_step, validate_batch
from gpulab.predict.cards import follows_card
from gpulab.predict.card_speeds import CardSpeed, speed_of
from gpulab.predict.timing import StepTime, step_time_of, timed_experiment, with_host_copies
from gpulab.predict.layer_pattern import workload_with_depth
from gpulab.predict.guard import check_fits
from gpulab.predict.workspaces import NOT_PREDICTED, recorded_cudnn_workspace
from gpulab.options import MAX_STEPS, Layout, Recipe, settings_from   # torch-free: the CLI checks them first

__all__ = ["DEFAULT_STEPS", "MAX_STEPS", "NOT_PREDICTED", "StepResult", "step"]

DEFAULT_STEPS = 2


@follows_card(positional=False)   # gpu=: the fake CUDA target follows that card's kernels
def step(model: Any, inputs: Any = None, *, recipe: Recipe | None = None, layout: Layout | None = None,
         batch: int | None = None, input_shape: tuple[int, ...] | None = None,
         optimizer: str = "adam", steps: int = DEFAULT_STEPS, engine: str = "auto", dtype: str | torch.dtype | None = None,
         amp: str | None = None, loss: Callable | None = None, seq_len: int | None = None,
         image_size: int | None = None, fake_target: str = "cuda", guard: bool = True,
         accumulate: int = 1, clip_grad_norm: float | None = None, grad_scaler: bool = False,
         set_to_none: bool = True, optimizer_in_backward: bool = False, offload_activations: bool = False,
         chunked_loss: int = 0, use_cache: bool | None = None, compile: bool = False,
         implementation: str = "default", checkpointing: bool | str = False, lora: int = 0,
         lora_targets: Sequence[str] | None = None, lora_dropout: float = 0.0, quantize: str | None = None,
         lora_dtype: str = "fp32", double_quant: bool = True, quant_compute_dtype: str = "input", gpu: Any = None,
         routing: Any = None, tp: int = 1, sequence_parallel: bool = False, loss_parallel: bool = False,
         fp8: str | None = None,
         pp: int = 1, microbatches: int | None = None, schedule: str = "1f1b", pp_stage: int = 0,
         virtual_stages: int = 1, cp: int = 1, ep: int = 1, time: Any = False, **engine_limits) -> StepResult:
    """Track ``steps`` training steps of ``model``, by category, beside the formulas' prediction
    (the module docstring says what ``model``, ``inputs`` and ``loss`` may be).

    ``dtype``: the model's (and a float input's) dtype, e.g. "bf16" for pure bf16 training; None keeps float32.
    ``amp``: "fp16" or "bf16" runs the forward under ``torch.autocast``. ``fake_target``: on the fake engine, follow
    CUDA's kernels ("cuda", the default) or this CPU's. The recipe: ``accumulate`` micro-batches of ``batch`` per
    optimizer step (gradient accumulation), ``clip_grad_norm`` (clip the gradients' total norm to it before the step),
    ``grad_scaler`` (fp16 autocast's GradScaler), ``set_to_none=False`` (``zero_grad`` keeps the gradients, zeroed,
    between steps), ``optimizer_in_backward`` (each parameter stepped as soon as its gradient exists),
    ``offload_activations`` (saved activations in host memory: the result's ``offloaded_peak_bytes``, apart from the
    device's), ``chunked_loss=K`` (a language model's head and loss K chunks of positions at a time, torchtune's way),
    ``use_cache=False`` (a language model's forward without its KV cache; None: as its config says), ``compile`` (the
    model under torch.compile: inductor's partition and memory plan, no code generated, in ``compiled`` beside
    the op-by-op run of the same graphs, the upper bound that ``peak_bytes`` is), ``implementation`` (the optimizer's:
    "default", "for-loop", "foreach" or "fused"), ``checkpointing`` (a transformers model's own gradient checkpointing:
    True or "full", "selective", "torchtitan-op" or "every-K", as ``models.adapt`` says), ``lora=R`` with ``lora_targets`` (peft's LoRA
    adapters of rank R on a frozen base; None: peft's default layers for the model type; ``lora_dropout`` on the
    adapters' inputs; ``lora_dtype``: "fp32" as peft, "base" as torchtune), ``quantize`` ("nf4", "fp4" or "int8", the
    base as bitsandbytes stores it; ``double_quant``, ``quant_compute_dtype``: ``training.loop``; ``recipe`` names
    them). ``routing``: an MoE's routing, stated in the answer (``training.routing``). ``guard``: refuse a cpu/cuda run the fake engine predicts would not fit (ValueError). ``gpu``: the fake CUDA target's card (``predict.cards.follows_card``). ``fp8``: "tensorwise" or "rowwise", the linear layers as torchao's float8 training converts them (``training.fp8``).
    ``recipe``, ``layout`` (``gpulab.Recipe``, ``gpulab.Layout``: one GPU's) or the flat keywords that build
    them; the result carries them. With ``gpu``, cuDNN workspaces recorded on that card (``predict.workspaces``).
    ``time``: True (with ``gpu``) or a ``CardSpeed`` predicts the step's time on the fake engine too: ``result.time``,
    a ``StepTime`` (``predict.timing``; the card's speeds: ``predict.card_speeds``).
    Bad input raises ``ValueError`` with what to do instead."""
    if batch is not None:
        validate_batch(batch)
    _check_steps(steps)
    asked, layout = _one_gpu(*settings_from(recipe, layout, locals()))   # each checked once, then passed whole
    w = resolve_workload(model, inputs, batch=batch, input_shape=input_shape, seq_len=seq_len,
                         image_size=image_size, loss=loss)
    batch = validate_batch(w.default_batch if batch is None else batch)
    opt, amp_key = asked.optimizer, asked.amp
    if fake_target not in FAKE_TARGETS:
        validate_fake_target(fake_target)
    dt = model_dtype(asked.dtype)
    recipe = loop_recipe(asked, layout)
    check_recipe_for(recipe, w, dt)
    w = _stage_share(w, recipe)
    speed = _time_speed(time, gpu, engine)
    try:
        bd = breakdown(recipe_workload(w, recipe), batch, dtype=dt)
    except ValueError:
        raise
    except Exception as exc:   # the forward pass fails on shapes alone: the input does not suit the model
        raise ValueError(step_failed(w, batch, "on the meta device (shapes only)", exc)) from exc
    input_bytes = None if w.kind == "image" else _input_bytes(w, batch, dt)
    predicted = predict_step(w.name, batch, optimizer=opt, dtype=dt, bd=bd, input_bytes=input_bytes)
    known = sum(v for v in predicted.values() if v)
    flops = 3 * bd.forward_flops * steps
    choice = choose_engine("fake" if (recipe.tp * recipe.ep > 1 or speed is not None) and engine == "auto" else engine, known, flops, **engine_limits)
    m, timers = _run_guarded(w, batch, steps, dt, recipe, choice, guard, fake_target, speed)
    if m.kernels == "cuda":  # CUDA keeps Adam-style step counters in host memory
        predicted = predict_step(w.name, batch, optimizer=opt, dtype=dt, count_step_counters=False, bd=bd,
                                 input_bytes=input_bytes)
    return _recorded_workspaces(StepResult(
        w.name, batch, w.image_size or 0, opt, dtype_name(dt), steps, m, predicted, step_peaks=step_peaks(m),
        kind=w.kind, input_text=w.describe_input(batch), seq_len=w.seq_len, amp=amp_key,
        recipe=_layout_stated(m, w, recipe, batch, dt), answered_recipe=asked, answered_layout=layout,
        time=_step_time(timers, speed, w, batch, recipe, m, steps), mesh=_mesh_stated(m, layout),
        compiled_answer=functools.partial(_compiled_answer, m) if "inductor" in _value(m) else None), gpu)


def _value(m: Measurement) -> dict[str, Any]:
    return m.value if isinstance(m.value, dict) else {}


def _compiled_answer(m: Measurement) -> dict[str, Any] | None:
    """With ``compile``: inductor's plan for the step (``training.inductor_plan``), each step's peak
    with the plan in each compiled call's place, beside the tracker's op-by-op run of the same
    graphs (every intermediate allocated: the upper bound)."""
    peaks = inductor_step_peaks(m)
    if not peaks:
        return None
    plans = m.value["inductor"]
    where = "CUDA" if plans.device == "cuda" else plans.device.upper()
    return {"inductor_step_peaks": peaks, "inductor_peak_bytes": max(peaks), "bound_bytes": m.peak_bytes,
            "label": f"inductor's plan, the answer for torch.compile (its graphs lowered and scheduled for {where}, "
                     f"no code generated: its fused kernels' buffers, in-place reuses and frees)",
            "bound_label": "the same graphs run op by op (every intermediate allocated): the upper bound",
            **plans.as_dict(m.tracking.rounded)}


def _check_steps(steps: Any) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r} (the steady "
                         f"state is reached at step 2: the optimizer state exists from then on, and later "
                         f"steps repeat it)")


def _one_gpu(recipe: Recipe, layout: Layout) -> tuple[Recipe, Layout]:
    """A step is one GPU's (one rank of tp, cp, ep or pp): a layout over several GPUs is ``fit``'s."""
    if layout.gpus is not None or layout.strategy is not None or layout.offload_optimizer:
        raise ValueError("gpulab.step measures one GPU's step (one rank of tp, cp, ep or pp): gpus, strategy and "
                         "offload_optimizer spread it over several, which gpulab.fit answers; leave them out here")
    return recipe, layout


def _recorded_workspaces(result: "StepResult", gpu: Any) -> "StepResult":
    """On the fake engine's CUDA target with ``gpu`` named: the cuDNN workspaces recorded on that card
    for these settings, read as data (``predict.workspaces``), or why there are none."""
    m = result.measurement
    if gpu is not None and m.engine == "fake" and m.kernels == "cuda":
        found = recorded_cudnn_workspace(gpu, {"model": result.model, "batch": result.batch, "dtype": result.dtype,
                                               "image_size": result.image_size, "optimizer": result.optimizer},
                                         result.steps)
        result.cudnn_workspace_bytes, result.cudnn_workspace_label = found.nbytes, found.label
    return result


def _stage_share(w: Workload, recipe) -> Workload:
    """With ``pp`` pipeline stages, the step of stage ``pp_stage`` alone: its share of the layers (the
    loop cuts the rest of the model to the stage's and runs its micro-batches of ``batch`` in flight under
    ``schedule`` and ``microbatches``: ``training.pipeline``); ``w`` itself without."""
    return w if recipe.pp == 1 else workload_with_depth(w, w.config.num_hidden_layers // recipe.pp)


def _routing_stated(m: Measurement, w: Workload, recipe) -> dict[str, Any]:
    """The recipe's options as the result shows them; a mixture of experts' answer states the routing
    it took in them and in its label (``training.routing.stated_routing``: none stated, transformers'
    grouped_mm where the experts run it, else balanced): where the model has routed experts, its
    experts ran under an assumption, or the router's own choice was asked for."""
    shown = changed_options(recipe)
    routing = recipe.routing
    moe = w.config is not None and is_moe(w.config)
    if (routing is not None and routing.kind == "router") or ran_routed(m.tracking) or moe:
        routing = stated_routing(routing, w.config, recipe.ep) if moe else (routing or Routing())
        m.label = f"{m.label}; {routing.label}"
        shown["routing"] = routing.text
    return shown


def _mesh_stated(m: Measurement, layout: Layout) -> str:
    """A parallel rank's mesh (torchtitan's ``ParallelDims`` names, ``Layout.mesh``: the smallest that
    holds the rank, one GPU's step having no ``gpus``), in the label too; "" on one GPU."""
    if not layout.parallel:
        return ""
    m.label = f"{m.label}; {layout.mesh}"
    return layout.mesh


def _layout_stated(m: Measurement, w: Workload, recipe, batch: int, dt: torch.dtype) -> dict[str, Any]:
    """``_routing_stated``, and a context- or expert-parallel rank's layout in words and numbers
    (``training.context_parallel.layout_notes``), in the recipe shown and the label."""
    shown = _routing_stated(m, w, recipe)
    itemsize = torch.empty((), dtype=recipe.amp or dt).element_size()
    for name, note in {**tp_notes(recipe), **layout_notes(w, recipe, batch, itemsize)}.items():
        shown[name] = note
        m.label = f"{m.label}; {note['text']}"
    return shown


def _run_guarded(w: Workload, batch: int, steps: int, dt: torch.dtype, recipe, choice, guard: bool,
                 fake_target: str, speed: CardSpeed | None) -> tuple[Measurement, list]:
    """The step run on ``choice``: a real run refused first when the fake engine predicts it would not fit;
    with ``speed``, under an ``OpTimer`` (``predict.timing``), returned beside the measurement."""
    timers: list = []
    try:
        if guard and choice.name != "fake":
            fake = run(train_experiment(w, [batch] * steps, dt, recipe), "fake",
                       fake_target="cuda" if choice.name == "cuda" else "cpu")
            refused = check_fits(fake.peak_bytes, choice.name)
            if refused:
                raise _Refused(refused)
        experiment = train_experiment(w, [batch] * steps, dt, recipe)
        per_step = recipe.accumulate if recipe.pp == 1 else None   # a pipeline's forwards: the schedule's
        m = run(experiment if speed is None else timed_experiment(experiment, timers, per_step), choice,
                fake_target=fake_target)
    except _Refused as refused:
        raise ValueError(str(refused)) from None
    except Exception as exc:
        raise ValueError(step_failed(w, batch, f"on the {choice.name} engine", exc)) from exc
    return m, timers


def _time_speed(time: Any, gpu: Any, engine: str) -> CardSpeed | None:
    """The speeds a ``time=`` question is answered on: a ``CardSpeed`` as given, or ``gpu``'s row."""
    if time is False or time is None:
        return None
    if engine not in ("fake", "auto"):
        raise ValueError(f"time= predicts a step's time from the fake run: pass engine='fake' (got {engine!r})")
    if isinstance(time, CardSpeed):
        return time
    if time is not True:
        raise ValueError(f"time must be True (with gpu=) or a gpulab CardSpeed, got {time!r}")
    if gpu is None:
        raise ValueError("time=True predicts the step's time on a card: name it with gpu= (e.g. gpu='H100')")
    return speed_of(gpu)


def _step_time(timers: list, speed: CardSpeed | None, w: Workload, batch: int, recipe, m: Measurement,
               steps: int) -> StepTime | None:
    """The timed run's last step on ``speed``; tokens (a language model) or samples per step; with
    activation offloading, a step's share of the run's host copies over the host link."""
    if speed is None or not timers:
        return None
    per = w.seq_len if w.kind == "tokens" and w.seq_len else 1
    t = step_time_of(timers[0].ops, speed, batch * per * recipe.accumulate, "tokens" if per > 1 else "samples")
    offloaded = sum(r.nbytes for r in m.offloaded.records.values()) // steps if m.offloaded is not None else 0
    return with_host_copies(t, offloaded)


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
    recipe: dict[str, Any] = field(default_factory=dict)   # options set away from the plain loop
    # a fake CUDA-target run: cuDNN's convolution workspaces at the peak, where a run of these settings
    # was recorded on the card asked for (``predict.workspaces``), else None and NOT_PREDICTED
    cudnn_workspace_bytes: int | None = None
    cudnn_workspace_label: str = ""
    answered_recipe: Recipe | None = None   # the Recipe and Layout this answer is for (gpulab.options)
    answered_layout: Layout | None = None
    time: StepTime | None = None   # ``time=``: the step's predicted time (``predict.timing``)
    # ``compile``: inductor's plan beside the op-by-op bound (``_compiled_answer``), lowered when ``compiled`` is first read
    compiled_answer: Callable[[], dict[str, Any] | None] | None = field(default=None, repr=False, compare=False)
    mesh: str = ""                 # a layout's mesh (Layout.mesh): dp_replicate × dp_shard × cp × tp × pp, ep

    def __post_init__(self) -> None:
        m = self.measurement
        if not self.cudnn_workspace_label and m.engine == "fake" and m.kernels == "cuda":
            self.cudnn_workspace_label = NOT_PREDICTED

    @property
    def peak_with_workspaces_bytes(self) -> int:
        """The live tensors' peak plus the recorded cuDNN workspaces at the peak (where known)."""
        return self.peak_bytes + (self.cudnn_workspace_bytes or 0)

    @functools.cached_property
    def compiled(self) -> dict[str, Any] | None:
        """With ``compile``: inductor's plan for the step (its graphs lowered now, the first time it is
        read), each step's peak by it, beside ``peak_bytes``, the op-by-op upper bound; None without."""
        return self.compiled_answer() if self.compiled_answer is not None else None

    @property
    def inductor_peak_bytes(self) -> int | None:
        """With ``compile``: the step's peak by inductor's own memory plan (``peak_bytes`` is the op-by-op
        run of the same graphs, its upper bound); None without."""
        return self.compiled["inductor_peak_bytes"] if self.compiled else None

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
            "kernels": m.kernels, "kernels_note": m.kernels_note,
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
        if self.recipe:
            d["recipe"] = dict(self.recipe)
        if self.compiled is not None:
            d["compiled"] = dict(self.compiled)
        for name in ("answered_recipe", "answered_layout"):   # the objects asked, every field (dataclasses.asdict)
            if getattr(self, name) is not None:
                d[name] = asdict(getattr(self, name))
        if self.cudnn_workspace_label:
            d.update(cudnn_workspace_bytes=self.cudnn_workspace_bytes, cudnn_workspace_label=self.cudnn_workspace_label,
                     peak_with_workspaces_bytes=self.peak_with_workspaces_bytes)
        if self.time is not None:
            d["time"] = self.time.as_dict()
        if self.mesh:
            d["mesh"] = self.mesh
        if m.offloaded is not None:   # activation offloading: the host copies' peak, apart
            d["offloaded_peak_bytes"] = m.offloaded.peak_bytes
        if m.paged is not None:       # a paged optimizer: its unified-memory state, apart
            d["paged_peak_bytes"] = m.paged.peak_bytes
        if m.allocator is not None:
            d["allocator"] = dict(m.allocator)
            d["beyond_tensors"] = dict(m.beyond_tensors or {})
        if m.blocks is not None:   # the live tensors as the allocator counts them (cuda)
            d["allocator_blocks"] = {"peak_bytes": m.blocks.peak_bytes, "final_bytes": m.blocks.final_bytes,
                                     "label": m.blocks.label}
        return d

    def _repr_html_(self) -> str:
        from gpulab.views import step_html
        return step_html(self)

    def __repr__(self) -> str:
        return (f"StepResult({self.model}, batch={self.batch}, {self.optimizer}, engine={self.engine}, "
                f"peak={self.peak_bytes:,} B)")
