"""Data-parallel strategies measured per rank: plain DDP, ZeRO-1, FSDP2 (ZeRO-3, and ZeRO-2-like
without resharding after forward), each a training step run by :func:`gpulab.distributed.runner.run_distributed`
in W processes; what each rank holds, split into the ZeRO paper's model states and the rest.

What each strategy is, in PyTorch:

* ``ddp``: ``DistributedDataParallel``; every rank holds all parameters, gradients and optimizer
  state, and the reducer's gradient buckets (flat copies of the gradients, all-reduced in
  place), unless ``gradient_as_bucket_view=True`` makes the gradients views of them.
* ``zero1``: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer``; each rank keeps the
  optimizer state of the parameters assigned to it (whole parameters, a greedy partition by
  size, so the shares are near but not exactly 1/N), then broadcasts its updated parameters.
* ``fsdp2``: ``fully_shard`` on every layer and the root (``reshard_after_forward=True``):
  parameters, gradients and optimizer state all sharded (ZeRO-3); each layer's parameters are
  all-gathered just before its forward and its backward and freed right after.
* ``fsdp2-no-reshard``: ``reshard_after_forward=False``: parameters stay gathered from forward
  to the end of backward (ZeRO-2-like: sharded gradients and state, full parameters while
  computing), saving the second all-gather.

FSDP2 shards each parameter along dim 0 with ``torch.chunk``: every rank stores
``ceil(d0 / N) * (rest)`` elements, padding included (``fsdp_shard_numel``).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from gpulab.distributed.runner import DistributedRun, RankContext, RankResult, run_distributed
from gpulab.formulas import cuda_rounded_bytes, zero_bytes_per_device
from gpulab.categories import Category
from gpulab.measure.tracking import TrackingResult
from gpulab.tables import html_table
from gpulab.units import format_bytes

__all__ = [
    "GROUPS", "MODELS", "RankBreakdown", "STRATEGIES", "SmallCNN", "SmallTransformer",
    "StrategyRun", "StrategySpec", "batch", "breakdown", "build", "error_text", "fsdp_shard_numel",
    "groups_of", "live_by_group", "loss_of", "measure_strategies", "measure_strategy",
    "sharding_units", "split_at", "strategy_step", "strategy_steps"
]

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"stage": 0, "title": "DDP (replicated)"},
    "zero1": {"stage": 1, "title": "ZeRO-1 (ZeroRedundancyOptimizer)"},
    "fsdp2-no-reshard": {"stage": 2, "title": "FSDP2, reshard_after_forward=False (ZeRO-2-like)"},
    "fsdp2": {"stage": 3, "title": "FSDP2, reshard_after_forward=True (ZeRO-3)"},
}
MODELS = ("transformer", "cnn")
GROUPS = ("parameters", "gathered parameters", "gradients", "optimizer_state", "activations",
          "communication buffers", "temporaries", "inputs", "buffers")


# ---- models: small, deterministic, built the same on every rank -----------------------------

class SmallTransformer(nn.Module):
    """Token embedding, ``layers`` pre-norm encoder layers (MHA + MLP of 4·width), a head."""

    def __init__(self, width: int = 128, layers: int = 2, vocab: int = 512, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class SmallCNN(nn.Module):
    """Two conv-BN-ReLU-pool blocks of ``width`` and 2·``width`` channels and a classifier."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
                          nn.MaxPool2d(2)),
        ])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(2 * width * 16, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            images = block(images)
        return self.head(images)


def build(model: str, width: int, layers: int = 2) -> nn.Module:
    if model == "transformer":
        return SmallTransformer(width=width, layers=layers)
    if model == "cnn":
        return SmallCNN(width=width)
    raise ValueError(f"model must be one of {', '.join(MODELS)}, not {model!r}")


def sharding_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 wraps one by one (each gathered on its own): the transformer's layers,
    the CNN's blocks; the root takes what is left (embedding, norm, head)."""
    if isinstance(module, SmallTransformer):
        return list(module.layers)
    if isinstance(module, SmallCNN):
        return list(module.blocks)
    return []


def batch(model: str, size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one batch (a rank's own, from its seed)."""
    g = torch.Generator().manual_seed(seed)
    if model == "transformer":
        tokens = torch.randint(0, 512, (size, seq_len), generator=g)
        return tokens, torch.randint(0, 512, (size, seq_len), generator=g)
    return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# ---- the per-rank experiment (runs in the workers) -------------------------------------------

@dataclass(frozen=True)
class StrategySpec:
    strategy: str = "ddp"
    model: str = "transformer"
    width: int = 128
    layers: int = 2
    batch: int = 8
    seq_len: int = 32
    steps: int = 2
    bucket_view: bool = False  # DDP's gradient_as_bucket_view

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, not {self.model!r}")
        for name in ("width", "layers", "batch", "seq_len", "steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)!r}")
        if self.model == "transformer" and self.width % 4:
            raise ValueError(f"the transformer's width must be a multiple of its 4 heads, not {self.width}")


def _wrap(spec: StrategySpec, model: nn.Module, ctx: RankContext):
    if spec.strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DDP(model, device_ids=ids, gradient_as_bucket_view=spec.bucket_view)
        log = _BucketLog(ctx.tracker)
        wrapped.register_comm_hook(log, _seen_bucket_allreduce)
        if spec.strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3), log
        return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3), log
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    reshard = spec.strategy == "fsdp2"
    # the mesh names the rank's device: without one, fully_shard takes CUDA whenever a GPU is
    # present, and moves a gloo run's (CPU) parameters there (seen on an H200)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for unit in sharding_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


@dataclass
class _BucketLog:
    tracker: Any
    sids: set[int] = field(default_factory=set)


def _seen_bucket_allreduce(log: _BucketLog, bucket):
    """DDP's default all-reduce (mean over ranks), noting which storages are its buckets: the
    flat buffers the reducer copies gradients into (they are rebuilt in the order gradients
    arrived after the first step, so they cannot be found by when they were made)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buf = bucket.buffer()
    rec = log.tracker._see(buf, op="ddp_bucket")
    if rec is not None:
        log.sids.add(rec.sid)
    return allreduce_hook(None, bucket)


def strategy_step(ctx: RankContext, spec: StrategySpec) -> dict[str, Any]:
    """Build the model (same seed on every rank), wrap it, run ``spec.steps`` training steps on
    this rank's own batch, and leave the last step's gradients in place (no zero_grad), so that
    the state at the end is parameters + gradients + optimizer state."""
    torch.manual_seed(0)
    with ctx.tracker.phase("setup"):
        model = build(spec.model, spec.width, spec.layers).to(ctx.device)
        shapes = [tuple(p.shape) for p in model.parameters()]
        wrap_start = ctx.mark()
        wrapped, opt, log = _wrap(spec, model, ctx)
        wrap_end = ctx.mark()
    ctx.tracker.register(wrapped, opt)
    steps, losses = [], []
    for i in range(spec.steps):
        x, y = batch(spec.model, spec.batch, spec.seq_len, seed=1000 * i + ctx.rank)
        x, y = ctx.tracker.label(x.to(ctx.device), Category.INPUTS), ctx.tracker.label(y.to(ctx.device), Category.INPUTS)
        start = ctx.mark()
        loss = loss_of(wrapped(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if i < spec.steps - 1:
            opt.zero_grad(set_to_none=True)
        steps.append((start, ctx.mark()))
        del x, y, loss
    state_numel = None
    if spec.strategy == "zero1":  # the parameters whose state this rank keeps
        state_numel = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    return {"shapes": shapes, "wrap": (wrap_start, wrap_end), "steps": steps, "losses": losses,
            "state_numel": state_numel, "param_tensors": len(shapes),
            "bucket_sids": sorted(log.sids) if log else []}


# ---- analysis (in the caller) --------------------------------------------------------------

def fsdp_shard_numel(shapes: list[tuple[int, ...]], world_size: int) -> int:
    """Elements each rank stores for FSDP2's sharded parameters: ``ceil(d0 / N) · rest`` per
    parameter (``torch.chunk`` along dim 0, every shard padded to the first one's size)."""
    total = 0
    for shape in shapes:
        if not shape:
            total += 1
            continue
        total += math.ceil(shape[0] / world_size) * math.prod(shape[1:])
    return total


def _end_index(tracking: TrackingResult, mark: int) -> int:
    """Index into ``tracking.events`` of the last event before tracker position ``mark``."""
    idx = -1
    for i, e in enumerate(tracking.events):
        if e.index >= mark:
            break
        idx = i
    return idx


def _groups(tracking: TrackingResult, buckets: set[int]) -> dict[int, str]:
    """Which of :data:`GROUPS` each storage belongs to. Gathered parameters: the storages FSDP
    resizes (it allocates and frees unsharded parameters with ``UntypedStorage.resize_``).
    Communication buffers: FSDP's all-gather and reduce-scatter buffers (by the op that made
    them) and DDP's gradient buckets (seen by a comm hook, ``buckets``). Everything else keeps the
    tracker's category."""
    resized = {e.sid for e in tracking.events if e.kind == "resize"}
    out: dict[int, str] = {}
    for sid, rec in tracking.records.items():
        if sid in resized:
            out[sid] = "gathered parameters"
        elif rec.category is Category.GRADIENTS:
            out[sid] = rec.category.value  # gradient_as_bucket_view: the bucket *is* the gradients
        elif sid in buckets or rec.op in ("all_gather_copy_in", "chunk_cat"):
            out[sid] = "communication buffers"
        else:
            out[sid] = rec.category.value
    return out


def error_text(measured: int, predicted: int) -> str:
    if predicted == 0:
        return "—" if measured == 0 else "n/a"
    return f"{100 * (measured - predicted) / predicted:+.1f}%"


def _size(tracking: TrackingResult, nbytes: int) -> int:
    return cuda_rounded_bytes(nbytes) if tracking.rounded else nbytes


def groups_of(result: RankResult) -> dict[int, str]:
    """The group of every storage a rank recorded (see :func:`_groups`)."""
    return _groups(result.tracking, set(result.data["bucket_sids"]))


def live_by_group(tracking: TrackingResult, groups: dict[int, str]) -> Iterator[dict[str, int]]:
    """Live bytes per group after each event, in order, replaying the events (a resize sets its
    storage's size). The same dict is updated and yielded each time: copy it to keep it."""
    sizes: dict[int, int] = {}
    live = {g: 0 for g in GROUPS}
    for e in tracking.events:
        new = 0 if e.kind == "free" else _size(tracking, e.nbytes)
        live[groups[e.sid]] += new - sizes.get(e.sid, 0)
        sizes[e.sid] = new
        yield live


def split_at(tracking: TrackingResult, groups: dict[int, str], index: int) -> dict[str, int]:
    """Live bytes per group just after event ``index``."""
    live = {g: 0 for g in GROUPS}
    for live in itertools.islice(live_by_group(tracking, groups), index + 1):
        pass
    return dict(live)


@dataclass
class RankBreakdown:
    """One rank, split into :data:`GROUPS`: at its peak, at the end of the last step (after
    ``optimizer.step()``, gradients kept) and the largest parameter footprint (sharded +
    gathered) on the way."""

    rank: int
    peak_bytes: int
    at_peak: dict[str, int]
    at_end: dict[str, int]
    params_max: int
    gathered_max: int
    state_numel: int | None
    losses: list[float]


def breakdown(result: RankResult) -> RankBreakdown:
    tr = result.tracking
    end = _end_index(tr, result.data["steps"][-1][1])
    groups = groups_of(result)
    at_peak = split_at(tr, groups, tr.peak_index)
    at_end = split_at(tr, groups, end)
    params_max = gathered_max = 0
    for live in live_by_group(tr, groups):
        params_max = max(params_max, live["parameters"] + live["gathered parameters"])
        gathered_max = max(gathered_max, live["gathered parameters"])
    return RankBreakdown(result.rank, tr.peak_bytes, at_peak, at_end, params_max, gathered_max,
                         result.data.get("state_numel"), list(result.data["losses"]))


@dataclass
class StrategyRun:
    """A strategy measured on every rank, and the ZeRO formula it is compared with."""

    spec: StrategySpec
    run: DistributedRun
    ranks: list[RankBreakdown] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.run.world_size

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.run.results[0].data["shapes"])

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.run.results[0].data["shapes"]]

    @property
    def stage(self) -> int:
        return STRATEGIES[self.spec.strategy]["stage"]

    def formula(self) -> dict[str, int]:
        """ZeRO's per-device model states in fp32 Adam form (4 B weights, 4 B gradients,
        K = 8 B of state): parameters, gradients, optimizer state, total."""
        psi, n = self.n_params, self.world_size
        shard = math.ceil(psi / n)
        p = psi * 4 if self.stage < 3 else shard * 4
        g = psi * 4 if self.stage < 2 else shard * 4
        k = psi * 8 if self.stage < 1 else shard * 8
        total = zero_bytes_per_device(psi, n, self.stage, param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8)
        assert total == p + g + k  # one formula, two spellings
        return {"parameters": p, "gradients": g, "optimizer_state": k, "total": total}

    def measured(self, rank: int = 0) -> dict[str, int]:
        """The same terms measured on ``rank`` after the last step (gradients kept), and the
        parameters at their largest during the step (FSDP's gathered copies included)."""
        b = self.ranks[rank]
        out = {"parameters": b.at_end["parameters"], "gradients": b.at_end["gradients"],
               "optimizer_state": b.at_end["optimizer_state"]}
        out["total"] = sum(out.values())
        out["parameters while computing"] = b.params_max
        return out

    def __repr__(self) -> str:
        peaks = ", ".join(format_bytes(b.peak_bytes) for b in self.ranks)
        return f"StrategyRun({self.spec.strategy}, {self.world_size} ranks, peaks {peaks})"

    @property
    def label(self) -> str:
        return (f"measured on this machine in {self.world_size} {self.run.backend} processes "
                f"(torch.distributed), gpulab's tracker in each rank")

    def comparison_rows(self, rank: int = 0) -> list[list[str]]:
        """Formula vs measured, term by term, with the error."""
        f, m = self.formula(), self.measured(rank)
        f["parameters while computing"] = f["parameters"]
        return [[term.replace("_", " "), format_bytes(f[term]), format_bytes(m[term]), error_text(m[term], f[term])]
                for term in ("parameters", "gradients", "optimizer_state", "total", "parameters while computing")]

    def _repr_html_(self) -> str:
        title = STRATEGIES[self.spec.strategy]["title"]
        ranks = html_table(["rank", "peak"] + [g for g in GROUPS if any(b.at_peak[g] for b in self.ranks)],
                           [[b.rank, format_bytes(b.peak_bytes)] + [format_bytes(b.at_peak[g]) for g in GROUPS
                             if any(x.at_peak[g] for x in self.ranks)] for b in self.ranks],
                           caption=f"{title}: each rank at its peak")
        comp = html_table(["model state (rank 0)", f"ZeRO stage {self.stage} formula, fp32 Adam", "measured", "error"],
                          self.comparison_rows(0), caption=self.label)
        return ranks + comp


def measure_strategy(spec: StrategySpec | None = None, world_size: int = 2, *, timeout_s: float = 120.0,
                     **kwargs) -> StrategyRun:
    """Run ``spec`` (or ``StrategySpec(**kwargs)``) on ``world_size`` local processes; raise
    ``RuntimeError`` naming the failed ranks if any failed."""
    spec = spec or StrategySpec(**kwargs)
    run = run_distributed(strategy_step, world_size, args=(spec,), timeout_s=timeout_s).check()
    return StrategyRun(spec, run, [breakdown(r) for r in run.results])


def measure_strategies(specs: list[StrategySpec], world_size: int = 2, *,
                       timeout_s: float | None = None) -> list[StrategyRun]:
    """Each of ``specs`` measured as :func:`measure_strategy` does, one after the other in the
    same ``world_size`` processes: each spec under a tracker of its own, its model built, wrapped,
    trained and freed before the next. Starting processes (each imports torch) costs more than a
    small spec's steps; this starts them once. Raises ``RuntimeError`` naming failed ranks."""
    specs = list(specs)
    if not specs or not all(isinstance(s, StrategySpec) for s in specs):
        raise ValueError("specs must be a non-empty list of StrategySpec")
    timeout_s = timeout_s if timeout_s is not None else 60.0 + 60.0 * len(specs)
    run = run_distributed(strategy_steps, world_size, args=(specs,), timeout_s=timeout_s).check()
    out = []
    for i, spec in enumerate(specs):
        ranks = [RankResult(r.rank, r.data["runs"][i]["tracking"], r.data["runs"][i]["data"],
                            r.data["runs"][i]["seconds"]) for r in run.results]
        sub = DistributedRun(world_size=run.world_size, backend=run.backend, results=ranks,
                             seconds=sum(x.seconds for x in ranks) / len(ranks))
        out.append(StrategyRun(spec, sub, [breakdown(r) for r in ranks]))
    return out


def strategy_steps(ctx: RankContext, specs: list[StrategySpec]) -> dict[str, Any]:
    """:func:`strategy_step` for each spec in turn, each under its own tracker (the run's
    tracker sees them all); returns each spec's tracking and data."""
    import gc
    import time

    from gpulab.measure.tracking import MemoryTracker
    runs = []
    for spec in specs:
        tracker = MemoryTracker()
        t0 = time.perf_counter()
        with tracker:
            data = strategy_step(RankContext(ctx.rank, ctx.world_size, ctx.backend, ctx.device, tracker), spec)
            gc.collect()   # the spec's model, wrapper and optimizer die here, inside its own timeline
        device = str(ctx.device) if ctx.device.type == "cuda" else "cpu"
        runs.append({"tracking": tracker.result(device=device), "data": data,
                     "seconds": time.perf_counter() - t0})
        torch.distributed.barrier()   # every rank done with this spec before the next starts
    return {"runs": runs}
