"""MemoryTracker against an independent count: the storages of tensors the test knows to be
alive (``untyped_storage().nbytes()``, deduplicated by storage), ``p.grad``, ``optimizer.state``,
and weak references that tell when a storage really died."""
import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from gpulab.categories import CATEGORIES, Category
from gpulab.measure.tracking import PHASES, MemoryTracker, TrackingResult


def storage_bytes(*tensors) -> int:
    """Independent live count: one entry per distinct storage (views share one)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr(), st.nbytes()] = st.nbytes()
    return sum(seen.values())


def cats(result: TrackingResult) -> dict[str, int]:
    return dict(result.final_by_category)


def assert_consistent(r: TrackingResult) -> None:
    """peak, the per-category split and the event stream agree with each other."""
    assert sum(r.peak_by_category.values()) == r.peak_bytes
    assert sum(r.final_by_category.values()) == r.final_bytes
    running, peak = 0, 0
    for e, s in zip(r.events, r.series):
        running += e.delta
        assert sum(s.values()) == running
        peak = max(peak, running)
    assert running == r.final_bytes
    assert peak == r.peak_bytes
    if r.peak_index >= 0:
        assert r.series[r.peak_index] == r.peak_by_category
    for c in r.peak_by_category:
        assert r.peak_by_category[c] <= max(s[c] for s in r.series)
    assert set(r.peak_by_category) == {c.value for c in CATEGORIES}


# --- live bytes ------------------------------------------------------------------------------

def test_live_bytes_equal_storages_of_live_tensors():
    with MemoryTracker() as tr:
        a = torch.empty(1000)                      # 4000 B
        view = a.view(10, 100)                     # same storage: counts once
        t = view.t()                               # still the same storage
        c = torch.empty(250, dtype=torch.float64)  # 2000 B
        s = torch.empty(500)[:10]                  # a slice keeps its whole 2000 B storage
        d = torch.empty(300)                       # 1200 B, freed below
        del d
        e = torch.zeros(7, 3, dtype=torch.int16)
        r = tr.result()
    assert r.final_bytes == storage_bytes(a, view, t, c, s, e) == 4000 + 2000 + 2000 + 42
    assert s.numel() * s.element_size() == 40  # what a naive count of the slice would say
    assert r.peak_bytes == 4000 + 2000 + 2000 + 1200
    assert len(r.alive()) == 4
    frees = [ev for ev in r.events if ev.kind == "free"]
    assert [ev.nbytes for ev in frees] == [1200]
    assert_consistent(r)


def test_free_recorded_when_last_reference_dies():
    with MemoryTracker() as tr:
        x = torch.empty(256)
        v = x[1:]
        ref = weakref.ref(x.untyped_storage())
        del x
        assert tr.result().final_bytes == 1024      # the view keeps it alive
        assert not any(ev.kind == "free" for ev in tr.result().events)
        del v
        assert ref() is None
        r = tr.result()
    assert r.final_bytes == 0
    assert [ev.kind for ev in r.events] == ["alloc", "free"]
    assert r.events[-1].delta == -1024
    (rec,) = r.records.values()
    assert rec.freed == 1 and not rec.alive


def test_peak_of_a_known_sequence():
    with MemoryTracker() as tr:
        x = torch.empty(1000)          # 4000
        y = torch.empty(2000)          # 12000
        del x                          # 8000
        z = torch.empty(250)           # 9000
        w = torch.empty(1000)          # 13000: the peak
        del y, w                       # 1000
        r = tr.result()
    assert r.peak_bytes == 13000
    assert r.final_bytes == storage_bytes(z) == 1000
    assert r.peak_by_category["temporaries"] == 13000
    assert sorted(s.nbytes for s in r.live_at(r.peak_index)) == [1000, 4000, 8000]
    assert r.events[r.peak_index].kind == "alloc" and r.events[r.peak_index].nbytes == 4000
    assert_consistent(r)


def test_resize_and_out_are_followed():
    with MemoryTracker() as tr:
        e = torch.empty(0)
        e.resize_(100)
        f = torch.empty(0)
        torch.add(torch.ones(5), 1, out=f)
        r = tr.result()
    assert r.final_bytes == storage_bytes(e, f) == 400 + 20
    assert [ev.kind for ev in r.events].count("resize") == 2
    assert_consistent(r)


def test_round_to_cuda_blocks():
    with MemoryTracker() as tr:
        a, b, c = torch.empty(1), torch.empty(250), torch.empty(512)   # 4, 1000, 2048 B
        r = tr.result(round_to_cuda_blocks=True)
        plain = tr.result()
    assert plain.final_bytes == storage_bytes(a, b, c) == 3052
    assert r.final_bytes == 512 + 1024 + 2048 and r.rounded and not plain.rounded


def test_result_filters_by_device():
    with MemoryTracker() as tr:
        a = torch.empty(100)
        m = torch.empty(10_000, device="meta")
        r_cpu, r_meta, r_default = tr.result("cpu"), tr.result("meta"), tr.result()
    assert r_cpu.final_bytes == 400 and r_meta.final_bytes == 40_000
    assert r_default.device == "meta"   # default: the device with the highest peak
    del a, m


def test_fake_tensors_are_tracked_like_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        with MemoryTracker() as tr:
            a = torch.empty(1000)
            v = a[::2]
            big = torch.empty(10**9)       # 4 GB of nothing: fake tensors hold no data
            del big
            r = tr.result()
    assert r.final_bytes == 4000 and r.peak_bytes == 4000 + 4 * 10**9
    del a, v


def test_nothing_recorded_after_exit_and_hooks_removed():
    with MemoryTracker() as tr:
        torch.empty(10)
    n_events = len(tr.result().events)
    model = nn.Linear(3, 2)
    model(torch.randn(1, 3)).sum().backward()
    assert len(tr.result().events) == n_events
    assert not model.weight._post_accumulate_grad_hooks


def test_label_and_categories_validation():
    with MemoryTracker() as tr:
        x = torch.randn(4, 4)
        assert tr.label(x, "inputs") is x
        with pytest.raises(ValueError):
            tr.label(x, "weights")
        r = tr.result()
    assert cats(r)["inputs"] == 64 and cats(r)["temporaries"] == 0
    assert [rec.category for rec in r.records.values()] == [Category.INPUTS]


# --- categories in a training step ---------------------------------------------------------

def _mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_training_step_categories_exact():
    torch.manual_seed(0)
    with MemoryTracker() as tr:
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = tr.label(torch.randn(16, 64), Category.INPUTS)
        y = tr.label(torch.randint(0, 10, (16,)), "inputs")
        params = list(model.parameters())
        param_bytes = storage_bytes(*params)
        input_bytes = storage_bytes(x, y)

        r = tr.result()
        # a storage's label can arrive after its birth: the parameters are known as such
        # from the model's first forward (or tracker.register(model)); until then they are
        # plain tensors, and the label then applies to their whole life
        assert r.final_bytes == param_bytes + input_bytes
        assert cats(r)["inputs"] == input_bytes

        seen = []
        model[1].register_forward_hook(lambda mod, args, output: seen.append(output))
        out = model(x)                       # the last Linear's output: saved by nothing
        hidden = seen.pop()                  # ReLU saves its output for backward
        loss = out.sum()
        big_ref = weakref.ref(hidden.untyped_storage())
        r = tr.result()
        assert cats(r)["parameters"] == param_bytes == 4 * (64 * 32 + 32 + 32 * 10 + 10)
        assert cats(r)["inputs"] == input_bytes
        # Linear saves its input (x: already an input; hidden: the ReLU output) and its
        # weight (a parameter); ReLU saves its output; sum saves nothing.
        assert cats(r)["activations"] == storage_bytes(hidden) == 16 * 32 * 4
        assert cats(r)["temporaries"] == storage_bytes(out, loss)
        assert cats(r)["gradients"] == 0
        del hidden, out

        loss.backward()
        r = tr.result()
        grads = [p.grad for p in params]
        assert cats(r)["gradients"] == storage_bytes(*grads) == param_bytes
        assert cats(r)["activations"] == 0      # the graph and its saved tensors are gone
        assert big_ref() is None                # ... really gone, not kept by the tracker
        assert cats(r)["temporaries"] == storage_bytes(loss)

        opt.step()
        r = tr.result()
        state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        assert len(state) == 3 * len(params)   # exp_avg, exp_avg_sq, step
        assert cats(r)["optimizer_state"] == storage_bytes(*state) == 2 * param_bytes + 4 * len(params)

        opt.zero_grad(set_to_none=True)
        del loss, x, y, grads
        r = tr.result()
        assert cats(r) == {**{c.value: 0 for c in CATEGORIES}, "parameters": param_bytes,
                           "optimizer_state": storage_bytes(*state)}
        assert r.final_bytes == storage_bytes(*params, *state)
        del state
    full = tr.result()
    assert_consistent(full)
    assert full.peak_bytes >= param_bytes * 4  # params + grads + 2 moments coexisted

    by_op = {}
    for rec in full.records.values():
        by_op.setdefault(rec.op, []).append(rec)
    (relu,) = by_op["relu"]
    assert (relu.category, relu.phase, relu.module, relu.shape) == \
        (Category.ACTIVATIONS, "forward", "Sequential.1", (16, 32))
    first_linear_out = [rec for rec in by_op["addmm"] if rec.module == "Sequential.0"]
    assert len(first_linear_out) == 1 and first_linear_out[0].category == Category.TEMPORARIES
    assert {rec.phase for rec in full.records.values() if rec.category == Category.PARAMETERS} == {"setup"}
    assert {rec.phase for rec in full.records.values() if rec.category == Category.GRADIENTS} == {"backward"}
    assert {rec.phase for rec in full.records.values()
            if rec.category == Category.OPTIMIZER_STATE} == {"optimizer"}
    assert {e.phase for e in full.events} == set(PHASES)


def test_register_existing_model_and_buffers():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    with MemoryTracker() as tr:
        tr.register(model, inputs=[x])
        r = tr.result()
        assert cats(r)["parameters"] == storage_bytes(*model.parameters())
        assert cats(r)["buffers"] == storage_bytes(*model.buffers()) == 4 * 4 * 2 + 8
        assert cats(r)["inputs"] == storage_bytes(x)
        assert all(rec.preexisting for rec in r.records.values())
        model(x).sum().backward()
        r = tr.result()
    assert cats(r)["gradients"] == storage_bytes(*(p.grad for p in model.parameters()))


def test_model_built_outside_is_labelled_at_its_first_forward():
    model = _mlp()
    x = torch.randn(4, 64)
    with MemoryTracker() as tr:
        model(x)
        r = tr.result()
    assert cats(r)["parameters"] == storage_bytes(*model.parameters())
    params = [rec for rec in r.records.values() if rec.category == Category.PARAMETERS]
    assert len(params) == 4 and all(rec.preexisting for rec in params)


def test_explicit_phases_and_module_names():
    model = _mlp()
    with MemoryTracker() as tr:
        with tr.phase("setup"):
            x = tr.label(torch.randn(8, 64), "inputs")
        with tr.phase("forward"):
            loss = model(x).sum()
        with tr.phase("backward"):
            loss.backward()
        r = tr.result()
    phases = {e.phase for e in r.events}
    assert {"setup", "forward", "backward"} <= phases
    modules = {rec.module for rec in r.records.values() if rec.phase == "forward"}
    assert {"Sequential.0", "Sequential.1", "Sequential.2"} <= modules


def test_tracker_keeps_nothing_alive_after_a_cnn_step():
    torch.manual_seed(0)
    refs = []
    with MemoryTracker() as tr:
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model[2].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o.untyped_storage())))
        x = tr.label(torch.randn(32, 3, 32, 32), "inputs")
        y = tr.label(torch.randint(0, 10, (32,)), "inputs")
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, x, y
        assert refs[0]() is None       # the 2 MiB ReLU activation died (no gc needed)
        r = tr.result()
        params = list(model.parameters())
        state = [st["momentum_buffer"] for st in opt.state.values()]
        assert r.final_bytes == storage_bytes(*params, *state, *model.buffers())
        assert cats(r)["optimizer_state"] == storage_bytes(*params)
        assert cats(r)["activations"] == cats(r)["temporaries"] == cats(r)["gradients"] == 0
        assert cats(r)["inputs"] == 0
    relu = [rec for rec in r.records.values() if rec.op == "relu"]
    assert relu and relu[0].category == Category.ACTIVATIONS and not relu[0].alive
    assert relu[0].nbytes == 32 * 16 * 32 * 32 * 4
    assert r.peak_by_category["activations"] >= relu[0].nbytes
    assert_consistent(r)
    # after the tracker is gone nothing it saw is pinned: dropping the model frees its storages
    pref = weakref.ref(params[0].untyped_storage())
    del model, opt, params, state
    gc.collect()
    assert pref() is None


def test_result_views():
    with MemoryTracker() as tr:
        x = torch.empty(1000)
        r = tr.result()
    text = r.table()
    assert "temporaries" in text and "3.9 KiB" in text
    assert r.as_dict()["peak_bytes"] == 4000
    assert "peak_bytes=4000" in repr(r)
    del x


def test_backward_allocations_name_their_module():
    """Each weight gradient is computed by the backward node that the layer's forward made,
    so its record names that layer (independent of the tracker: the grads' owners)."""
    torch.manual_seed(0)
    with MemoryTracker() as tracker:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        x = tracker.label(torch.randn(5, 8), "inputs")
        model(x).sum().backward()
        result = tracker.result()
        grads = {r.module for r in result.records.values()
                 if r.category.value == "gradients" and r.shape in {(16, 8), (4, 16)}}
    assert grads == {"Sequential.0", "Sequential.2"}
    backward_modules = {e.module for e in result.events if e.phase == "backward" and e.kind == "alloc"}
    assert {"Sequential.0", "Sequential.1", "Sequential.2"} <= backward_modules


class _SavesItsOutput(torch.autograd.Function):
    """A custom Function that saves its own output (as ReLU does): its node is the tensor's grad_fn."""

    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class _CountDetach(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.detach = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.detach += func is torch.ops.aten.detach.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
def test_only_saved_outputs_get_a_detached_alias_and_no_graph_outlives_its_last_reference(fake):
    """The saved-tensor hook detaches a saved tensor (an op, through every dispatch mode) only where
    holding it could keep its own graph alive: an op's or a custom Function's saved output, whose
    grad_fn is the node saving it. Inputs saved by mul and mm are kept as they are. Either way a
    graph that never runs backward is freed when its last reference goes, with no gc."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with (FakeTensorMode() if fake else contextlib.nullcontext()), MemoryTracker() as tr, _CountDetach() as count:
            w = torch.randn(8, 8, requires_grad=True)
            x = torch.randn(4, 8, requires_grad=True)
            h = x @ w                      # mm saves its inputs x, w: kept
            assert count.detach == 0
            a = torch.relu(h)              # relu saves its output: aliased
            assert count.detach == 1
            b = a * h                      # mul saves its inputs a, h: kept
            assert count.detach == 1
            c = _SavesItsOutput.apply(b)   # a custom Function saving its output: aliased
            assert count.detach == 2
            store = weakref.ref(c.untyped_storage())
            del h, a, b, c                 # no backward: the graph goes with its last reference
            assert store() is None
            out = (x @ w).relu()
            assert count.detach == 3
            out.sum().backward()           # the kept and the aliased tensors unpack for backward
            assert w.grad is not None and x.grad is not None
        r = tr.result()
        assert_consistent(r)
    finally:
        if gc_was:
            gc.enable()


@pytest.mark.parametrize("model, options", [
    ("hf:tiny-llama", dict(batch=2, seq_len=32, checkpointing="selective", lora=8)),
    ("hf:tiny-gpt2", dict(batch=2, seq_len=32, accumulate=2)),
    ("resnet18", dict(batch=2, image_size=64)),
], ids=["llama-sac-lora", "gpt2-accumulate", "resnet18"])
def test_the_shortcuts_record_what_the_slow_path_records(monkeypatch, model, options):
    """The tracker's two shortcuts (a saved tensor kept as it is unless it may lead back to its saving
    node; a fake tensor's device answered without a second dispatch) leave every fake run's events
    as the slow path makes them: every saved tensor with a grad_fn aliased (any node counts as a
    custom Function's), every device query dispatched on (no op is the device query)."""
    import gpulab
    from gpulab.measure import tracking
    pack, aliases = tracking.MemoryTracker._pack, []

    def counted_pack(self, t):   # counts the saved tensors given a detached alias
        packed = pack(self, t)
        aliases[-1] += isinstance(packed, tuple) and packed[0] is not t
        return packed
    monkeypatch.setattr(tracking.MemoryTracker, "_pack", counted_pack)

    def events():
        aliases.append(0)
        t = gpulab.step(model, engine="fake", **options).measurement.tracking
        return [(e.kind, e.nbytes, t.records[e.sid].category, e.phase, e.module) for e in t.events], t.peak_bytes
    fast = events()
    monkeypatch.setattr(tracking, "BackwardCFunction", object)
    monkeypatch.setattr(tracking, "_PRIM_DEVICE", object())
    slow = events()
    assert fast == slow and fast[1] > 0
    assert aliases[1] > aliases[0]   # the slow path did run: it aliased more saved tensors


def test_a_module_outside_the_tree_is_named_under_the_module_that_called_it():
    """transformers 5.25 runs ``apply_rotary_pos_emb`` as a module that is no registered child of the
    attention calling it (``hub_kernels.use_kernelized_func``): what it makes belongs to the caller's
    layer, not to a root of its own."""
    class Helper(torch.nn.Module):
        def forward(self, x):
            return x * 2

    helper = Helper()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return helper(self.proj(x))      # not a child: named when first seen

    model = torch.nn.Sequential(Layer())
    with MemoryTracker() as tracker:
        tracker.register(model)
        model(torch.randn(4, 8)).sum().backward()
    modules = {r.module for r in tracker.result().records.values() if r.op == "mul"}
    assert modules == {"Sequential.0.Helper"}, modules
