"""A training step's time, predicted from the same fake run that measures its memory: a roofline
per aten op on a card's datasheet speeds (``predict.card_speeds``), as PyTorch's
``RuntimeEstimator`` does (torch/distributed/_tools/runtime_estimator.py, "operator-level-cost-model").

Per op: FLOPs from ``torch.utils.flop_counter.flop_registry``, with the SDPA variants an older torch's
registry lacks counted by torch's own SDPA formula and ``_grouped_mm`` (MoE experts) by gpulab's
(``predict.op_flops``; the answer names the ops so counted, ``StepTime.added_formulas``); 0 for an op
without a formula (torch's formulas cover matrix multiplies, convolutions and attention), and the
answer names those ops (``StepTime.no_formula``),
bytes = its tensor inputs' and outputs' sizes (a stride-0 dimension read once, as
``torch.utils._runtime_estimation.get_num_bytes``; an op that returns nothing, as the in-place foreach
ops, ``_fused_adamw_`` and bitsandbytes' kernels (``training.bnb_kernels``) do, outputs the arguments its
schema marks written, ``Tensor(a!)``: read and written, each counted twice), and
time = max(FLOPs / (peak[dtype] × compute_efficiency), bytes / (bandwidth × memory_efficiency))
+ launch_overhead_s, with the ``TimeAssumptions`` named in the answer.

Where this differs from RuntimeEstimator, and why:
- NB: RuntimeEstimator's ``flops_to_ns`` halves the FLOPs ("converts FLOPs to MACs") before dividing
  by the peak in FLOP/s, which halves every compute time; here FLOPs are divided by FLOP/s.
- NB: the dtype of a FLOP is its op's lowest-precision floating input (a float8 ``_scaled_mm``
  writes bf16 but runs at the fp8 rate); RuntimeEstimator takes the output's dtype. fp32 runs at the
  fp32 peak (PyTorch's default ``torch.backends.cuda.matmul.fp32_precision`` is "ieee", not TF32).
- NB: creation ops that write a tensor (``zeros``, ``rand_like``) are costed as the memory they
  write; RuntimeEstimator ignores them. Views (``func.is_view``) cost nothing, as there.
- NB: RuntimeEstimator's ``_roofline_estimate`` passes ``get_transfer_time`` an op's flattened arguments
  and outputs, so an in-place op that returns nothing (``_foreach_mul_``) moves only its reads there;
  here its written arguments count too.
- NB: each op is one kernel with one launch, and nothing overlaps: no fusion, no streams.
- Collectives (``torch.ops._c10d_functional``: what DTensor issues on the fake process group in a
  tensor-parallel run) are not rooflined: each is costed by its bytes over the link its group crosses
  with NCCL's factors (``predict.comm_time``), on the critical path (``TP_OVERLAP``). ``wait_tensor``
  costs nothing. Activation offloading's copies to the host and back (``with_host_copies``: the run's
  offloaded bytes, twice) go over the card's host link (PCIe), not overlapped (``HOST_OVERLAP``); the
  fake CUDA target's stand-in copies are also costed as device copies (HBM, 50x faster: a sliver).
- RuntimeEstimator needs a GPU to read the peak; here the card's row gives it, so any machine answers.
- A tensor-parallel run's ops reach the timer as DTensor ops at their global shapes (the tracker sees
  DTensor's dispatch, not the local ops under it): each is costed as the rank's kernel, its FLOPs times
  ``_local_share`` (the output's local share, a ``Partial`` output's divided by its mesh size) and its
  bytes those of the local shards (``_local``).

The tracker already knows the phase of every op (forward, backward, optimizer) and sees every op: it
tells the timer each one (``MemoryTracker.op_observer``: no second dispatch mode to pass through, which
costs a fake run about a quarter more where the observer costs a tenth), and the timer reads the phase
(``MemoryTracker.current_phase``) and counts steps by it: a step starts at a forward that follows
anything but a backward (so accumulation's micro-batches stay in one step), or, told the micro-batches
a step runs (``per_step``), at a forward after a backward once the step has run that many (the optimizer
stepped in backward leaves no optimizer phase between steps). Checkpointing's recompute runs inside
the backward phase (the tracker's), so it stays in its step. The answer is the last step's: the steady
state.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from gpulab.predict.card_speeds import CardSpeed, TimeAssumptions
from gpulab.predict.comm_time import COMM_ASSUMPTION, CollectiveCost, collective_seconds, link_for
from gpulab.predict.op_flops import ADDED_SOURCES, COMPUTE_DTYPES, flop_formula
from gpulab.tables import html_table

__all__ = ["HOST_OVERLAP", "OpCost", "OpTimer", "StepTime", "TP_OVERLAP", "cost_ops", "dtype_key", "op_bytes",
           "roofline_seconds", "step_ops", "step_time_of", "timed_experiment"]

TP_OVERLAP = ("tensor parallelism's collectives on the critical path (each block's all-reduce, or sequence "
              "parallelism's all-gather and reduce-scatter, waits for its matmul and the next op waits for it)")
HOST_OVERLAP = "host-device copies (offloading) not overlapped with compute: an upper bound"
# the functional collectives' op names (torch/distributed/_functional_collectives.py) as NCCL's kinds
_COLLECTIVES = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                "all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast"}


# the kinds of op torch.utils.flop_counter's formulas cover (matrix multiplies, convolutions, attention):
# one of these without a formula has its compute left out of the step (``StepTime.uncounted_compute``)
_COMPUTE_KINDS = ("mm", "conv", "attention")
_WHERE = f"torch {torch.__version__.split('+')[0]}'s torch.utils.flop_counter"
_PRIM_DEVICE = torch.ops.prim.device.default
_STEP_PHASES = ("forward", "backward", "optimizer")
_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_RANK = {"fp8": 0, "fp16": 1, "bf16": 1, "fp32": 2, "fp64": 3}


def dtype_key(dtype: torch.dtype) -> str:
    """The card table's name for a dtype: float8 kinds are all "fp8"."""
    return "fp8" if "float8" in str(dtype) else _KEYS.get(dtype, str(dtype).replace("torch.", ""))


def op_bytes(t: torch.Tensor) -> int:
    """Bytes an op moves for one tensor: numel over the dimensions with a nonzero stride (a broadcast
    dimension is read once), times the element size (``_runtime_estimation.get_num_bytes``)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def roofline_seconds(flops: int, nbytes: int, peak_flops: float, bytes_per_s: float,
                     a: TimeAssumptions) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one op; its time is the larger plus ``a.launch_overhead_s``
    (the roofline: Williams, Waterman, Patterson, CACM 2009)."""
    return flops / (peak_flops * a.compute_efficiency), nbytes / (bytes_per_s * a.memory_efficiency)


@dataclass(frozen=True)
class OpCost:
    """One aten op of the run as the timer saw it (no card yet)."""
    name: str
    phase: str
    step: int
    flops: int
    nbytes: int
    dtype: str   # the FLOPs' dtype key ("" for an op without FLOPs)
    kind: str = "kernel"   # "kernel", or a collective's NCCL name ("all_reduce" ...)
    group: int = 1         # a collective's ranks
    formula: bool = True   # a kernel with a FLOP formula (``predict.op_flops``); False: scored 0 FLOPs, costed by its bytes


def _group_size(args: tuple) -> int:
    """A functional collective's ranks: its ``group_size`` argument, else its group's (by name)."""
    ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    if ints:
        return ints[-1]
    import torch.distributed.distributed_c10d as c10d
    name = next(a for a in reversed(args) if isinstance(a, str))
    return c10d._resolve_process_group(name).size()


class OpTimer(TorchDispatchMode):
    """Records every kernel-launching aten op of a run with its FLOPs, bytes and phase. Told each op by
    the run's ``MemoryTracker`` (``timed_experiment``: its ``op_observer``, after the tracker has seen
    it), or entered as a dispatch mode of its own inside the tracker: the same ops either way.
    ``from_step``: the steps before it are counted but their ops are not recorded (a run whose answer is
    its last step)."""

    def __init__(self, phase_of: Callable[[], str], per_step: int | None = None, from_step: int = 0) -> None:
        super().__init__()
        self._phase_of = phase_of
        self._per_step = per_step
        self._from = from_step
        self._forwards = 0   # forward phases entered in this step
        self.ops: list[OpCost] = []
        self.step = 0
        self._last = "setup"

    def new_step(self) -> None:
        """Count the ops from here on as the next step (a run whose steps no phase change separates:
        a prefill and the decode step after it, ``predict.generation``)."""
        self.step, self._forwards = self.step + 1, 1
        self._last = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self(func, args, kwargs, out)
        return out

    def __call__(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Record one op that ran (``func(*args, **kwargs)`` gave ``out``)."""
        if func is _PRIM_DEVICE or func.is_view:
            return
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if not outs:   # an in-place op that returns nothing writes its mutated arguments (``_written``)
            outs = _written(func, args, kwargs)
        if not outs:   # metadata queries, scalars read back
            return
        phase = self._phase_of()
        if phase == "forward" and self._last != "forward":
            if self._last != "backward" or (self._per_step is not None and self._forwards >= self._per_step):
                self.step, self._forwards = self.step + 1, 0
            self._forwards += 1
        self._last = phase
        if self.step < self._from:
            return
        ins = _tensors(args, kwargs)
        packet = func._overloadpacket
        if func.namespace in ("_c10d_functional", "_c10d_functional_autograd"):
            kind = _COLLECTIVES.get(packet.__name__)
            if kind is not None:   # S as nccl-tests counts it: the whole array (an all-gather's output)
                nbytes = op_bytes(outs[0]) if kind == "all_gather" else op_bytes(ins[0])
                self.ops.append(OpCost(packet.__name__, phase, self.step, 0, nbytes, "", kind, _group_size(args)))
            return   # wait_tensor: a wait, no kernel of its own

        flops, key = 0, ""
        formula = flop_formula(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out) * _local_share(outs[0]))
            floats = [dtype_key(t.dtype) for t in ins if t.is_floating_point()] or [dtype_key(outs[0].dtype)]
            key = COMPUTE_DTYPES.get(packet.__name__) or min(floats, key=lambda k: _RANK.get(k, 9))
        self.ops.append(OpCost(packet.__name__, phase, self.step, flops,
                               sum(op_bytes(_local(t)) for t in ins) + sum(op_bytes(_local(t)) for t in outs), key,
                               formula=formula is not None))


_WRITES: dict = {}   # op -> its written arguments' (position, name)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place, from its schema (``Tensor(a!)`` arguments: ``alias_info.is_write``):
    what an op that returns nothing writes (``_foreach_add_``, ``_fused_adamw_``, gpulab's
    ``training.bnb_kernels``). Each is also among its inputs, so it counts once read and once written."""
    written = _WRITES.get(func)
    if written is None:
        written = _WRITES[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                                   if a.alias_info is not None and a.alias_info.is_write]
    out: list[torch.Tensor] = []
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        out += [value] if isinstance(value, torch.Tensor) else [t for t in (value or ()) if isinstance(t, torch.Tensor)]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank's kernel reads or writes), else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _local_share(out: torch.Tensor) -> float:
    """The share of a DTensor op's FLOPs (counted at the global shapes DTensor dispatches) that this rank's
    kernel runs: its output's local elements over the global ones (a ``Shard`` placement splits the work by
    the output), divided again by each mesh dimension the output is ``Partial`` over (the work split along
    the reduction, each rank holding a full-shaped partial sum: a row-wise linear). 1 for a plain tensor and
    for a replicated output (every rank runs it whole)."""
    inner = getattr(out, "_local_tensor", None)
    if not isinstance(inner, torch.Tensor) or not out.numel():
        return 1.0
    share = inner.numel() / out.numel()
    for placement, size in zip(out.placements, out.device_mesh.shape):
        if placement.is_partial():
            share /= size
    return share


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments, in ``tree_flatten((args, kwargs))``'s order: flat tuples
    and lists (a foreach op's) read directly, anything else flattened."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            if all(isinstance(v, torch.Tensor) or not isinstance(v, (tuple, list, dict)) for v in value):
                out += [v for v in value if isinstance(v, torch.Tensor)]
            else:
                out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def timed_experiment(experiment: Callable[[Any], Any], box: list, per_step: int | None = None,
                     from_step: int = 0) -> Callable[[Any], Any]:
    """``experiment`` run with an ``OpTimer`` told every op by the run's tracker (its ``op_observer``),
    reading the tracker for phases; the timer is appended to ``box`` for the caller to read after
    ``engines.run`` returns. ``per_step``: the micro-batches (forwards) a step runs, where known;
    ``from_step``: the first step whose ops are recorded (``OpTimer``)."""
    def timed(ctx):
        timer = OpTimer(ctx.tracker.current_phase, per_step, from_step)
        box.append(timer)
        before, ctx.tracker.op_observer = ctx.tracker.op_observer, timer
        try:
            return experiment(ctx)
        finally:
            ctx.tracker.op_observer = before
    return timed


@dataclass
class OpTotals:
    """One op name's share of the step."""
    name: str
    count: int = 0
    seconds: float = 0.0
    flops: int = 0
    nbytes: int = 0
    compute_bound: int = 0   # how many of its calls were compute-bound

    @property
    def bound(self) -> str:
        return "compute" if self.compute_bound * 2 > self.count else "memory"


@dataclass
class StepTime:
    """A training step's predicted time on a card (data; ``__repr__``/``_repr_html_`` are its views)."""
    card: str
    speed: CardSpeed
    seconds: float
    by_phase: dict[str, float]
    compute_bound_s: float      # time of the ops whose compute time exceeds their memory time
    memory_bound_s: float
    launch_s: float             # the kernels' launch overheads (inside ``seconds``)
    kernels: int
    flops: int                  # every FLOP the step ran (recompute included: hardware FLOPs)
    forward_flops: int
    mfu_dtype: str              # the dtype carrying most FLOPs: MFU is against its peak
    items: int                  # tokens (or samples) one step consumes
    unit: str                   # "tokens" or "samples"
    by_op: dict[str, OpTotals] = field(default_factory=dict)
    comm_s: float = 0.0         # collectives the run issued (tensor parallelism), inside ``seconds``
    host_s: float = 0.0         # host-device copies (offloading), inside ``seconds``
    collectives: dict[str, CollectiveCost] = field(default_factory=dict)
    host_bytes: int = 0
    no_formula: dict[str, int] = field(default_factory=dict)   # kernels without a FLOP formula: calls by name

    @property
    def label(self) -> str:
        return f"predicted (roofline, {self.card})"

    @property
    def assumptions(self) -> TimeAssumptions:
        return self.speed.assumptions

    @property
    def model_flops(self) -> int:
        """3 × the forward's FLOPs: the backward taken as twice the forward, recompute not counted
        (the MFU convention: PaLM, Chowdhery et al. 2022, appendix B). NB: a frozen base (LoRA) runs
        less backward than this says."""
        return 3 * self.forward_flops

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs / (step time × the card's peak for ``mfu_dtype``)."""
        if not self.seconds or not self.mfu_dtype:
            return 0.0
        return self.model_flops / (self.seconds * self.speed.peak_flops(self.mfu_dtype))

    @property
    def compute_bound_share(self) -> float:
        work = self.compute_bound_s + self.memory_bound_s
        return self.compute_bound_s / work if work else 0.0

    @property
    def uncounted_compute(self) -> dict[str, int]:
        """The ops without a FLOP formula whose names say they are of a kind torch's formulas cover
        (``_COMPUTE_KINDS``, e.g. ``_grouped_mm``): their compute is missing from ``flops`` and from the
        time (only their bytes are costed)."""
        return {n: c for n, c in self.no_formula.items() if any(k in n for k in _COMPUTE_KINDS)}

    @property
    def added_formulas(self) -> dict[str, int]:
        """The ops counted by a formula gpulab adds where this torch's registry has none
        (``op_flops.ADDED_SOURCES``): calls by name."""
        return {n: o.count for n, o in self.by_op.items() if n in ADDED_SOURCES and n not in self.no_formula}

    def formula_lines(self) -> list[str]:
        """The ops counted by a formula gpulab adds, each with its source, and the ops the step met
        without a FLOP formula, named with their calls (the uncounted compute kinds first, on a line of
        their own)."""
        out = [f"  FLOPs of {n} ({c} calls) by {ADDED_SOURCES[n]}, where {_WHERE} has none that fits"
               for n, c in self.added_formulas.items()]
        if not self.no_formula:
            return out
        named = sorted(self.no_formula.items(), key=lambda kv: (-kv[1], kv[0]))
        return [*out, *self.uncounted_lines(), f"  no FLOP formula in {_WHERE} (0 FLOPs, costed by their bytes): "
                f"{sum(self.no_formula.values()):,} calls of {len(named)} ops: " + ", ".join(f"{n} ×{c}" for n, c in named)]

    def uncounted_lines(self, what: str = "") -> list[str]:
        """A line naming the ``uncounted_compute`` ops, where there are any (``what``: whose step)."""
        if not self.uncounted_compute:
            return []
        return [f"  NB: {what}no FLOP formula in {_WHERE} for " + ", ".join(
            f"{n} ({c} calls)" for n, c in self.uncounted_compute.items()) + ": their compute is left out"]

    def top_ops(self, n: int = 8) -> list[OpTotals]:
        return sorted(self.by_op.values(), key=lambda o: -o.seconds)[:n]

    def lines(self) -> list[str]:
        """The answer as text lines (the CLI prints them)."""
        phases = ", ".join(f"{p} {s * 1e3:.3f} ms" for p, s in self.by_phase.items())
        return [f"step time: {self.seconds * 1e3:.3f} ms, {self.label}",
                f"  by phase: {phases}",
                f"  {self.unit}/s: {self.items_per_s:,.0f} ({self.items:,} {self.unit} a step); "
                f"MFU {self.mfu:.1%} of {self.mfu_dtype} peak",
                f"  compute-bound {self.compute_bound_share:.0%} of op time; {self.kernels:,} kernels, "
                f"launch {self.launch_s * 1e3:.3f} ms",
                *self.comm_lines(),
                *self.formula_lines(),
                f"  assumptions: {self.assumptions.text} ({self.assumptions.source})",
                f"  card: {self.speed.source}"]

    def comm_lines(self) -> list[str]:
        """The run's own collectives and host copies, where it made any."""
        out = [f"  {c.kind.replace('_', '-')} over {c.group} ranks ({c.link}): {c.count} calls, {c.nbytes:,} B, "
               f"{c.seconds * 1e3:.3f} ms" for c in self.collectives.values()]
        if self.collectives:
            out.append(f"  communication {self.comm_s * 1e3:.3f} ms: {TP_OVERLAP}; {COMM_ASSUMPTION}")
        if self.host_bytes:
            out.append(f"  host copies {self.host_bytes:,} B over PCIe: {self.host_s * 1e3:.3f} ms ({HOST_OVERLAP})")
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = [[o.name, o.count, f"{o.seconds * 1e3:.3f}", f"{o.flops:,}", f"{o.nbytes:,}", o.bound]
                for o in self.top_ops()]
        head = "".join(f"<p>{line}</p>" for line in self.lines())
        return head + html_table(["op", "calls", "ms", "FLOPs", "bytes", "bound"], rows)

    def as_dict(self) -> dict[str, Any]:
        a = self.assumptions
        return {"label": self.label, "seconds": self.seconds, "by_phase": dict(self.by_phase),
                "compute_bound_share": self.compute_bound_share, "kernels": self.kernels,
                "launch_seconds": self.launch_s, "flops": self.flops, "model_flops": self.model_flops,
                "items": self.items, "unit": self.unit, "items_per_s": self.items_per_s, "mfu": self.mfu,
                "mfu_dtype": self.mfu_dtype,
                "assumptions": {"compute_efficiency": a.compute_efficiency, "memory_efficiency": a.memory_efficiency,
                                "launch_overhead_s": a.launch_overhead_s, "source": a.source},
                "card_source": self.speed.source, "comm_seconds": self.comm_s, "host_seconds": self.host_s,
                "host_bytes": self.host_bytes, "no_formula": dict(self.no_formula),
                "added_formulas": self.added_formulas,
                "uncounted_compute": self.uncounted_compute, "collectives": [c.as_dict() for c in self.collectives.values()],
                "lines": self.lines()}


def step_ops(ops: list[OpCost]) -> list[OpCost]:
    """The last step's ops (phases forward, backward, optimizer): the steady state."""
    last = max((o.step for o in ops if o.phase == "forward"), default=0)
    return [o for o in ops if o.step == last and o.phase in _STEP_PHASES]


def step_time_of(ops: list[OpCost], speed: CardSpeed, items: int, unit: str) -> StepTime:
    """The last step's ops (``step_ops``) costed on ``speed``."""
    return cost_ops(step_ops(ops), speed, items, unit)


def cost_ops(ops: list[OpCost], speed: CardSpeed, items: int, unit: str) -> StepTime:
    """``ops`` costed on ``speed``, one after another: kernels by the roofline, collectives by their link
    (``predict.comm_time``), host copies by the host link."""
    a = speed.assumptions
    by_phase: dict[str, float] = defaultdict(float)
    by_op: dict[str, OpTotals] = {}
    flops_by_dtype: dict[str, int] = defaultdict(int)
    collectives: dict[str, CollectiveCost] = {}
    no_formula: dict[str, int] = defaultdict(int)
    compute_s = memory_s = comm_s = 0.0
    kernels = flops = forward_flops = 0
    for o in ops:
        if o.kind != "kernel" and speed.links is not None:
            bw, link = link_for(speed.links, o.group)
            if bw is None:
                raise ValueError(f"{speed.name} has no network figure in gpulab's card table: a group of "
                                 f"{o.group} ranks leaves its node of {speed.links.gpus_per_node}")
            t = collective_seconds(o.kind, o.nbytes, o.group, bw)
            c = collectives.setdefault(f"{o.kind}/{o.group}", CollectiveCost(o.kind, o.group, link))
            c.count, c.nbytes, c.seconds = c.count + 1, c.nbytes + o.nbytes, c.seconds + t
            comm_s += t
            by_phase[o.phase] += t
            continue
        c, m = roofline_seconds(o.flops, o.nbytes, speed.peak_flops(o.dtype) if o.flops else 1.0,
                                speed.bandwidth_bytes_s, a)
        t = max(c, m) + a.launch_overhead_s
        by_phase[o.phase] += t
        compute_s, memory_s = (compute_s + max(c, m), memory_s) if c > m else (compute_s, memory_s + max(c, m))
        tot = by_op.setdefault(o.name, OpTotals(o.name))
        tot.count, tot.seconds, tot.flops, tot.nbytes = tot.count + 1, tot.seconds + t, tot.flops + o.flops, \
            tot.nbytes + o.nbytes
        tot.compute_bound += c > m
        kernels += 1
        if not o.formula:
            no_formula[o.name] += 1
        flops += o.flops
        forward_flops += o.flops if o.phase == "forward" else 0
        if o.flops:
            flops_by_dtype[o.dtype] += o.flops
    mfu_dtype = max(flops_by_dtype, key=flops_by_dtype.get) if flops_by_dtype else ""
    return StepTime(speed.name, speed, sum(by_phase.values()), dict(by_phase), compute_s, memory_s,
                    kernels * a.launch_overhead_s, kernels, flops, forward_flops, mfu_dtype, items, unit, by_op,
                    comm_s, 0.0, collectives, 0, dict(no_formula))


def with_host_copies(t: StepTime, offloaded_bytes: int) -> StepTime:
    """``t`` with activation offloading's copies: ``offloaded_bytes`` to the host in the forward and
    back in the backward, each over the card's host link (``HOST_OVERLAP``)."""
    if not offloaded_bytes or t.speed.links is None:
        return t
    each = offloaded_bytes / (t.speed.links.host_gbs * 1e9)
    by_phase = dict(t.by_phase)
    for phase in ("forward", "backward"):
        by_phase[phase] = by_phase.get(phase, 0.0) + each
    return replace(t, seconds=t.seconds + 2 * each, by_phase=by_phase, host_s=2 * each,
                   host_bytes=2 * offloaded_bytes)
