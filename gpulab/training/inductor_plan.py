"""What inductor itself plans to hold for a model under ``torch.compile``, without generating code.

The loop's ``compile`` recipe compiles through inductor's own front end
(``torch._inductor.compile_fx.compile_fx``: its decompositions, its joint-graph passes and its
``partition_fn``, the min-cut partitioner that chooses what the forward saves for backward) and
replaces its last stage, ``inner_compile`` (``compile_fx_inner``: code generation), by two things:

* **the plan**: each graph lowered as ``codegen_and_compile`` lowers it (``view_to_reshape``, fake
  tensor propagation, ``_recursive_post_grad_passes``, ``GraphLowering.run``) and scheduled
  (``GraphLowering._update_scheduler``: ``Scheduler`` fuses the nodes into kernels and, with
  ``config.reorder_for_peak_memory``, orders them by ``memory.reorder_for_peak_memory``); then the
  buffers' lifetimes in that order, as ``torch._inductor.memory.compute_memory_timeline`` reads
  them for ``estimate_peak_memory``: what a fused kernel computes inside is never allocated, each
  buffer lives from its kernel to its last reader, a graph output is never freed, and a graph input
  that is not a parameter (``utils.is_nonfreeable_buffers``: the backward's saved activations) is
  counted from the start and freed after its last reader. Two things the wrapper does that those
  lifetimes leave out are added: a kernel that writes its output into an input dying there
  (``inplace_updates``: ``SchedulerNode.decide_inplace_update``, the wrapper's ``# reuse`` line)
  allocates nothing, and the tangents are freed after their last reader too (the wrapper's
  ``del tangents_N``; ``is_nonfreeable_buffers`` keeps them). The lowering runs with the run's
  dispatch modes off (its tracker would count the plan's own fake tensors), once per graph, when
  the plan is first read (``InductorPlans.plan``): an answer that never reads it pays nothing;
* **the run**: the same partitioned graph run op by op (as the ``aot_eager`` backends run theirs)
  under the tracker, each call's window on the timeline kept (``InductorPlans.calls``). Every
  intermediate is allocated there, so the run's peak is an upper bound of inductor's.

AOTAutograd's cache is off for this backend: its key leaves ``inner_compile`` out, so graphs real
inductor compiled before would come back as inductor's code and never be planned.

``planned_peak`` puts them together: the tracker's timeline outside the compiled calls (parameters,
gradients, optimizer state, the saved activations between the graphs, the eager loss, the
optimizer step), and in each call's window the live bytes before it, less the inputs the plan
frees, plus the plan's own peak.

The target: CUDA when the run follows CUDA's kernels, else the CPU. Lowering for CUDA needs no GPU
except where inductor reads the device's properties: a reduction's lowering asks
``runtime.hints.DeviceProperties.create``, which calls ``CudaInterface.get_device_properties``
(``torch.cuda._lazy_init``: "Found no NVIDIA driver on your system"). Without a driver
``card_properties`` answers those calls for the card the run follows: its compute capability, and
``STOOD_IN`` for the rest (they size a split reduction's partial results: a few KiB); and
``Scheduler.create_backend`` asks ``utils._triton.has_triton`` (cached from its first call, which
found no CUDA device) before it makes the Triton scheduling that decides fusions: asked afresh.

NB: extern kernels' own workspaces (cuBLAS, cuDNN) are not buffers of the plan (gpulab adds
cuBLAS's apart); a buffer's bytes are its numel times its dtype's size, rounded to the caching
allocator's 512-byte blocks on CUDA as the tracker rounds; a multi-output kernel's buffer is
allocated as one block.
"""
from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch

from gpulab.formulas import cuda_rounded_bytes

__all__ = ["GraphPlan", "InductorPlans", "STOOD_IN", "card_properties", "plan_graph", "planned_peak"]

# What a CUDA lowering reads from the device beyond its compute capability, answered without a
# driver (``card_properties``). NB: an H100 SXM's figures (132 SMs: NVIDIA's H100 datasheet; the
# per-SM limits are every card's since sm70, CUDA C Programming Guide, "Compute Capabilities").
STOOD_IN = {"multi_processor_count": 132, "regs_per_multiprocessor": 65536, "max_threads_per_multi_processor": 2048,
            "max_threads_per_block": 1024, "warp_size": 32}


@dataclass(frozen=True)
class GraphPlan:
    """One compiled graph as inductor plans it: its buffers in its kernels' order."""
    kind: str                  # "forward", "backward" or "inference"
    device: str                # the device type it was lowered for: "cuda" or "cpu"
    kernels: int               # scheduler nodes after fusion (kernels and extern calls)
    ops: int                   # the graph's ATen ops before lowering
    # (bytes allocated, bytes freed, first step, last step; -1: never freed) per buffer, inputs
    # the plan frees first (they are live when the graph starts)
    buffers: tuple[tuple[int, int, int, int], ...]
    freeable_inputs: int       # how many of ``buffers`` are inputs

    def peak(self, rounded: bool = False) -> int:
        """The plan's peak, from the graph's start (its freeable inputs included), as
        ``memory.peak_memory_from_buf_info_list`` adds it up; ``rounded``: each buffer in 512-byte blocks."""
        size = cuda_rounded_bytes if rounded else (lambda n: n)
        delta = [0] * (self.kernels + 2)
        for alloc, free, start, end in self.buffers:
            delta[start] += size(alloc) if alloc else 0
            if end != -1:
                delta[end + 1] -= size(free) if free else 0
        best = live = 0
        for d in delta:
            live += d
            best = max(best, live)
        return best

    def input_bytes(self, rounded: bool = False) -> int:
        """The freeable inputs' bytes (live before the graph runs)."""
        size = cuda_rounded_bytes if rounded else (lambda n: n)
        return sum(size(a) for a, _, _, _ in self.buffers[:self.freeable_inputs] if a)

    def output_bytes(self, rounded: bool = False) -> int:
        """What the graph returns and never frees (the forward's saved activations, the gradients)."""
        size = cuda_rounded_bytes if rounded else (lambda n: n)
        return sum(size(a) for a, _, _, end in self.buffers[self.freeable_inputs:] if end == -1 and a)


@contextlib.contextmanager
def card_properties(capability: tuple[int, int]) -> Iterator[None]:
    """Answer what inductor asks a CUDA device (``CudaInterface``, ``torch.cuda``'s properties) for
    a card of ``capability`` with ``STOOD_IN``, for the duration: only where no driver is present."""
    from torch._dynamo.device_interface import CudaInterface
    props = types.SimpleNamespace(name=f"sm{capability[0]}{capability[1]} (stood in)", major=capability[0],
                                  minor=capability[1], total_memory=0, gcnArchName="", **STOOD_IN)
    answers = {"get_device_properties": lambda device=None: props,
               "get_compute_capability": lambda device=None: capability[0] * 10 + capability[1],
               "is_available": lambda: True, "device_count": lambda: 1}
    from torch._inductor import scheduler
    from torch._inductor.runtime.hints import DeviceProperties
    from torch.utils._triton import has_triton
    with contextlib.ExitStack() as stack:
        DeviceProperties.create.cache_clear()   # (cached per device: the card's, then the real device's again)
        stack.callback(DeviceProperties.create.cache_clear)
        # has_triton is cached from its first call, made without the stand-in: asked afresh
        stack.enter_context(mock.patch.object(scheduler, "has_triton", has_triton.__wrapped__))
        for name, fn in answers.items():
            stack.enter_context(mock.patch.object(CudaInterface, name, staticmethod(fn)))
        stack.enter_context(mock.patch.object(CudaInterface.Worker, "get_device_properties",
                                              staticmethod(answers["get_device_properties"])))
        for name, fn in (("get_device_properties", answers["get_device_properties"]),
                         ("get_device_capability", lambda device=None: capability), ("is_available", lambda: True),
                         ("device_count", lambda: 1), ("current_device", lambda: 0)):
            stack.enter_context(mock.patch.object(torch.cuda, name, fn))
        yield


def plan_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str, device: str,
               capability: tuple[int, int] = (8, 0)) -> GraphPlan:
    """Lower and schedule ``gm`` (an AOTAutograd graph, as ``inner_compile`` receives it) for
    ``device`` ("cuda" or "cpu") on fake tensors of the inputs' shapes, and read its buffers."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():   # the run's modes (its tracker) never see the plan's own fake tensors
        return _plan_graph(gm, example_inputs, kind, device, capability)


def _plan_graph(gm, example_inputs, kind, device, capability) -> GraphPlan:
    from torch._inductor import config, memory
    from torch._inductor.compile_fx import _recursive_post_grad_passes, _recursive_record_original_output_strides
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import is_nonfreeable_buffers
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.utils._ordered_set import OrderedSet

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                  if isinstance(t, torch.Tensor) else t for t in example_inputs]
    g = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))   # the run keeps the graph it was given
    for old, new in zip(gm.graph.nodes, g.graph.nodes):
        new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
    target = torch.device(device)
    swap = lambda a: target if isinstance(a, torch.device) and a.type != device else a
    for node in g.graph.nodes:   # factories traced on the run's device (arange, full, inductor_seeds...) make the target's
        if node.op == "call_function":
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    g.recompile()
    ops = sum(1 for n in g.graph.nodes if n.op == "call_function")
    stand_in = card_properties(capability) if device == "cuda" and not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with stand_in, DebugContext(), config.patch(fx_graph_cache=False), torch.no_grad():
        view_to_reshape(g)
        FakeTensorProp(g, mode).propagate_dont_convert_inputs(*inputs)
        _recursive_record_original_output_strides(g)
        with V.set_fake_mode(mode):
            _recursive_post_grad_passes(g, is_inference=kind == "inference")
            graph = GraphLowering(g, example_inputs=inputs, is_inference=kind == "inference",
                                  is_backward=kind == "backward")
            with V.set_graph_handler(graph), mode:
                graph.run(*inputs)
                graph._update_scheduler()
                nodes = graph.scheduler.nodes
                outputs = OrderedSet(graph.get_output_names())
                # the tangents too: estimate_peak_memory holds them (utils.is_nonfreeable_buffers), but
                # the wrapper frees them after their last reader (its ``del tangents_N``) and autograd
                # holds no other reference to a gradient it hands over
                held = lambda dep: not dep.name.startswith("tangents") and is_nonfreeable_buffers(dep)  # noqa: E731
                with mock.patch.object(memory, "is_nonfreeable_buffers", held):
                    freeable = memory.get_freeable_input_buf(nodes, OrderedSet(graph.graph_inputs.keys()))
                memory.prepare_planning_info(nodes, graph.scheduler.name_to_buf, graph.scheduler.name_to_fused_node,
                                             OrderedSet(graph.graph_inputs.keys()), outputs)
                infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
                sizes = {b.buffer.get_name(): [b.size_alloc, b.size_free] for b in infos
                         if not isinstance(b.buffer, memory.FreeableInputBuffer)}
                for into, out in inplace_updates(graph, nodes):
                    if into in sizes and out in sizes:   # the output takes the input's storage: neither allocates nor frees
                        sizes[out] = [0, sizes[into][1]]
                        sizes[into][1] = 0
    inputs_first = sorted(infos, key=lambda b: not isinstance(b.buffer, memory.FreeableInputBuffer))
    return GraphPlan(kind, device, len(nodes), ops,
                     tuple((*sizes.get(b.buffer.get_name(), (b.size_alloc, b.size_free)), b.start_step, b.end_step)
                           for b in inputs_first),
                     sum(isinstance(b.buffer, memory.FreeableInputBuffer) for b in infos))


def inplace_updates(graph: Any, nodes: Sequence[Any]) -> list[tuple[str, str]]:
    """(input, output) buffer pairs whose kernel writes the output into the input's storage, in the
    kernels' order: ``SchedulerNode.decide_inplace_update``'s conditions (torch/_inductor/scheduler.py),
    which the wrapper then codegens as a ``ReuseLine`` (``codegen_inplace_reuse``): with
    ``config.inplace_buffers`` on a backend that has ``BackendFeature.INPLACE_BUFFERS``, a scheduler
    node's output (allocated by it, aliasing nothing, mutating nothing) takes an input buffer made by a
    kernel of this graph (``wrapper.can_reuse``: not a graph input, not removed, not taken already)
    whose one remaining use is this node, reading it where it writes (``NodeUser.can_inplace``), the
    same device, dtype and storage size (``wrapper.can_match_buffer_size``), read at one index inside
    the fused kernel. ``estimate_peak_memory``'s lifetimes leave this out: both buffers live at that
    kernel there."""
    from torch._inductor import config, ir
    from torch._inductor.codegen.common import BackendFeature
    from torch._inductor.codegen.wrapper import can_match_buffer_size
    from torch._inductor.scheduler import NopKernelSchedulerNode, SchedulerNode

    if not config.inplace_buffers:
        return []
    sched = graph.scheduler
    step = {sub.get_name(): i for i, n in enumerate(nodes) for sub in n.get_nodes()}
    never = (graph.removed_buffers | graph.constants.keys() | graph.never_reuse_buffers
             | graph.never_reuse_but_free_buffers | getattr(graph, "torchbind_constants", {}).keys())
    taken: set[str] = set()
    pairs = []

    def one_index(buf, fused) -> bool:   # decide_inplace_update's single_index_in_fused_node
        deps = set()
        for user in buf.users:
            if user.node.get_name() in sched.name_to_fused_node and sched.get_fused_node(user.node) is fused:
                deps |= {d for d in user.node.read_writes.reads_and_writes() if d.name == buf.get_name()}
                if len(deps) > 1:
                    return False
        return True

    for i, kernel in enumerate(nodes):
        for sub in kernel.get_nodes():
            if not isinstance(sub, SchedulerNode) or not graph.has_feature(sub.get_device(), BackendFeature.INPLACE_BUFFERS):
                continue
            for buf in sub.get_outputs():
                node = buf.node
                if (not node.should_allocate() or node.get_inputs_that_alias_output() or node.get_mutation_names()
                        or buf.get_name() in graph.removed_buffers):
                    continue
                for read in sub.read_writes.reads:
                    src = sched.name_to_buf.get(read.name)
                    if (src is None or src.node is None or read.name in never or read.name in taken
                            or read.name in graph.graph_inputs or isinstance(src.defining_op, NopKernelSchedulerNode)):
                        continue
                    left = [u for u in src.users if u.node.get_name() not in sub.ancestors
                            and step.get(u.node.get_name(), len(nodes)) >= i]
                    layout = src.node.get_output_spec()
                    if (len(left) == 1 and left[0].can_inplace and left[0].node is sub
                            and not isinstance(layout, (ir.NoneLayout, ir.MultiOutputLayout, ir.MutationLayoutSHOULDREMOVE))
                            and not (src.defining_op is not None
                                     and isinstance(src.defining_op.node, (ir.FallbackKernel, ir.MultiOutput))
                                     and src.node.get_inputs_that_alias_output())
                            and can_match_buffer_size(src.node, node) and one_index(src, sched.get_fused_node(sub))):
                        taken.add(read.name)
                        pairs.append((read.name, buf.get_name()))
                        break
    return pairs


@dataclass
class InductorPlans:
    """The compiled graphs' plans (``graphs``) and each call of one on the run's timeline
    (``calls``: graph index, the tracker's event count when it began and when it returned)."""
    device: str                               # lowered for: "cuda" or "cpu"
    capability: tuple[int, int] = (8, 0)      # the card whose kernels a CUDA plan follows
    mark: Callable[[], int] = lambda: 0       # the tracker's event count (RunContext.mark)
    graphs: list[GraphPlan] = field(default_factory=list)
    calls: list[tuple[int, int, int]] = field(default_factory=list)
    _pending: list[Callable[[], GraphPlan]] = field(default_factory=list, repr=False)

    def backend(self) -> Callable:
        """``torch.compile``'s backend: inductor's ``compile_fx``, its code generation replaced, and
        AOTAutograd's cache off for it (``functorch.config.enable_autograd_cache``): its key leaves
        ``inner_compile`` out, so a graph that real inductor compiled before (in this process or
        on this disk) would come back as inductor's code, never planned."""
        from torch._inductor.compile_fx import compile_fx

        def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=self._inner)
        return backend

    def _inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs) -> Callable:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        index = len(self._pending)
        # planned when first read (``plan``): a run whose answer never reads it (fit's searches) pays
        # nothing for lowering; the tracing context AOTAutograd compiled it in is entered again then
        context = torch._guards.TracingContext.try_get()

        def lower() -> GraphPlan:
            with torch._guards.tracing(context) if context is not None else contextlib.nullcontext():
                return plan_graph(gm, example_inputs, kind, self.device, self.capability)
        self._pending.append(lower)
        from torch._functorch.aot_autograd import make_boxed_func
        run = make_boxed_func(gm.forward)

        def call(args):
            start = self.mark()
            out = run(args)
            self.calls.append((index, start, self.mark()))
            return out
        call._boxed_call = True
        return call

    def plan(self) -> list[GraphPlan]:
        """Each compiled graph's plan (``graphs``), lowered now for those not yet lowered."""
        while len(self.graphs) < len(self._pending):
            self.graphs.append(self._pending[len(self.graphs)]())
        return self.graphs

    def as_dict(self, rounded: bool) -> dict[str, Any]:
        return {"device": self.device, "graphs": [
            {"kind": p.kind, "ops": p.ops, "kernels": p.kernels, "peak_bytes": p.peak(rounded),
             "input_bytes": p.input_bytes(rounded), "output_bytes": p.output_bytes(rounded)} for p in self.plan()]}


def planned_peak(events: Sequence[Any], totals: Sequence[int], plans: InductorPlans, rounded: bool,
                 start: int = 0, end: int | None = None) -> int:
    """The peak of live bytes over the tracker's events whose index is in [start, end) (``events``
    with ``totals``, the live bytes after each), each compiled call's window replaced by its plan:
    the live bytes before the call, less the inputs the plan frees, plus the plan's peak."""
    graphs = plans.plan()
    windows = [(a, b, graphs[g]) for g, a, b in plans.calls if a >= start and (end is None or b <= end)]
    inside = lambda i: any(a <= i < b for a, b, _ in windows)
    best = 0
    for e, live in zip(events, totals):
        if e.index < start or (end is not None and e.index >= end):
            continue
        if not inside(e.index):
            best = max(best, live)
    for a, b, plan in windows:
        live_before = 0
        for e, live in zip(events, totals):
            if e.index >= a:
                break
            live_before = live
        best = max(best, live_before - plan.input_bytes(rounded) + plan.peak(rounded))
    return best
