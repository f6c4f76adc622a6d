"""Which layouts of ``gpus`` GPUs ``gpulab fit --fastest --gpus N`` tries, and which it leaves out, saying why.

The layouts a practitioner would try for one recipe on N GPUs, as ``gpulab.Layout``'s mesh
(torchtitan's ``ParallelDims``: ``dp_replicate × dp_shard × cp × tp × pp = gpus``, EP borrowing
from ``dp_shard × cp × tp``):

* ``tp`` in {1, 2, 4, 8} dividing N, within one node (``card_speeds.Links.gpus_per_node``: a TP
  group's all-gathers sit on the critical path, so it stays on NVLink), with sequence parallelism as
  torchtitan's TP plan applies it; the model's own checks (heads, KV heads, the sequence) refuse the rest.
* ``pp`` dividing N / tp and the layers, as many stages as there are layers at most; the 1F1B
  schedule with ``microbatches_per_stage × pp`` micro-batches (1F1B holds at most ``pp`` in flight,
  so its memory does not grow with more).
* ``ep`` (a mixture of experts only): powers of 2 dividing the experts, with a sharding strategy.
* the data parallelism over what is left, ``dp = N / (tp × pp)``: ddp, zero2, zero3, fsdp2 (one
  layout where dp is 1).

Left out, each with its reason in the answer, before any fake run:

* context parallelism: the rank's run is its sequence shard with local attention; ring attention's
  K/V exchange and the attention FLOPs against the other shards are not in it (``training.context_parallel``),
  so its time would be too small;
* HSDP (fsdp2 with replicas of shards): ``predict.plan_time`` times data parallelism as one group;
* zero1: **dominated** in gpulab's own model by zero2, which moves the same bytes with the same overlap
  (``plan_time.OVERLAP``) and holds no more memory (its gradients sharded too);
* GPipe: dominated by 1F1B (the same bubble, ``plan_time.BUBBLE_SOURCE``, and every micro-batch
  in flight); interleaved 1F1B: its runs are the rank's whole schedule at full depth (too slow to try
  beside the others);
* a layout whose rank's weights, gradients and optimizer state alone, by formula (a lower bound:
  ``memory_floor``), pass the card's usable memory: it cannot fit whatever its batch;
* the cost bound: the layouts of at most ``MAX_SHAPES`` rank shapes (tp, pp, ep) are tried, fewest
  model-parallel GPUs first; the others are named with the flags that try them (``--tp``, ``--pp``).
  Not a claim that they are slower: a bound on the answer's time, said in the answer.

Pure: no torch at import, no fake run; ``predict.fastest`` answers what is left.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulab.options import SHARDED_STRATEGIES

__all__ = ["LayoutChoices", "MAX_SHAPES", "Skipped", "TP_DEGREES", "layout_choices", "memory_floor"]

TP_DEGREES = (1, 2, 4, 8)
MAX_SHAPES = 4   # rank shapes (tp, pp, ep) tried by default: each costs its own fake runs
STRATEGIES_TRIED = ("ddp", "zero2", "zero3", "fsdp2")


@dataclass(frozen=True)
class Skipped:
    """A layout (or a family of them) not tried, and why; ``memory``: left out by its memory floor;
    ``shape``: its rank shape (tp, pp, ep), where it is one layout."""
    what: str
    why: str
    memory: bool = False
    shape: tuple[int, int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "why": self.why, "memory": self.memory}


@dataclass
class LayoutChoices:
    """The layouts to try and those left out: ``considered`` counts both (families counted once)."""
    layouts: list = field(default_factory=list)       # gpulab.Layout, each checked
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def considered(self) -> int:
        return len(self.layouts) + len(self.skipped)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_floor(n_params: int, itemsize: int, state_multiplier: int, layout: Any, full_training: bool,
                 no_gradients: bool = False) -> int:
    """A lower bound on one rank's bytes: its share of the weights, and (``full_training``) of the
    gradients (itemsize each) and optimizer state (``state_multiplier`` × the weights, torch's
    optimizers keeping it in the parameters' dtype), each divided as the layout divides it. A rank
    of ``tp`` × ``pp`` × ``ep`` holds at least 1/(tp·pp·ep) of every parameter (the largest stage
    holds at least the mean; EP divides only the experts); ddp keeps all of the rest, zero1 shards
    the state, zero2 the gradients too, zero3/fsdp2 everything over ``dp_shard × cp``. Activations,
    temporaries and DeepSpeed's fp32 master copy are left out: a floor. ``no_gradients``: the optimizer
    steps each parameter in backward, so no step keeps a whole set of gradients: none counted."""
    w = n_params * itemsize / (layout.tp * layout.pp * layout.ep)
    if not full_training:
        return int(w)
    s = layout.sharded_over if layout.strategy in SHARDED_STRATEGIES else 1
    st = layout.strategy or "ddp"
    grads = 0 if no_gradients else w / s if st in ("zero2", "zero3", "fsdp2") else w
    state = state_multiplier * w / s if st in SHARDED_STRATEGIES else state_multiplier * w
    weights = w / s if st in ("zero3", "fsdp2") else w
    return int(weights + grads + state)


def layout_choices(gpus: int, gpus_per_node: int, layers: int | None, experts: int | None, recipe: Any,
                   check: Any, floor: Any, usable: int, pinned: dict[str, Any] | None = None,
                   microbatches_per_stage: int = 4, max_shapes: int | None = MAX_SHAPES) -> LayoutChoices:
    """The layouts of ``gpus`` GPUs to try for ``recipe`` (a ``gpulab.Recipe``), and those left out
    (module docstring). ``layers``: the model's depth (None: no pipeline); ``experts``: its routed
    experts (None: dense, no EP). ``check(layout)`` refuses (ValueError) what the model or recipe
    cannot take; ``floor(layout)`` is ``memory_floor`` for it, compared with ``usable`` bytes.
    ``pinned``: degrees the user fixed (``tp``, ``pp``, ``ep``, ``strategy``), tried alone. ``max_shapes``:
    the cost bound, the rank shapes tried (``_bounded``; None: all)."""
    from gpulab.options import Layout
    pinned = dict(pinned or {})
    out = LayoutChoices()
    if pinned.get("cp", 1) > 1:
        raise ValueError("--fastest does not rank context-parallel layouts: the rank's run has ring attention's "
                         "sequence shard without its K/V exchange, so its time would be too small; leave out --cp")
    out.skipped.append(Skipped("context parallelism (cp > 1)", "the rank's run is its sequence shard with local "
                               "attention: ring attention's K/V exchange and the attention against the other shards "
                               "are not timed, so its step would look too fast"))
    out.skipped.append(Skipped("HSDP (fsdp2, replicas of shards)", "plan_time times the data-parallel group as one: "
                               "the replicas' all-reduce is not costed apart"))
    out.skipped.append(Skipped("interleaved 1F1B", "its fake runs are the rank's whole schedule at full depth, too "
                               "slow beside the others; GPipe: dominated by 1F1B (same bubble, more micro-batches in "
                               "flight)"))
    tps = [pinned["tp"]] if "tp" in pinned else [t for t in TP_DEGREES if gpus % t == 0]
    for t in list(tps):
        if t > gpus_per_node:
            tps.remove(t)
            out.skipped.append(Skipped(f"tp {t}", f"larger than a node of {gpus_per_node} GPUs: its collectives on "
                                                  f"the critical path would cross the network"))
    strategies = [pinned["strategy"]] if "strategy" in pinned else list(STRATEGIES_TRIED)
    if "strategy" not in pinned:
        out.skipped.append(Skipped("zero1", "dominated by zero2 in gpulab's time model: the same bytes moved with "
                                            "the same overlap, and no more memory (gradients sharded too)"))
    for t in tps:
        rest = gpus // t
        if "pp" in pinned:
            pps = [pinned["pp"]]
        else:
            pps = [p for p in _divisors(rest) if (p == 1 if layers is None else layers % p == 0)]
        for p in pps:
            dp = rest // p
            eps = [pinned["ep"]] if "ep" in pinned else (
                [e for e in _divisors(experts) if e & (e - 1) == 0 and gpus % e == 0] if experts else [1])
            for e in eps:
                for s in (strategies if dp > 1 else [None]):
                    if e > 1 and s not in SHARDED_STRATEGIES:
                        continue   # EP borrows dp_shard: only a sharding strategy has it (options._mesh_dp)
                    pipe = {"microbatches": microbatches_per_stage * p} if p > 1 else {}
                    what = f"{s or 'one replica'} over dp {dp}, tp {t}, pp {p}" + (f", ep {e}" if e > 1 else "")
                    try:
                        lay = Layout(gpus=gpus, strategy=s, tp=t, sequence_parallel=t > 1, pp=p, ep=e, **pipe)
                        check(lay)
                    except ValueError as why:
                        out.skipped.append(Skipped(what, str(why), shape=(t, p, e)))
                        continue
                    low = floor(lay)
                    if low > usable:
                        out.skipped.append(Skipped(what, f"its weights, gradients and optimizer state alone take at "
                                                         f"least {low / 2 ** 30:,.2f} GiB a rank (formula, a floor), "
                                                         f"more than the {usable / 2 ** 30:,.2f} GiB usable", True,
                                                    (t, p, e)))
                        continue
                    out.layouts.append(lay)
    return _bounded(out, max_shapes)


def _bounded(out: LayoutChoices, max_shapes: int | None) -> LayoutChoices:
    """The layouts of the first ``max_shapes`` rank shapes (tp, pp, ep), fewest model-parallel GPUs first
    (tp · pp · ep, then fewer stages: no bubble before a bubble), each shape's strategies kept together
    (they share its fake runs); the other shapes' layouts left out, named, as the cost bound."""
    shapes: dict[tuple[int, int, int], list] = {}
    for lay in out.layouts:
        shapes.setdefault((lay.tp, lay.pp, lay.ep), []).append(lay)
    order = sorted(shapes, key=lambda k: (k[0] * k[1] * k[2], k[1], k[2]))
    if max_shapes is None or len(order) <= max_shapes:
        out.layouts = [lay for k in order for lay in shapes[k]]
        return out
    out.layouts = [lay for k in order[:max_shapes] for lay in shapes[k]]
    for t, p, e in order[max_shapes:]:
        out.skipped.append(Skipped(f"tp {t}, pp {p}" + (f", ep {e}" if e > 1 else "") + f" ({len(shapes[t, p, e])} "
                                   f"layout{'s' if len(shapes[t, p, e]) > 1 else ''})",
                                   f"not tried, the cost bound: {max_shapes} rank shapes, fewest model-parallel GPUs "
                                   f"first (each shape costs its own fake runs); fix it with --tp {t} --pp {p}"
                                   + (f" --ep {e}" if e > 1 else "") + " to try it"))
    return out
