"""Lesson 12: beyond one GPU. The ZeRO formulas (figure 1 of the paper, then any model and any
number of devices), data-parallel strategies measured per rank in real ``torch.distributed``
processes (gpulab.distributed.sharding), FSDP's gathered parameters on the timeline, and gradient
accumulation measured in one process."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpulab.models import hf_configs
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, parse_gpu
from gpulab.measure.engines import run
from gpulab.formulas import zero_bytes_per_device
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.distributed.sharding import GROUPS, STRATEGIES, StrategyRun, StrategySpec, batch, build, fsdp_shard_numel, groups_of, live_by_group, loss_of, measure_strategies
from gpulab.tables import html_table
from gpulab.categories import Category
from gpulab.units import format_bytes
from gpulab.course.exercises import Exercise
from gpulab.course.transformer_params import counted_params

__all__ = [
    "AccumulationResult", "CardsNeeded", "GB", "GROUP_COLORS", "STAGE_FORMULAS", "STAGE_NAMES",
    "StrategyComparison", "ZERO_PAPER", "ZeroTable", "cards_needed", "compare_strategies",
    "exercise_accumulation_activations", "exercise_fsdp_shard", "exercise_zero2",
    "gathered_timeline", "grad_accumulation", "model_params", "strategy_bars", "zero_figure1",
    "zero_table"
]

ZERO_PAPER = "Rajbhandari et al., ZeRO (2019, arXiv:1910.02054), figure 1"
STAGE_NAMES = {0: "baseline (DDP)", 1: "P_os (ZeRO-1)", 2: "P_os+g (ZeRO-2)", 3: "P_os+g+p (ZeRO-3 / FSDP)"}
STAGE_FORMULAS = {0: "(2+2+K)·Ψ", 1: "2Ψ + 2Ψ + K·Ψ/N", 2: "2Ψ + (2+K)·Ψ/N", 3: "(2+2+K)·Ψ/N"}
GB = 10**9


# ---- the formulas at scale -----------------------------------------------------------------

@dataclass
class ZeroTable:
    """Model-state bytes per device for each ZeRO stage (mixed-precision Adam: 2-byte weights
    and gradients, K bytes of state per parameter), over several device counts."""

    n_params: int
    world_sizes: tuple[int, ...]
    k: int
    title: str
    bytes: dict[int, dict[int, int]] = field(default_factory=dict)  # stage -> N -> bytes

    @classmethod
    def compute(cls, n_params: int, world_sizes: tuple[int, ...], k: int = 12, title: str = "") -> "ZeroTable":
        table = {stage: {n: zero_bytes_per_device(n_params, n, stage, optimizer_bytes_per_param=k)
                         for n in world_sizes} for stage in range(4)}
        return cls(n_params, tuple(world_sizes), k, title, table)

    def gb(self, stage: int, n: int) -> float:
        return self.bytes[stage][n] / GB

    def _repr_html_(self) -> str:
        rows = [[STAGE_NAMES[s], STAGE_FORMULAS[s]] + [f"{self.gb(s, n):,.1f} GB" for n in self.world_sizes]
                for s in range(4)]
        cap = (f"{self.title}: Ψ = {self.n_params:,} parameters, K = {self.k}, computed by "
               f"gpulab.formulas.zero_bytes_per_device (GB = 10⁹ bytes)")
        return html_table(["stage", "per device"] + [f"N = {n}" for n in self.world_sizes], rows, caption=cap)


def zero_figure1() -> ZeroTable:
    """The paper's figure 1: Ψ = 7.5 B, K = 12, N = 64 → 120, 31.4, 16.6 and 1.9 GB."""
    return ZeroTable.compute(7_500_000_000, (1, 8, 64), k=12, title=ZERO_PAPER)


def model_params(model: str) -> int:
    """Parameters of a built-in transformer config (``llama-3-8b``, ``gpt2``, ...), counted by
    building it on the meta device."""
    return counted_params(model.removeprefix(hf_configs.HF_PREFIX))[0]


def zero_table(model: str = "llama-3-8b", world_sizes: tuple[int, ...] = (1, 2, 4, 8, 64), k: int = 12) -> ZeroTable:
    return ZeroTable.compute(model_params(model), world_sizes, k=k, title=model)


# what the framework people run holds for each stage (gpulab.predict.sharding: DeepSpeed's own
# estimator for ZeRO-2 and ZeRO-3, ZeRO-1 with DeepSpeed's 16 bytes of fp32 state, PyTorch DDP's
# gradient buckets for the baseline)
FRAMEWORK_STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
FRAMEWORK_FORMULAS = {0: "2Ψ + 2Ψ + 2Ψ (DDP's buckets) + 16Ψ", 1: "2Ψ + 2Ψ + 16Ψ/N",
                      2: "2Ψ + 18Ψ/N (DeepSpeed's estimator)", 3: "4·largest layer + 18Ψ/N (DeepSpeed's estimator)"}


@dataclass
class CardsNeeded:
    """The fewest devices of a card on which each ZeRO stage's model states fit: by the paper's
    formula, and as the framework holds them (DeepSpeed's bytes, DDP's buckets)."""

    model: str
    n_params: int
    card: str
    usable_bytes: int
    k: int
    needed: dict[int, int | None]        # stage -> N by the paper's formula (None: no N fits)
    per_device: dict[int, int]           # stage -> the paper's bytes per device at that N (or at N = 1)
    framework_needed: dict[int, int | None] = field(default_factory=dict)
    framework_per_device: dict[int, int] = field(default_factory=dict)
    largest_layer: int = 0

    def _repr_html_(self) -> str:
        rows = []
        for s in range(4):
            n, fn = self.needed[s], self.framework_needed.get(s)
            rows.append([STAGE_NAMES[s], STAGE_FORMULAS[s], "never: " + _why_never(s) if n is None else f"{n}",
                         format_bytes(self.per_device[s], "decimal"), FRAMEWORK_FORMULAS[s],
                         "never" if fn is None else f"{fn}", format_bytes(self.framework_per_device.get(s, 0), "decimal")])
        cap = (f"{self.model} ({self.n_params:,} parameters, largest layer {self.largest_layer:,}), full fine-tuning "
               f"with mixed-precision Adam on {self.card}: {format_bytes(self.usable_bytes, 'decimal')} usable per "
               f"card after an assumed {format_bytes(CUDA_CONTEXT_ASSUMED)} CUDA context. The paper's figure "
               f"(K = {self.k}) and the framework's (gpulab.predict.sharding: DDP's gradient buckets; DeepSpeed's 16 bytes "
               "of fp32 state per parameter, and for ZeRO-2 and ZeRO-3 its own estimator functions, deepspeed 0.19). "
               "Model states only: activations, temporary buffers and fragmentation come on top "
               "(gpulab fit --gpus N --strategy ... adds them).")
        return html_table(["stage", "paper: per device", "paper: cards", "paper: bytes per card",
                           "framework: per device", "framework: cards", "framework: bytes per card"], rows, caption=cap)


    def reading(self) -> str:
        """The table read out in sentences (Markdown), every figure from this result: lesson 12
        renders it instead of typing the numbers (issue 47: a typed "84.5 GB usable" beside a table
        that printed 83.6 GB)."""
        d = lambda n: format_bytes(n, "decimal")   # noqa: E731
        cards = lambda n: "no number of cards" if n is None else f"{n} card{'s' if n != 1 else ''}"  # noqa: E731
        psi = self.n_params
        out = []
        if self.needed[0] is None:
            out.append(f"Plain data parallelism never fits: every card holds all $16\\Psi$ = {d(16 * psi)}.")
        else:
            out.append(f"Plain data parallelism needs {cards(self.needed[0])}: every card holds all $16\\Psi$ = "
                       f"{d(16 * psi)}.")
        out.append(f"Sharding the optimizer state alone leaves $4\\Psi$ = {d(4 * psi)} of weights and gradients on "
                   "each card.")
        paper = "; ".join(f"{STAGE_NAMES[s]} on {cards(self.needed[s])}" +
                          ("" if self.needed[s] is None else f", {d(self.per_device[s])} per card")
                          for s in (1, 2, 3))
        out.append(f"By the paper's formula, of the {d(self.usable_bytes)} usable on each {self.card}: {paper}; "
                   "before a single activation is stored.")
        if self.framework_needed:
            fw = "; ".join(f"{STAGE_NAMES[s]} on {cards(self.framework_needed.get(s))}" for s in (1, 2, 3))
            out.append(f"As the framework holds the model states (the table's framework columns): {fw}.")
        return " ".join(out)


def _why_never(stage: int) -> str:
    return {0: "every card holds all 16Ψ bytes", 1: "2Ψ + 2Ψ stay on every card",
            2: "the 2Ψ of weights stay on every card"}.get(stage, "")


def cards_needed(model: str = "llama-3-8b", card: str = "H100", k: int = 12, max_devices: int = 4096) -> CardsNeeded:
    """How many cards of ``card`` hold the model states of a full fine-tune under each stage: the
    smallest N with the per-device bytes ≤ card − CUDA context, by the paper's formula
    (``zero_bytes_per_device``) and as the framework holds them (``predict.sharding``).
    A card name (H100: the 79.18 GiB CUDA reports, ``Card.reported_total_bytes``) or a size: "80GB"
    is 80·10⁹ bytes, "80GiB" 80·2³⁰."""
    from gpulab.predict import sharding as SH
    psi = model_params(model)
    with torch.device("meta"):
        layers = SH.count_layers(hf_configs.build_model(model.removeprefix(hf_configs.HF_PREFIX)))
    c = parse_gpu(card)
    usable = c.reported_total_bytes - CUDA_CONTEXT_ASSUMED
    needed: dict[int, int | None] = {}
    per_device: dict[int, int] = {}
    fneeded: dict[int, int | None] = {}
    fper: dict[int, int] = {}
    for stage in range(4):
        def paper(n: int, stage=stage) -> int:
            return zero_bytes_per_device(psi, n, stage, optimizer_bytes_per_param=k)

        def framework(n: int, stage=stage) -> int:
            return SH.model_state_bytes(psi, SH.Sharding(n, FRAMEWORK_STRATEGY[stage]), layers, 2, 16)
        for f, need, per in ((paper, needed, per_device), (framework, fneeded, fper)):
            n = _smallest_n(f, usable, max_devices)
            need[stage] = n
            per[stage] = f(n or 1)
    return CardsNeeded(model, psi, c.name, usable, k, needed, per_device, fneeded, fper, layers.largest_layer)


def _smallest_n(per_device, usable: int, max_devices: int) -> int | None:
    if per_device(max_devices) > usable:
        return None  # per-device bytes only fall as N grows, so no N up to the limit fits
    lo, hi = 1, max_devices
    while lo < hi:
        mid = (lo + hi) // 2
        if per_device(mid) <= usable:
            hi = mid
        else:
            lo = mid + 1
    return lo


def exercise_zero2() -> Exercise:
    return Exercise(
        "Figure 1 of the ZeRO paper: Ψ = 7.5 B parameters, K = 12, N = 64 devices. How many GB of "
        "model states per device with optimizer state and gradients sharded (P_os+g)?",
        expected=lambda: round(zero_bytes_per_device(7_500_000_000, 64, 2) / GB, 1),
        explain="2Ψ bytes of fp16 weights stay on every device (15 GB); the (2 + K)Ψ bytes of gradients and "
                "optimizer state are split 64 ways (14 × 7.5e9 / 64 ≈ 1.64 GB).",
        unit="GB", rel_tol=0.01, hint="Which terms are divided by N, and which stay whole?")


# ---- strategies measured ----------------------------------------------------------------------

@dataclass
class StrategyComparison:
    """Several strategies measured on the same model in the same worker processes; ``bucket_view``
    is DDP again with ``gradient_as_bucket_view=True`` (None when not asked for)."""

    runs: list[StrategyRun]
    bucket_view: StrategyRun | None = None

    def run(self, strategy: str) -> StrategyRun:
        """The run of ``strategy`` (``"ddp"``, ``"fsdp2"``, ...)."""
        for r in self.runs:
            if r.spec.strategy == strategy:
                return r
        raise KeyError(f"no {strategy!r} run in this comparison; it has {', '.join(r.spec.strategy for r in self.runs)}")

    def rows(self) -> list[list[str]]:
        out = []
        for r in self.runs:
            f, m = r.formula(), r.measured(0)
            out.append([STRATEGIES[r.spec.strategy]["title"], format_bytes(m["parameters"]),
                        format_bytes(m["gradients"]), format_bytes(m["optimizer_state"]),
                        format_bytes(m["total"]), format_bytes(f["total"]),
                        f"{100 * (m['total'] - f['total']) / f['total']:+.2f}%",
                        format_bytes(m["parameters while computing"]),
                        format_bytes(r.ranks[0].at_peak["communication buffers"]),
                        format_bytes(r.ranks[0].peak_bytes)])
        return out

    def _repr_html_(self) -> str:
        r0 = self.runs[0]
        cap = (f"Rank 0 of {r0.world_size}, {r0.spec.model} (width {r0.spec.width}, Ψ = {r0.n_params:,}), Adam in fp32: "
               "the formula is ZeRO's with 4-byte weights and gradients and K = 8. Model states are measured after "
               "the last optimizer step, gradients kept. " + r0.label + ".")
        return html_table(["strategy", "parameters", "gradients", "optimizer state", "model states",
                           "ZeRO formula", "error", "parameters while computing", "comm. buffers at peak", "peak"],
                          self.rows(), caption=cap)


def compare_strategies(model: str = "transformer", world_size: int = 2, width: int = 128, layers: int = 2,
                       batch_size: int = 8, seq_len: int = 32,
                       strategies: tuple[str, ...] = tuple(STRATEGIES), bucket_view: bool = False) -> StrategyComparison:
    """Each of ``strategies`` measured on the same model, one after the other in one set of
    ``world_size`` worker processes (starting them, each importing torch, costs far more than
    these small steps). ``bucket_view``: also measure DDP with ``gradient_as_bucket_view=True``
    there (``.bucket_view``), rather than starting the processes again for it."""
    specs = [StrategySpec(strategy=s, model=model, width=width, layers=layers, batch=batch_size, seq_len=seq_len)
             for s in strategies]
    if bucket_view:
        specs.append(StrategySpec(strategy="ddp", model=model, width=width, layers=layers, batch=batch_size,
                                  seq_len=seq_len, bucket_view=True))
    runs = measure_strategies(specs, world_size)
    return StrategyComparison(runs[:len(strategies)], runs[len(strategies)] if bucket_view else None)


# the tracker's colours (gpulab.plots), and two for what sharding adds
GROUP_COLORS = {**CATEGORY_COLORS, "gathered parameters": "#9DB8E0", "communication buffers": "#64B5CD"}


def strategy_bars(runs: list[StrategyRun]):
    """Each strategy's ranks at their peak, stacked by group (MiB)."""
    fig = LessonFigure(figsize=(9, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    labels, x = [], 0
    for r in runs:
        for b in r.ranks:
            bottom = 0.0
            for g in GROUPS:
                v = b.at_peak[g] / 2**20
                if v:
                    ax.bar(x, v, bottom=bottom, color=GROUP_COLORS[g], label=g if g not in ax.get_legend_handles_labels()[1] else None)
                    bottom += v
            labels.append(f"{r.spec.strategy}\nrank {b.rank}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("MiB at the rank's peak")
    ax.set_title(f"Per-rank peak by category, {runs[0].world_size} processes ({runs[0].run.backend})")
    ax.legend(fontsize=7, loc="upper right")
    return fig


def gathered_timeline(sr: StrategyRun, rank: int = 0):
    """Live bytes over a rank's run, stacked by group: FSDP's gathered parameters appear before
    each unit's forward and backward and vanish after."""
    res = sr.run.rank(rank)
    tr = res.tracking
    groups = groups_of(res)
    order = [g for g in GROUPS if any(groups[e.sid] == g for e in tr.events)]
    series = {g: [] for g in order}
    for live in live_by_group(tr, groups):
        for g in order:
            series[g].append(live[g] / 2**20)
    fig = LessonFigure(figsize=(9, 3.4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.stackplot(range(len(tr.events)), [series[g] for g in order], labels=order,
                 colors=[GROUP_COLORS[g] for g in order])
    for start, end in res.data["steps"]:
        i = next((k for k, e in enumerate(tr.events) if e.index >= start), None)
        if i is not None:
            ax.axvline(i, color="k", lw=0.6, ls=":")
    ax.set_xlabel("tracker event")
    ax.set_ylabel("MiB live")
    ax.set_title(f"{STRATEGIES[sr.spec.strategy]['title']}: rank {rank} of {sr.world_size}")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return fig


def exercise_fsdp_shard(width: int = 128, layers: int = 2, world_size: int = 2) -> Exercise:
    model = build("transformer", width, layers)
    shapes = [tuple(p.shape) for p in model.parameters()]
    n = sum(p.numel() for p in model.parameters())
    return Exercise(
        f"The lesson's transformer (width {width}, {layers} layers) has {n:,} fp32 parameters. With FSDP over "
        f"{world_size} processes, how many bytes of parameters does each rank keep between steps?",
        expected=lambda: 4 * fsdp_shard_numel(shapes, world_size),
        explain="Every parameter is split along its first dimension into N equal chunks (torch.chunk; the last "
                "padded), 4 bytes per element: here every first dimension divides evenly, so exactly Ψ·4/N.",
        unit="bytes", rel_tol=0.0)


# ---- gradient accumulation ---------------------------------------------------------------------

@dataclass
class AccumulationResult:
    model: str
    batch: int
    micro_batches: int
    peak_bytes: dict[int, int]         # k -> peak
    activations: dict[int, int]        # k -> activation bytes at their largest
    max_grad_difference: float
    grad_scale: float                  # the largest gradient element, for scale
    label: str

    def _repr_html_(self) -> str:
        rows = [[f"{k} micro-batch{'es' if k > 1 else ''} of {self.batch // k}", format_bytes(self.activations[k]),
                 format_bytes(self.peak_bytes[k])] for k in sorted(self.peak_bytes)]
        why = ("float32 rounding" if self.max_grad_difference <= 1e-5 * self.grad_scale
               else "not rounding: BatchNorm normalises each micro-batch by its own statistics")
        cap = (f"{self.model}, {self.batch} samples per optimizer step. Largest gradient difference between the "
               f"two: {self.max_grad_difference:.2e}, largest gradient {self.grad_scale:.2e} ({why}). {self.label}")
        return html_table(["how", "activations at their largest", "peak"], rows, caption=cap)


def grad_accumulation(model: str = "transformer", batch_size: int = 16, micro_batches: int = 4, width: int = 128,
                      seq_len: int = 32, engine: str = "cpu") -> AccumulationResult:
    """One optimizer step's gradients from one batch of ``batch_size`` vs from ``micro_batches``
    micro-batches (each loss divided by their number): the same gradients, the activations of
    one micro-batch. The transformer has no batch statistics; the CNN's BatchNorm makes the two
    differ (each micro-batch is normalised by its own mean and variance)."""
    if batch_size % micro_batches:
        raise ValueError(f"the batch ({batch_size}) must split into {micro_batches} equal micro-batches")
    peaks, acts, grads = {}, {}, {}
    label = ""
    for k in (1, micro_batches):
        def experiment(ctx, k=k):
            torch.manual_seed(0)
            net = build(model, width)
            ctx.tracker.register(net)
            x, y = batch(model, batch_size, seq_len, seed=7)
            for xs, ys in zip(x.chunk(k), y.chunk(k)):
                xs, ys = ctx.label(xs.clone()), ctx.label(ys.clone())
                (loss_of(net(xs), ys) / k).backward()
                del xs, ys
            return torch.cat([p.grad.flatten() for p in net.parameters()]).detach().clone()
        m = run(experiment, engine=engine)
        peaks[k] = m.peak_bytes
        acts[k] = max((s[Category.ACTIVATIONS.value] for s in m.tracking.series), default=0)
        grads[k] = m.value
        label = m.label
    diff = float((grads[1] - grads[micro_batches]).abs().max())
    return AccumulationResult(model, batch_size, micro_batches, peaks, acts, diff, float(grads[1].abs().max()), label)


def exercise_accumulation_activations(acc: AccumulationResult) -> Exercise:
    k = acc.micro_batches
    return Exercise(
        f"One batch of {acc.batch} kept at most {format_bytes(acc.activations[1])} of activations. With {k} "
        f"micro-batches of {acc.batch // k}, roughly what fraction of that is kept at once?",
        expected=lambda: round(acc.activations[k] / acc.activations[1], 2),
        explain="Each micro-batch's backward frees its activations before the next forward: only one "
                "micro-batch's worth is alive at a time, so about 1/k (the exact ratio is measured).",
        unit="", rel_tol=0.15, hint="How many micro-batches' activations exist at the same moment?")
