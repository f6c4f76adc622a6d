"""Which layers of a transformer repeat, and its config at another depth: ``block_pattern`` reads
the per-layer lists and the mixture-of-experts fields of a config (a prefix of dense layers, then every
``period`` layers alike), ``not_repeatable`` says why a step cannot be built from a few blocks, and
``with_depth`` / ``workload_with_depth`` cut a config or workload to a few layers for the small runs
that ``predict.layer_repeat`` lays the full depth out from.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from gpulab.models import hf_configs
from gpulab.models.registry import build_in_place
from gpulab.models.workload import Workload

__all__ = ["BASE_BLOCKS", "MIN_REPEAT_DEPTH", "Pattern", "block_pattern", "not_repeatable", "with_depth",
           "workload_with_depth"]

# k: one block. A fake run's cost is its ops, so the small runs cost about their layers: runs of 1, 2 and 3 layers
# hold 6 where runs of 2, 3 and 4 (the k = 2 this module started with, a first and a last block apart) hold 9.
# The checks are the same: a layout that does not rebuild the deeper runs exactly is refused, and the caller
# then runs the full depth
BASE_BLOCKS = 1
MIN_REPEAT_DEPTH = 12   # shallower stacks run at full depth (measured when the runs were of 2-4 layers: 7 of them cost about 3 full-depth runs)


def not_repeatable(config: Any, checkpointing: Any = False, facts: "hf_configs.ConfigFacts | None" = None) -> str | None:
    """Why this model's step cannot be built from a few blocks (None: it can). ``facts``: what its
    workload read off ``config`` when it was resolved (``Workload.facts``), read again without them."""
    if os.environ.get("GPULAB_LAYER_REPEAT") == "0":
        return "switched off (GPULAB_LAYER_REPEAT=0)"
    if config is None:
        return "not a transformer config (no stack of identical blocks to repeat)"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder (two stacks)"
    if (facts.depth_field if facts is not None else hf_configs.depth_field(config)) is None:
        return "the config names no number of layers"
    if isinstance(checkpointing, str) and checkpointing.startswith("every-"):
        return f"checkpointing {checkpointing} treats layers differently"
    pattern = block_pattern(config, facts=facts)
    return pattern if isinstance(pattern, str) else None


@dataclass(frozen=True)
class Pattern:
    """How a stack's layers repeat: the first ``prefix`` layers apart (DeepSeek's dense layers),
    then every ``period`` layers alike (Gemma-2's sliding and global layers: 2; Gemma-3's five
    local to one global: 6; a mixture of experts every K layers: K). ``why`` names the fields."""
    prefix: int = 0
    period: int = 1
    why: str = ""

    @property
    def blocks(self) -> int:
        """k, the periods in the smallest run: ``BASE_BLOCKS``, one layer where every layer is alike, one
        period where they repeat every few (two periods of Gemma-3's six layers would cost 12 layers a run;
        the (k+2)-period run that the layout is learned from holds a first, a middle and a last period)."""
        return BASE_BLOCKS if self.period == 1 else 1

    def depths(self, depth: int) -> tuple[int, int, int]:
        """The small runs' depths for a stack of ``depth``: the prefix, k, k+1 and k+2 periods, and what
        the depth leaves past its last whole period."""
        rest = (depth - self.prefix) % self.period
        return tuple(self.prefix + (self.blocks + j) * self.period + rest for j in range(3))


# Config fields that make some layers differ from the rest: a mixture of experts every K layers
# (the layer index decides, so the layers repeat every K), or dense layers before the experts.


def block_pattern(config: Any, min_depth: int = MIN_REPEAT_DEPTH,
                  facts: "hf_configs.ConfigFacts | None" = None) -> Pattern | str:
    """The ``Pattern`` of the config's layers, or why its layers do not repeat in a few blocks
    (or number fewer than ``min_depth``). Read from the per-layer lists (``layer_types``) and the
    mixture-of-experts fields; the fake runs then check it: a layout that does not rebuild the
    deeper runs is refused (``learn``)."""
    depth = getattr(config, facts.depth_field if facts is not None else hf_configs.depth_field(config))
    if depth < min_depth:
        return f"{depth} layers: the full depth is as cheap"
    dense = getattr(config, "first_k_dense_replace", None)
    # one dense layer too: a run of one block (BASE_BLOCKS) would hold the dense layer alone, and one more block
    # would add a layer unlike it (measured: no layout learned, every run at full depth)
    prefix = dense if isinstance(dense, int) and dense >= 1 else 0
    period, why = 1, [f"the first {prefix} layers dense" if prefix > 1 else "the first layer dense"] if prefix else []
    only = getattr(config, "mlp_only_layers", None)
    if only not in (None, [], ()):
        if list(only) != list(range(len(only))):
            return f"its layers are not all alike (mlp_only_layers: dense layers at {only})"
        prefix, why = max(prefix, len(only)), why + [f"mlp_only_layers: the first {len(only)} layers dense"]
    for name in hf_configs.MOE_EVERY_K:
        step = getattr(config, name, None)
        if isinstance(step, int) and step > 1:
            period, why = math.lcm(period, step), why + [f"{name} {step}"]
        elif step not in (None, 0, 1):
            return f"its layers are not all alike ({name}: {step!r})"
    lists = dict(facts.layer_lists) if facts is not None else hf_configs.per_layer_lists(config, depth)
    for name, value in lists.items():
        cycle = _cycle(value, prefix)
        period, why = math.lcm(period, cycle), why + [f"{name} every {cycle}: " + ", ".join(map(str, value[prefix:prefix + cycle]))]
    pattern = Pattern(prefix, period, "; ".join(why))
    a, b, c = pattern.depths(depth)
    if c >= depth:
        return (f"its layers are not all alike ({pattern.why}) and {depth} layers hold too few "
                f"{'periods of ' + str(period) if period > 1 else 'layers past the first ' + str(prefix)} to repeat")
    if min_depth and period > 1 and a + b > depth / 2:   # measured: Gemma-3-1B's 26 layers from 8 and 14, as slow as 26
        return (f"its layers are not all alike ({pattern.why}): each batch's runs of {a} and {b} layers cost about "
                f"what {depth} layers do, so all {depth} run")
    return pattern


def _cycle(values: Any, start: int) -> int:
    """The shortest period of ``values`` from ``start`` on (its length past ``start`` when none shorter)."""
    reprs = [repr(v) for v in values[start:]]
    return next(p for p in range(1, len(reprs) + 1) if all(reprs[i] == reprs[i + p] for i in range(len(reprs) - p)))


def with_depth(config: Any, depth: int) -> Any:
    """A copy of ``config`` with ``depth`` layers (per-layer lists cut to that length)."""
    attr = hf_configs.depth_field(config)
    full = getattr(config, attr)
    cfg = copy.deepcopy(config)
    setattr(cfg, attr, depth)
    for name, value in vars(cfg).items():
        if isinstance(value, (list, tuple)) and len(value) == full:
            setattr(cfg, name, type(value)(value[:depth]))
    return cfg


def workload_with_depth(w: Workload, depth: int) -> Workload:
    """``w`` (a transformer's workload) with ``depth`` layers, everything else as it is."""
    cfg = with_depth(w.config, depth)

    def build(device, dtype):
        return build_in_place(lambda: hf_configs.build_model(cfg, dtype), device, dtype)
    facts = hf_configs.facts_of(cfg, w.facts.name, w.facts.description, w.facts.source)   # its depth, its lists
    return dataclasses.replace(w, build=build, config=cfg, make=lambda dtype: hf_configs.build_model(cfg, dtype),
                               facts=facts)
