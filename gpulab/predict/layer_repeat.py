"""Exact at any depth: a deep stack's training timeline built from fake runs of a few blocks.

A transformer's blocks are alike, so a step of N blocks makes the same storages, in the same order,
as a step of k blocks, with one block's events repeated at a few places (its forward, its
backward, and its share of each optimizer loop). From fake runs with k, k+1 and k+2 blocks this
module learns where those places are and how each repeated event refers to the others, then lays
the N-block timeline out event for event, which the allocator simulator replays as it replays a
run's:

1. **Where.** The k-block timeline aligns with the (k+1)-block one by insertions only (events
   compared by kind, bytes, category, phase, and module with its block numbers taken out:
   ``difflib.SequenceMatcher``); the inserted runs are the *groups*. The (k+2)-block timeline must
   hold each group twice, at the same places.
2. **Which storage.** A free (or resize) refers to the storage an alloc made. A repeated event's
   storage is found by a *rule* learned from the (k+2)-block run, where each group appears twice:
   the same copy (a block's own temporaries), the mirrored copy (what a block's forward saves, its
   backward frees: backward runs the blocks in reverse), the previous or next copy (what passes from
   block to block: the hidden state, its gradient), or an event of the k-block run.
3. **Checked.** The rules must rebuild both the (k+1)- and the (k+2)-block timelines exactly
   (every event, every storage); otherwise there is no layout, and the caller runs the full depth
   and says so.

The layout at N blocks takes its bytes from the k- and (k+1)-block runs *at the same batch*
(``expand``), so one learned layout serves every batch of a ``gpulab fit`` search.

``GPULAB_LAYER_REPEAT=0`` in the environment switches it off (every run at full depth: for comparing).

A tensor-parallel rank's step (DTensor on the fake process group, with or without sequence
parallelism, alone or as a pipeline stage) repeats so too, because ``training.tensor_parallel``
splits the model module by module in the model's order: split projection by projection over all
layers (the plan's order), each layer's setup events would sit in as many places as the plan has
entries, and no placement found explained them all.

A pipeline's stages hold the same layers with other ends (the first the embedding, the last the norm,
head and loss, the others a received activation): a layout learned on one stage is moved onto another
stage's runs of k and k+1 blocks (``transfer``) and taken, as a layout learned at another batch is,
where it rebuilds that stage's (k+1)-block run exactly; that stage then makes no (k+2)-block run.

Dense layers before the experts (DeepSeek's ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``
when they are the first ones) are a prefix that every small run holds. Layers that repeat every few
(Gemma-2's sliding and global layers, period 2; Gemma-3's five local to one global, period 6; a
mixture of experts every K layers) repeat by periods (``Pattern``): a block is one period, the small
runs have prefix + 1, 2 and 3 periods (plus the layers the depth leaves past its last whole period).
Where a period's layers make alike events (the parameters of a sliding and of a global layer), an
inserted run can sit at several layer boundaries, and the runs of setup, forward, backward, the
optimizer and teardown must agree on which layers are the new period: ``_linked`` places them by
the storages they share before the search below. A periodic stack is laid out where it pays: each
batch's two small runs hold at most half its layers (Gemma-3-1B's 26 layers from runs of 8 and 14
measured as slow as the full depth). A config whose layers do not repeat so (``mlp_only_layers``
past the first layers, checkpointing every K-th layer, a period too long for the depth) is run at
full depth, and ``not_repeatable`` says why, in the answer's ``layers``.
"""
from __future__ import annotations

import bisect
import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gpulab.measure.records import Event, StorageRecord, TrackingResult
from gpulab.models.workload import Workload
from gpulab.predict.layer_pattern import (BASE_BLOCKS, MIN_REPEAT_DEPTH, Pattern, block_pattern, not_repeatable,
                                          with_depth, workload_with_depth)

__all__ = ["BASE_BLOCKS", "Deep", "DepthLayout", "MAX_EVENTS", "MIN_REPEAT_DEPTH", "Pattern", "block_pattern", "learn",
           "not_repeatable", "same_timeline", "transfer",
           "with_depth", "workload_with_depth"]

MAX_EVENTS = 4_000_000   # a laid-out timeline longer than this is refused (memory: about 1 KiB an event)

_DIGITS = re.compile(r"\d+")
# Events are made field by field (dataclasses.replace costs 10 times more) while Event has these fields
_EVENT_FIELDS = [f.name for f in dataclasses.fields(Event)] == ["index", "kind", "sid", "nbytes", "delta", "device",
                                                                "phase", "module", "time"]


class Deep:
    """A deep stack's step at any batch, laid out from fake runs of a few blocks.

    A block is one layer, or one period of layers where they repeat every few (``Pattern``: Gemma's
    sliding and global layers), after a prefix that is not repeated (DeepSeek's dense layers).
    ``run(workload, batch, fresh)`` makes one fake run (the caller's: its recipe, dtype, card and
    cache; ``fresh``: not reused). ``at(batch)`` runs k and k+1 blocks at that batch (and k+2 once,
    to learn the layout) and lays out the full depth; None when the layout cannot be learned or does
    not hold at that batch (``why`` then says why, and the caller runs the full depth)."""

    def __init__(self, w: Workload, run: Callable[[Workload, int, bool], TrackingResult], k: int | None = None):
        self.depth = getattr(w.config, w.facts.depth_field)
        pattern = block_pattern(w.config, min_depth=0, facts=w.facts)
        self.pattern = pattern if isinstance(pattern, Pattern) else Pattern()
        p = self.pattern.period
        self.k = k = self.pattern.blocks if k is None else k
        # the k-block run: the prefix, k periods and what is left of a period at the end
        self.depths = tuple(self.pattern.prefix + (k + j) * p + (self.depth - self.pattern.prefix) % p for j in range(3))
        self.copies = (self.depth - self.depths[0]) // p   # blocks laid out past the k-block run
        self._run = run
        self._small = {n: workload_with_depth(w, n) for n in self.depths}
        self.layouts: list[DepthLayout] = []   # learned, each serving the batches whose runs it rebuilds
        # learned on the other stages of a pipeline (the same layers, other ends): each tried (``transfer``)
        # before a layout is learned here
        self.peers: list[DepthLayout] = []
        self.transferred = False   # a layout here came from another stage's (``transfer``)
        self.why = pattern if isinstance(pattern, str) else ""
        self.runs = 0

    def _small_run(self, j: int, batch: int, fresh: bool = False) -> TrackingResult:
        """The run with k + j blocks."""
        self.runs += 1
        return self._run(self._small[self.depths[j]], batch, fresh)

    def at(self, batch: int, fresh: bool = False) -> TrackingResult | None:
        """The full depth at ``batch`` (``fresh``: its small runs made again, not reused). A layout
        learned at another batch serves when it rebuilds this batch's (k+1)-block run exactly; else
        one is learned here (batch 1's size-1 dimensions can make other copies than larger batches)."""
        if self.why:
            return None
        base, more = self._small_run(0, batch, fresh), self._small_run(1, batch, fresh)
        layout = next((lay for lay in self.layouts if same_timeline(lay.expand(base, more, 1), more)), None)
        if layout is None:   # another pipeline stage's, moved onto these runs where it rebuilds them
            layout = next((moved for lay in self.peers for moved in [transfer(lay, base, more)] if moved), None)
            if layout is not None:
                self.layouts.append(layout)
                self.transferred = True
        if layout is None:
            layout, base = self._learn(base, more, batch, fresh)
            if layout is None:
                return None
        self._check_size(layout)
        return layout.expand(base, more, self.copies)

    def _learn(self, base: TrackingResult, more: TrackingResult, batch: int, fresh: bool):
        deeper = self._small_run(2, batch, fresh)
        learned = learn(base, more, deeper, self.k)
        if isinstance(learned, str):
            # a process's first build can make a few storages once (peft's adapters): the first
            # small run again, now built like the others
            base = self._small_run(0, batch, True)
            learned = learn(base, more, deeper, self.k)
        if isinstance(learned, str):
            self.why = learned if not self.layouts else f"at batch {batch}: {learned}"
            return None, base
        self.layouts.append(learned)
        self.peers.append(learned)
        return learned, base

    def _check_size(self, layout: DepthLayout) -> None:
        per_block = sum(e - s for _, s, e in layout.groups)
        events = layout.n_base + self.copies * per_block
        if events > MAX_EVENTS:
            p = self.pattern.period
            raise ValueError(f"{self.depth:,} layers make a timeline of {events:,} events (about "
                             f"{per_block // p:,} a layer), more than gpulab replays ({MAX_EVENTS:,}); ask for at "
                             f"most {self.depths[0] + p * ((MAX_EVENTS - layout.n_base) // max(1, per_block)):,} layers")

    @property
    def layout(self) -> DepthLayout | None:
        """The first layout learned (None before any, or when none could be)."""
        return self.layouts[0] if self.layouts else None

    def describe(self) -> str:
        """What the answer's timelines are, in a sentence."""
        if self.layout is None:
            return f"all {self.depth} layers run (layer repeat not used: {self.why or 'not tried'})"
        a, b, c = self.depths
        if self.pattern.period == 1 and not self.pattern.prefix:
            text = (f"{self.depth} layers laid out from fake runs of {a} and {b} layers (each block's "
                    f"events repeated, learned with {c} layers; exact where the blocks are alike)")
        else:
            block = f"each period of {self.pattern.period} layers" if self.pattern.period > 1 else "each layer"
            prefix = self.pattern.prefix
            past = (f" past the first {prefix} layers" if prefix > 1 else " past the first layer") if prefix else ""
            text = (f"{self.depth} layers laid out from fake runs of {a} and {b} layers (the events of {block}"
                    f"{past} repeated, learned with {c} layers; {self.pattern.why}; exact where the layers repeat so)")
        if self.transferred:   # (``transfer``) no run of c layers of this stage's own
            text += (f"; the layout learned on another pipeline stage's runs of the same layers, moved onto this "
                     f"stage's and rebuilding its {b}-layer run exactly")
        return text + (f"; all {self.depth} layers run {self.why}" if self.why else "")


def _sig(t: TrackingResult, e: Event) -> tuple:
    r = t.records[e.sid]
    return (e.kind, e.nbytes, r.category.value, e.phase, e.device, _DIGITS.sub("#", e.module))


def _stage_sig(t: TrackingResult, e: Event) -> tuple:
    """``_sig`` with the module named from inside the stage's model: its root class left out, and the
    decoder's attribute (``model.``) that the last stage keeps around its layers and the others do not
    (``training.pipeline.pipeline_stage``), so the same layer's events compare alike on every stage."""
    kind, nbytes, category, phase, device, module = _sig(t, e)
    inner = module.partition(".")[2]
    return kind, nbytes, category, phase, device, "" if inner == "model" else inner[6:] if inner.startswith("model.") else inner


def _stage_sigs(k_run: TrackingResult, k1_run: TrackingResult, groups) -> tuple:
    """(the k-block run's events, each group's in the (k+1)-block run), as ``_stage_sig`` names them."""
    return (tuple(_stage_sig(k_run, e) for e in k_run.events),
            tuple(tuple(_stage_sig(k1_run, e) for e in k1_run.events[s:e]) for _, s, e in groups))


def _allocs(t: TrackingResult) -> dict[int, int] | None:
    """sid -> index of its alloc event (None when a storage has none in the timeline)."""
    first: dict[int, int] = {}
    for i, e in enumerate(t.events):
        if e.kind == "alloc":
            first.setdefault(e.sid, i)
        elif e.sid not in first:
            return None
    return first


def _diff_points(sa: list, sb: list) -> list[tuple[int, int]] | None:
    """b as a with insertions only: [(insertion point in a, length)], or None."""
    points = []
    for tag, i1, _, j1, j2 in difflib.SequenceMatcher(None, sa, sb, autojunk=False).get_opcodes():
        if tag == "insert":
            points.append((i1, j2 - j1))
        elif tag != "equal":
            return None
    return points


def _place(sa: list, sb: list, points: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int, int]]] | None:
    """(matched: a's event i is b's event matched[i]; groups: (point, start, end in b)) for b = a with
    ``points``' insertions, or None when b's events are not a's there."""
    matched, groups, j, i = [], [], 0, 0
    for point, n in points:
        while i < point:
            matched.append(j)
            i, j = i + 1, j + 1
        groups.append((point, j, j + n))
        j += n
    matched.extend(range(j, j + len(sa) - i))
    if j + len(sa) - i != len(sb) or any(sa[x] != sb[y] for x, y in enumerate(matched)):
        return None
    return matched, groups


def _split_loops(points: list[tuple[int, int]], sb: list) -> list[tuple[int, int]]:
    """An inserted run of allocations followed by one of frees is two loops that met (a foreach
    op's outputs made block by block, then freed in reverse): split, so each can take its place."""
    out, offset = [], 0
    for point, n in points:
        kinds = [sb[offset + point + j][0] for j in range(n)]
        cut = kinds.index("free") if "free" in kinds else n
        if 0 < cut < n and all(k == "alloc" for k in kinds[:cut]) and all(k == "free" for k in kinds[cut:]):
            out += [(point, cut), (point, n - cut)]
        else:
            out.append((point, n))
        offset += n
    return out


def _slides(sb: list, group: tuple[int, int, int], lo: int, hi: int) -> tuple[int, int]:
    """How far each way (in a's events) one inserted run can move and leave b's events the same:
    where alike blocks follow each other, it could sit at any of their boundaries."""
    _, start, end = group
    back = 0
    while start - back > lo and sb[start - back - 1] == sb[end - back - 1]:
        back += 1
    ahead = 0
    while end + ahead < hi and sb[start + ahead] == sb[end + ahead]:
        ahead += 1
    return back, ahead


# A position in a laid-out timeline: ("M", i) is the k-block run's event i; ("G", g, c, o) is event o of
# group g's copy c (1-based). A rule says where a free's storage was made, as a function of (c, m).
Pos = tuple


@dataclass(frozen=True)
class DepthLayout:
    """Where one block's events repeat in the k-block timeline, and which storage each event
    refers to: learned by ``learn``, laid out at any depth by ``expand``."""
    k: int
    n_base: int                                  # events in the k-block run
    groups: tuple[tuple[int, int, int], ...]     # (insertion point, start, end in the (k+1)-block run)
    matched: tuple[int, ...] = field(repr=False)  # k-block event i -> its index in the (k+1)-block run
    rules: dict = field(repr=False)               # position (copy 1 for groups) -> rule
    # the k-block run's events and each group's, as ``_sig`` names them: what ``transfer`` aligns another
    # pipeline stage's runs with (empty: not kept)
    sigs: tuple = field(default=(), repr=False, compare=False)

    def positions(self, m: int):
        """Every position of the timeline with ``m`` repeated blocks, in order."""
        at: dict[int, list[int]] = {}
        for g, (point, _, _) in enumerate(self.groups):
            at.setdefault(point, []).append(g)
        for i in range(self.n_base + 1):
            for g in at.get(i, ()):
                n = self.groups[g][2] - self.groups[g][1]
                for c in range(1, m + 1):
                    for o in range(n):
                        yield ("G", g, c, o)
            if i < self.n_base:
                yield ("M", i)

    def _target(self, pos: Pos, m: int) -> Pos:
        """The position of the alloc that the free or resize at ``pos`` refers to, with ``m`` copies."""
        g, o, a, b, gamma, past = self.rules[pos if pos[0] == "M" else ("G", pos[1], 1, pos[3])]
        f = a * (pos[2] if pos[0] == "G" else 0) + b * m + gamma
        return ("G", g, f, o) if g is not None and 1 <= f <= m else past

    def expand(self, base: TrackingResult, one_more: TrackingResult, m: int) -> TrackingResult | None:
        """The timeline with ``m`` more blocks than ``base`` (the k-block run), its bytes from
        ``base`` and ``one_more`` (the (k+1)-block run at the same batch). None when these runs do not
        have the learned shape (then the caller runs the full depth).

        The positions (``positions``) are walked by their index in the laid-out timeline: a k-block
        event ``i`` sits at ``at_m[i]``, copy ``c`` of group ``g``'s event ``o`` at
        ``at_g[g] + (c - 1)·size + o``; each free finds its storage there (``_target``'s rule)."""
        sizes = [e - s for _, s, e in self.groups]
        if len(base.events) != self.n_base or len(one_more.events) != len(self.matched) + sum(sizes):
            return None
        at: dict[int, list[int]] = {}
        for g, (point, _, _) in enumerate(self.groups):
            at.setdefault(point, []).append(g)
        at_g, at_m, n = [0] * len(self.groups), [0] * self.n_base, 0
        for i in range(self.n_base + 1):   # the order of ``positions``
            for g in at.get(i, ()):
                at_g[g], n = n, n + m * sizes[g]
            if i < self.n_base:
                at_m[i], n = n, n + 1

        def index(pos: Pos | None) -> int | None:
            if pos is None:
                return None
            if pos[0] == "M":
                return at_m[pos[1]]
            return at_g[pos[1]] + (pos[2] - 1) * sizes[pos[1]] + pos[3]
        # (event, its run's records, where its storage was made: its own index for an alloc) in order
        picked: list = [None] * n
        for i, e in enumerate(base.events):
            picked[at_m[i]] = (e, base.records, at_m[i] if e.kind == "alloc" else index(self._target(("M", i), m)))
        for g, (_, start, _) in enumerate(self.groups):
            for o, e in enumerate(one_more.events[start:start + sizes[g]]):
                for c in range(1, m + 1):
                    j = at_g[g] + (c - 1) * sizes[g] + o
                    picked[j] = (e, one_more.records, j if e.kind == "alloc" else index(self._target(("G", g, c, o), m)))
        sids: dict[int, int] = {}
        records: dict[int, StorageRecord] = {}
        for j, (e, made, _) in enumerate(picked):
            if e.kind == "alloc":
                sid = sids[j] = len(sids)
                records[sid] = record = made[e.sid].copied()
                record.sid, record.freed = sid, None
        events = []
        for j, (e, _, where) in enumerate(picked):   # Event's fields in order: index, kind, sid, then as they are
            sid = sids.get(where)
            if sid is None:
                return None
            if e.kind == "alloc":   # the record's own alloc and free indices, this timeline's
                records[sid].created = j
            elif e.kind == "free":
                records[sid].freed = j
            events.append(Event(j, e.kind, sid, e.nbytes, e.delta, e.device, e.phase, e.module, e.time)
                          if _EVENT_FIELDS else dataclasses.replace(e, index=j, sid=sid))
        return TrackingResult.build(records, events, device=base.device, rounded=base.rounded)


def _refs(t: TrackingResult, matched: list[int], groups: list[tuple[int, int, int]], size: list[int]) -> dict | None:
    """position -> position of the alloc it refers to, in run ``t`` (``size[g]``: one copy's length)."""
    allocs = _allocs(t)
    if allocs is None:
        return None
    where: dict[int, Pos] = {j: ("M", i) for i, j in enumerate(matched)}
    for g, (_, start, end) in enumerate(groups):
        for j in range(start, end):
            where[j] = ("G", g, (j - start) // size[g] + 1, (j - start) % size[g])
    return {where[j]: where[allocs[e.sid]] for j, e in enumerate(t.events) if e.kind != "alloc"}


# A repeated event refers to copy f(c, m) = alpha·c + beta·m + gamma of a group's event (c its own copy,
# 0 for a k-block event; m the copies laid out), and to a k-block event where f falls outside 1..m:
# alpha = 1, beta = 0 is the same block (gamma = 0) or the one before it (gamma = -1: what one block
# hands the next); alpha = -1, beta = 1 mirrors it (backward visits the blocks in reverse). Simplest first.
_COPY_RULES = tuple((a, b, g) for g in (0, -1, 1, 2, -2) for b in (0, 1) for a in (1, -1, 0))


def _rule(observed: list[tuple[int, int, Pos]]) -> tuple | None:
    """The rule that explains every observation (m, c, the alloc position referred to) of one event:
    (group, offset, alpha, beta, gamma, the k-block event past the copies), or None."""
    if any(t is None for _, _, t in observed):
        return None
    groups = {(t[1], t[3]) for _, _, t in observed if t[0] == "G"}
    fixed = {t for _, _, t in observed if t[0] == "M"}
    if len(groups) > 1 or len(fixed) > 1:
        return None
    g, o = next(iter(groups)) if groups else (None, None)
    past = next(iter(fixed)) if fixed else None
    if g is None:
        return (None, None, 0, 0, 0, past)
    for a, b, gamma in _COPY_RULES:
        if all((t[0] == "G" and t[2] == a * c + b * m + gamma) or
               (t[0] == "M" and not 1 <= a * c + b * m + gamma <= m) for m, c, t in observed):
            return (g, o, a, b, gamma, past)
    return None


def learn(k_run: TrackingResult, k1_run: TrackingResult, k2_run: TrackingResult, k: int = BASE_BLOCKS) -> DepthLayout | str:
    """The layout that rebuilds the (k+1)- and (k+2)-block runs from the k-block run, or a
    sentence saying why there is none.

    Where an inserted run could sit at several block boundaries (a loop over alike blocks), each
    boundary is tried, one run at a time, keeping the placement under which the most events have a
    rule (a forward loop's new block goes after the first block, a loop that visits the blocks in
    reverse puts it before); a run that cannot move may be two loops' runs that met, and is tried
    cut in two."""
    sa, s1, s2 = ([_sig(t, e) for e in t.events] for t in (k_run, k1_run, k2_run))
    state = _diff_points(sa, s1)
    if state is None or _place(sa, s1, state) is None:
        return "one more block changed the timeline by more than insertions"
    state = _split_loops(state, s1)

    def attempt(points):
        return _learn_at(points, k_run, k1_run, k2_run, sa, s1, s2, k)

    def worse(found) -> int:
        return len(found) if isinstance(found, set) else (-1 if isinstance(found, DepthLayout) else 1 << 30)
    result = attempt(state)
    if isinstance(result, set):   # runs of alike layers placed apart: by the storages they share
        linked = _linked(sa, s1, state, k1_run)
        found = attempt(linked) if linked != state else result
        if worse(found) < worse(result):
            state, result = linked, found
    for _ in range(4):
        if not isinstance(result, set):
            return result
        for g in sorted(result, reverse=True):
            if g >= len(state):
                continue
            options = [state[:g] + [(c, state[g][1])] + state[g + 1:] for c in _candidates(sa, s1, state, g)]
            if len(options) == 1:
                options += _cuts(sa, s1, state, g)
            tried = [(worse(found), n, option, found) for n, option in enumerate(options)
                     for found in [attempt(option)] if _place(sa, s1, option) is not None]
            if tried:
                _, _, state, result = min(tried, key=lambda t: t[:2])
            if not isinstance(result, set):
                break
    if isinstance(result, set):
        return f"no placement of the repeated blocks explains every event (groups {sorted(result)})"
    return result


def _candidates(sa: list, sb: list, points: list[tuple[int, int]], g: int) -> list[int]:
    """The insertion points where run ``g`` could sit with b's events unchanged, a block apart."""
    placed = _place(sa, sb, points)[1]
    point, n = points[g]
    lo = placed[g - 1][2] if g else 0
    hi = placed[g + 1][1] if g + 1 < len(points) else len(sb)
    back, ahead = _slides(sb, placed[g], lo, hi)
    ends = {point - back + t * n for t in range((back + ahead) // n + 1)}
    return sorted(ends | {point + ahead - t * n for t in range((back + ahead) // n + 1)})


def _cuts(sa: list, sb: list, points: list[tuple[int, int]], g: int) -> list[list[tuple[int, int]]]:
    """Run ``g`` cut in two at every place, each piece at each of its candidate points."""
    point, n = points[g]
    out = []
    for cut in range(1, n):
        split = points[:g] + [(point, cut), (point, n - cut)] + points[g + 1:]
        if _place(sa, sb, split) is None:
            continue
        for a in _candidates(sa, sb, split, g):
            moved = split[:g] + [(a, cut)] + split[g + 1:]
            if _place(sa, sb, moved) is None:
                continue
            for b in _candidates(sa, sb, moved, g + 1):
                out.append(moved[:g + 1] + [(b, n - cut)] + moved[g + 2:])
    return out


def _learn_at(points, k_run, k1_run, k2_run, sa, s1, s2, k) -> "DepthLayout | str | set[int]":
    """The layout with the repeated runs at ``points``; a sentence when there is none; the groups
    whose events no rule explains when the placement is wrong."""
    one = _place(sa, s1, points)
    two = _place(sa, s2, [(p, 2 * n) for p, n in points])
    if one is None or two is None:
        return "two more blocks did not repeat one more block's events at the same places"
    (m1, g1), (m2, g2) = one, two
    size = [n for _, n in points]
    r1 = _refs(k1_run, m1, g1, size)
    r2 = _refs(k2_run, m2, g2, size)
    if r1 is None or r2 is None:
        return "a storage is freed without its allocation in the timeline"
    rules: dict = {}
    failing: set[int] = set()
    for pos, target in r1.items():
        if pos[0] == "M":
            rule = _rule([(1, 0, target), (2, 0, r2.get(pos))])
        else:
            rule = _rule([(1, 1, target), (2, 1, r2.get(pos)), (2, 2, r2.get(("G", pos[1], 2, pos[3])))])
        if rule is None:
            involved = {x[1] for x in (pos, target) if x[0] == "G"}
            if not involved:   # k-block events that refer to different storages: a group between them is misplaced
                seen = [x[1] for x in (pos, target, r2.get(pos)) if x is not None and x[0] == "M"]
                involved = {g for g, (p, _) in enumerate(points) if min(seen) <= p <= max(seen)}
            if not involved:
                return f"no repeat rule explains event {pos} of the deeper runs"
            failing |= involved
        rules[pos] = rule
    if failing:
        return failing
    layout = DepthLayout(k, len(k_run.events), tuple(g1), tuple(m1), rules, _stage_sigs(k_run, k1_run, g1))
    for m, run in ((1, k1_run), (2, k2_run)):
        if not same_timeline(layout.expand(k_run, k1_run, m), run):
            return f"the learned layout does not rebuild the {k + m}-block run"
    return layout


def same_timeline(a: TrackingResult | None, b: TrackingResult) -> bool:
    """Equal event for event (kind, bytes, category, phase, device), with the same storages (sids
    matched by their first appearance)."""
    if a is None or len(a.events) != len(b.events):
        return False
    names_a: dict[int, int] = {}
    names_b: dict[int, int] = {}
    for x, y in zip(a.events, b.events):
        if (x.kind, x.nbytes, x.phase, x.device) != (y.kind, y.nbytes, y.phase, y.device):
            return False
        if a.records[x.sid].category != b.records[y.sid].category:
            return False
        if names_a.setdefault(x.sid, len(names_a)) != names_b.setdefault(y.sid, len(names_b)):
            return False
    return True


def _linked(sa: list, sb: list, points: list[tuple[int, int]], run: TrackingResult) -> list[tuple[int, int]]:
    """The inserted runs moved where the storages they share say they belong (``run``: b's run).
    Where layers repeat in periods, a run of alike events (parameters, gradients, a cache's tensors)
    can sit at several layer boundaries, and all runs must agree on which layers are the new
    period. The largest run goes where most of its frees find their allocations inside it; then the
    run most linked to those placed (its frees refer to their allocations, theirs to it) goes where
    it is most linked; a run linked to none starts anew as the largest did."""
    allocs, placed = _allocs(run), _place(sa, sb, points)
    if allocs is None or placed is None:
        return points
    placed = placed[1]
    refs = np.array([allocs[e.sid] if e.kind != "alloc" else -1 for e in run.events])
    has = refs >= 0
    inside = np.zeros(len(sb), dtype=bool)     # b's events in the runs placed so far
    shift, own, todo = [0] * len(points), [], set(range(len(points)))
    for g, (_, start, end) in enumerate(placed):
        lo = placed[g - 1][2] if g else 0
        hi = placed[g + 1][1] if g + 1 < len(placed) else len(sb)
        back, ahead = _slides(sb, placed[g], lo, hi)
        x = np.zeros(back + ahead + 2, dtype=np.int64)   # frees inside the run when it starts at start - back + i
        j = np.arange(start - back, end + ahead)
        t = refs[j]
        keep = t >= start - back
        first = np.maximum(j[keep] - (end - start) + 1, start - back) - (start - back)
        last = np.minimum(t[keep], start + ahead) - (start - back)
        ok = first <= last
        np.add.at(x, first[ok], 1)
        np.add.at(x, last[ok] + 1, -1)
        own.append((start, end, back, np.cumsum(x)[:back + ahead + 1]))
    while todo:
        referred = np.bincount(refs[inside & has], minlength=len(sb))
        w = np.concatenate([[0], np.cumsum((has & inside[np.where(has, refs, 0)]) + referred)])
        best = None
        for g in todo:
            start, end, back, mine = own[g]
            cross = w[end - back:end - back + len(mine)] - w[start - back:start - back + len(mine)]
            d = max(range(len(mine)), key=lambda i: (cross[i], mine[i], -abs(i - back)))
            key = (cross[d] > 0, cross[d], end - start if cross[d] == 0 else 0, -g)
            best = max(best, (key, g, d - back)) if best else (key, g, d - back)
        _, g, d = best
        shift[g] = d
        todo.discard(g)
        inside[own[g][0] + d:own[g][1] + d] = True
    return [(p + shift[g], n) for g, (p, n) in enumerate(points)]


def transfer(layout: DepthLayout, base: TrackingResult, more: TrackingResult) -> DepthLayout | None:
    """``layout``, learned on another pipeline stage's runs of the same layers, moved onto this stage's
    k-block run ``base`` and (k+1)-block run ``more`` (at the same batch); None where it does not fit them.

    A stage's runs are another stage's with its own ends (the first stage's embedding, the last's norm,
    head and loss, a received activation in place of the embedding's): the k-block runs are aligned
    (``difflib.SequenceMatcher`` on the events as ``learn`` compares them, modules named from inside the
    stage: ``_stage_sig``); each repeated group goes between the shared events either side of its
    insertion point, where this run's (k+1)-block run holds the group's events. Each event keeps the other
    stage's rule where that rule names the storage the event has in ``more``, a k-block event it refers to
    moved with the alignment; an event of this stage's own (or whose rule names another storage here)
    takes the storage it has in ``more``: a k-block one for good, or a repeated one's last or first copy,
    whichever alone frees every storage at most once with two copies (``_frees_alike``; neither or both:
    None, and the caller learns this stage's layout from its own (k+2)-block run). Taken as a layout
    learned at another batch is (``Deep.at``): only where it rebuilds ``more`` exactly, event for event
    and storage for storage."""
    if not layout.sigs:
        return None
    then, group_sigs = layout.sigs
    sa = [_stage_sig(base, e) for e in base.events]
    s1 = [_stage_sig(more, e) for e in more.events]
    here: dict[int, int] = {}   # the other run's k-block event -> this one's
    for tag, i1, i2, j1, _ in difflib.SequenceMatcher(None, then, sa, autojunk=False).get_opcodes():
        if tag == "equal":
            here.update((i1 + d, j1 + d) for d in range(i2 - i1))
    shared = sorted(here)
    points, offset = [], 0
    for (point, start, end), sigs in zip(layout.groups, group_sigs):
        cut = bisect.bisect_left(shared, point)   # between the shared events either side of its point
        lo = here[shared[cut - 1]] + 1 if cut else 0
        hi = here[shared[cut]] if cut < len(shared) else len(sa)
        at = next((c for c in range(lo, hi + 1) if tuple(s1[offset + c:offset + c + end - start]) == sigs), hi)
        points.append((at, end - start))
        offset += end - start
    placed = _place(sa, s1, points)
    if placed is None:
        return None
    matched, groups = placed
    if tuple(tuple(s1[s:e]) for _, s, e in groups) != tuple(group_sigs):
        return None
    r1 = _refs(more, matched, groups, [n for _, n in points])
    if r1 is None:
        return None
    back = {j: i for i, j in here.items()}

    def moved(rule: tuple | None) -> tuple | None:
        if rule is None or rule[5] is None:
            return rule
        past = here.get(rule[5][1])
        return None if past is None else (*rule[:5], ("M", past))
    rules: dict = {}
    own: dict = {}   # this stage's own events: on a repeated storage, its (group, offset); else None
    for pos, target in r1.items():
        if pos[0] == "G":   # a layer's event: the other stage's rule, which must name this run's storage
            rule = moved(layout.rules.get(pos))
            if rule is None or _at_one(rule, pos[2]) != target:
                return None
            rules[pos] = rule
            continue
        rule = moved(layout.rules.get(("M", back[pos[1]]))) if pos[1] in back else None
        if rule is not None and _at_one(rule, 0) == target:
            rules[pos] = rule
        elif target[0] == "M":   # this stage's own event, on a k-block storage
            rules[pos], own[pos] = (None, None, 0, 0, 0, target), None
        else:
            own[pos] = (target[1], target[3])
    # which copy an own event takes, the last or the first (one in ``more``): the one under which, with two
    # copies, every storage is freed at most once and every copy of a storage as ``more`` frees its one
    fits = []
    for b, gamma in ((1, 0), (0, 1)) if any(own.values()) else ((1, 0),):
        trial = DepthLayout(layout.k, len(sa), tuple(groups), tuple(matched),
                            {**rules, **{pos: (*at, 0, b, gamma, None) for pos, at in own.items() if at}},
                            (tuple(sa), group_sigs))
        if same_timeline(trial.expand(base, more, 1), more) and (not own or _frees_alike(trial.expand(base, more, 2), more)):
            fits.append(trial)
    return fits[0] if len(fits) == 1 or fits and not any(own.values()) else None


def _at_one(rule: tuple, c: int) -> Pos:
    """The position ``rule`` names for copy ``c`` (0: a k-block event) with one copy (``DepthLayout._target``)."""
    g, o, a, b, gamma, past = rule
    f = a * c + b + gamma
    return ("G", g, f, o) if g is not None and f == 1 else past


def _frees_alike(t: TrackingResult | None, more: TrackingResult) -> bool:
    """Whether ``t``, a layout's timeline with two copies, frees no storage twice and frees no more
    storages beyond those ``more`` (its one-copy timeline) frees than the copy added makes."""
    if t is None:
        return False
    freed: dict[int, int] = {}
    for e in t.events:
        if e.kind == "free":
            freed[e.sid] = freed.get(e.sid, 0) + 1
    if any(n > 1 for n in freed.values()):
        return False
    made = sum(1 for e in t.events if e.kind == "alloc") - sum(1 for e in more.events if e.kind == "alloc")
    gone = len(freed) - sum(1 for e in more.events if e.kind == "free")
    return 0 <= gone <= made
