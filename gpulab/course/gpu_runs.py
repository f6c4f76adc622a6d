"""Lessons 10–14 on a GPU when there is one: the same experiments on the cuda engine, labelled
"measured on <GPU name> (cuda)", and without a GPU a plain note that no GPU measured them (the
lessons' CPU and fake cells show what they always show).

* ``memtrack_where`` (10): the engine and device for ``%%memtrack`` (cuda when there is one).
* ``llm_on_gpu`` (11): a tiny transformer's training step (``gpulab.step``, engine "cuda") and
  its ``generate()`` KV cache read with ``torch.cuda.memory_allocated`` after every forward and
  ``max_memory_allocated`` (after ``reset_peak_memory_stats``) beside the formula.
* ``nccl_one_rank`` (12): the sharding strategies in one nccl process on the GPU, or why they
  stay on gloo.
* ``own_step_snapshot`` (13): PyTorch's own snapshot of a training step recorded on the GPU
  (``_record_memory_history`` / ``_snapshot``), read back and replayed by gpulab's importer.
* ``check_batch_on_gpu`` (14): the capstone's chosen batch run for real on the GPU, guarded (a
  predicted peak that does not fit is refused; an out-of-memory is caught and reported, memory freed).
"""
from __future__ import annotations

import gc
import html
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.measure.engines import LABEL_CPU, Measurement, RunContext, label_cuda, run
from gpulab.tables import STYLE, html_table
from gpulab.units import format_bytes

__all__ = ["GpuBatchCheck", "LLMOnGPU", "KVGrowth", "OneRankNccl", "OwnSnapshot", "TrackWhere", "check_batch_on_gpu",
           "gpu_name", "llm_on_gpu", "memtrack_where", "nccl_one_rank", "own_step_snapshot", "NO_GPU"]

NO_GPU = "no GPU here (torch.cuda.is_available() is False): no GPU measured this"


def gpu_name() -> str | None:
    """The GPU's name when CUDA is available, else None."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _note_html(text: str) -> str:
    return (f"{STYLE}<p class='gpulab-label' style='border-left:4px solid #c90;padding-left:8px'>"
            f"{html.escape(text)}</p>")


def _release() -> None:
    """Free what a GPU run left (its tensors are gone once their frames are): gc, then the cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- lesson 10: where %%memtrack runs --------------------------------------------------------------

@dataclass
class TrackWhere:
    """``%%memtrack --engine {engine}`` with the cell's tensors on ``device``."""
    engine: str
    device: str
    label: str
    note: str

    def __repr__(self) -> str:
        return f"TrackWhere(engine={self.engine!r}, device={self.device!r}): {self.note}"

    def _repr_html_(self) -> str:
        return _note_html(self.note)


def memtrack_where() -> TrackWhere:
    """The cuda engine and device "cuda" when there is a GPU, else the cpu engine on "cpu"."""
    name = gpu_name()
    if name is None:
        return TrackWhere("cpu", "cpu", LABEL_CPU, f"{NO_GPU}: the cells below run on the CPU ({LABEL_CPU}); "
                                                   "on a GPU they put their tensors on it and measure there")
    return TrackWhere("cuda", "cuda", label_cuda(name),
                      f"a GPU is here: the cells below put their tensors on it and %%memtrack runs on the cuda "
                      f"engine ({label_cuda(name)}; torch.cuda.memory_allocated() read after each line). Each storage counts "
                      f"there in the allocator's 512-byte blocks: the 4-byte loss shows as 512 B")


# --- lesson 11: a tiny transformer on the GPU ----------------------------------------------------------

@dataclass
class KVGrowth:
    """``generate()`` on the GPU: after each forward, the tokens in the cache, its storages, the
    formula and ``memory_allocated`` above the run's start; the whole run's allocator peak."""
    model: str
    rows: list[tuple[int, int, int, int]]   # (tokens, cache storages, formula, memory_allocated − start)
    weights_bytes: int
    peak_allocated: int                      # max_memory_allocated − the run's start (reset first)
    label: str

    def _per_token(self, k: int) -> float:
        """Growth per token of column ``k`` between the first and the last decode step (the
        prefill's temporaries are larger than a decode step's, so it is left out)."""
        decode = self.rows[1:]
        if len(decode) < 2:
            return 0.0
        (t0, *r0), (t1, *r1) = decode[0], decode[-1]
        return (r1[k - 1] - r0[k - 1]) / (t1 - t0)

    @property
    def per_token_allocated(self) -> float:
        """memory_allocated's growth per token over the decode steps (512-byte blocks, and the
        step's own temporaries, around the cache's growth)."""
        return self._per_token(3)

    @property
    def per_token_formula(self) -> float:
        return self._per_token(2)

    def _repr_html_(self) -> str:
        rows = [[t, format_bytes(c), format_bytes(f), format_bytes(a)] for t, c, f, a in self.rows]
        cap = (f"{self.model}: generate() on the GPU, {self.label}; weights {format_bytes(self.weights_bytes)}; "
               f"max_memory_allocated − start (reset_peak_memory_stats first): {format_bytes(self.peak_allocated)}; "
               f"growth per token over the decode steps: memory_allocated {self.per_token_allocated:,.0f} B, "
               f"formula {self.per_token_formula:,.0f} B")
        return html_table(["tokens in the cache", "cache storages", "formula", "memory_allocated − start"], rows, cap)


def _kv_experiment(config, prompt_len: int, new_tokens: int, dtype: torch.dtype):
    from gpulab.course.kv_cache import _eos_id, cache_storage_bytes
    from gpulab.models import hf_configs
    from gpulab.predict.generation import cache_keyword

    def experiment(ctx: RunContext) -> dict[str, Any]:
        import transformers
        start = torch.cuda.memory_allocated()
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(0)
            model = hf_configs.build_causal_lm(config, dtype).eval()
            ctx.tracker.register(model)
            ids = ctx.label(torch.randint(0, hf_configs.vocab_size(config), (1, prompt_len)))
            cache = transformers.DynamicCache(config=config)
        seen: list[tuple[int, int, int]] = []

        def after_forward(module, args, output):
            torch.cuda.synchronize()
            seen.append((cache.get_seq_length(), cache_storage_bytes(cache), torch.cuda.memory_allocated() - start))

        handle = model.register_forward_hook(after_forward)
        eos = _eos_id(config)
        try:
            with ctx.phase("forward"), torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=eos, eos_token_id=eos,
                               **{cache_keyword(model.prepare_inputs_for_generation): cache})
        finally:
            handle.remove()
        weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        return {"seen": seen, "weights": weights}
    return experiment


def kv_growth_on_gpu(model: str = "tiny-llama", prompt_len: int = 8, new_tokens: int = 16) -> KVGrowth:
    """A real ``generate()`` (float32, random weights) on the cuda engine, which resets the peak
    counters (``reset_peak_memory_stats``) before it and reads ``max_memory_allocated`` after."""
    from gpulab.course.kv_cache import _with_cache, attention_shape
    from gpulab.formulas import kv_cache_bytes
    config, name = _with_cache(model)
    a = attention_shape(config)
    m = run(_kv_experiment(config, prompt_len, new_tokens, torch.float32), "cuda")
    if m.oom:
        raise MemoryError(m.error)
    rows = [(seq, nbytes, kv_cache_bytes(a["layers"], a["kv_heads"], a["head_dim"], seq, 1, 4), alloc)
            for seq, nbytes, alloc in m.value["seen"]]
    return KVGrowth(name, rows, m.value["weights"], int(m.allocator["peak_allocated_delta"]), m.label)


@dataclass
class LLMOnGPU:
    """Lesson 11 on the GPU: bytes per parameter from ``gpulab.step`` (engine "cuda") and the KV
    cache's growth; both None without a GPU (``note`` says so)."""
    model: str
    label: str
    note: str
    steps: list[Any] = field(default_factory=list)   # course.transformer_memory.BytesPerParamRow, per recipe
    kv: KVGrowth | None = None

    @property
    def measured(self) -> bool:
        return bool(self.steps)

    def _repr_html_(self) -> str:
        parts = [_note_html(self.note)]
        parts += [row._repr_html_() for row in self.steps]
        if self.kv is not None:
            parts.append(self.kv._repr_html_())
        return "".join(parts)


def llm_on_gpu(model: str = "tiny-llama", recipes: tuple[str, ...] = ("fp32", "pure-bf16"), seq_len: int = 32,
               prompt_len: int = 8, new_tokens: int = 16) -> LLMOnGPU:
    """``model``'s training step per recipe and its generate()'s KV cache, measured on the GPU;
    without one, a result with nothing measured and a note that says so."""
    name = gpu_name()
    if name is None:
        return LLMOnGPU(model, LABEL_CPU, f"{NO_GPU}: the step and the KV cache above were measured on the CPU "
                                          "(live tensors) and on fake tensors")
    from gpulab.course.transformer_memory import measured_bytes_per_param
    steps = [measured_bytes_per_param(model, r, engine="cuda", seq_len=seq_len) for r in recipes]
    kv = kv_growth_on_gpu(model, prompt_len, new_tokens)
    _release()
    return LLMOnGPU(model, label_cuda(name), f"{model} on the GPU: {label_cuda(name)}", steps, kv)


# --- lesson 12: one nccl rank --------------------------------------------------------------------------

@dataclass
class OneRankNccl:
    """The strategies in one process: nccl on the GPU, or not run (``note`` says why)."""
    backend: str
    label: str
    note: str
    runs: list[Any] = field(default_factory=list)    # distributed.sharding.StrategyRun

    def rows(self) -> list[list[str]]:
        return [[r.spec.strategy, r.run.backend, format_bytes(r.ranks[0].peak_bytes),
                 format_bytes(r.measured(0)["total"]), format_bytes(r.formula()["total"])] for r in self.runs]

    def _repr_html_(self) -> str:
        if not self.runs:
            return _note_html(self.note)
        return _note_html(self.note) + html_table(
            ["strategy", "backend", "peak (rank 0)", "model states measured", "ZeRO formula"], self.rows(), self.label)


def nccl_one_rank(width: int = 128, strategies: tuple[str, ...] = ("ddp", "fsdp2"), world_size: int = 2) -> OneRankNccl:
    """``strategies`` in one process joined by nccl on this GPU (a one-rank group: no traffic,
    but the real backend, its buffers on the GPU). Without a GPU, nothing runs: one-rank nccl
    needs a CUDA device, so the lesson stays on gloo. ``world_size``: the lesson's own runs'."""
    from gpulab.distributed.runner import default_backend
    from gpulab.distributed.sharding import StrategySpec, measure_strategies
    name = gpu_name()
    n = torch.cuda.device_count() if name is not None else 0
    stays = (f"the {world_size}-process runs above use {default_backend(world_size)}: nccl needs one GPU per rank "
             f"and this machine has {n}")
    if name is None:
        return OneRankNccl("gloo", LABEL_CPU, f"{NO_GPU}: nccl needs a CUDA device even for one rank, so every run "
                                              f"in this lesson stays on gloo (the CPU); {stays}")
    specs = [StrategySpec(strategy=s, model="transformer", width=width) for s in strategies]
    runs = measure_strategies(specs, 1)
    backend = runs[0].run.backend
    label = f"{label_cuda(name)}, 1 {backend} process (torch.distributed), gpulab's tracker in the rank"
    return OneRankNccl(backend, label, f"one rank on {name} with the {backend} backend; {stays}", runs)


# --- lesson 13: PyTorch's own snapshot of a step on the GPU ----------------------------------------------

@dataclass
class OwnSnapshot:
    """A training step recorded by PyTorch on the GPU, read back and replayed by gpulab."""
    label: str
    note: str
    imported: Any = None      # interop.snapshot_import.ImportedSnapshot
    replay: Any = None        # interop.snapshot_import.SnapshotReplay
    tracker_peak: int = 0     # gpulab's tracker on the same run (each storage rounded to 512 B)
    allocator_peak: int = 0   # max_memory_allocated − the run's start

    @property
    def recorded(self) -> bool:
        return self.imported is not None

    def rows(self) -> list[list[str]]:
        rec, sim = self.imported.recorded, self.replay.simulated
        return [["reserved peak", format_bytes(rec.peak_reserved), format_bytes(sim.peak_reserved)],
                ["allocated peak (the file: requested bytes; the replay: blocks)", format_bytes(rec.peak_allocated),
                 format_bytes(sim.peak_allocated)],
                ["gpulab's tracker: the tensors' peak (512-rounded)", format_bytes(self.tracker_peak), "—"],
                ["max_memory_allocated − start (tensors and workspaces)", format_bytes(self.allocator_peak), "—"]]

    def _repr_html_(self) -> str:
        if not self.recorded:
            return _note_html(self.note)
        return _note_html(self.note) + html_table(["", "the snapshot (GPU)", "gpulab's replay"], self.rows(), self.label)


def _snapshot_step(model: str, batch: int):
    """Lesson 13's step (``pytorch_tools.STEP_CODE``: SGD with momentum), its model and batch made on the GPU."""
    from gpulab.models.registry import build_model, resolve_model

    def experiment(ctx: RunContext) -> dict[str, Any]:
        spec = resolve_model(model)
        size = spec.default_image_size
        torch.manual_seed(0)
        net = build_model(spec, size, device=ctx.device)
        ctx.tracker.register(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        x = ctx.label(torch.randn(batch, 3, size, size, device=ctx.device))
        y = ctx.label(torch.randint(0, spec.num_classes, (batch,), device=ctx.device))
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {}
    return experiment


def _start_recording() -> None:
    """``_record_memory_history`` with Python stacks, clearing what an earlier recording left
    (``clear_history``, where this torch has it)."""
    kwargs = dict(enabled="all", context="all", stacks="python", max_entries=1_000_000)
    try:
        torch.cuda.memory._record_memory_history(**kwargs, clear_history=True)
    except TypeError:
        torch.cuda.memory._record_memory_history(**kwargs)


def own_step_snapshot(model: str = "cnn", batch: int = 16) -> OwnSnapshot:
    """Record the step with ``torch.cuda.memory._record_memory_history``, take
    ``torch.cuda.memory._snapshot()``, stop recording; read the snapshot back
    (``interop.snapshot_import.read_snapshot``) and replay it through the simulator."""
    name = gpu_name()
    if name is None:
        return OwnSnapshot(LABEL_CPU, f"{NO_GPU}: no snapshot of this lesson's own step was recorded; the files "
                                      "above are the shipped ones (their provenance says where they came from)")
    from gpulab.interop.snapshot_import import read_snapshot
    _start_recording()
    try:
        m: Measurement = run(_snapshot_step(model, batch), "cuda")
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if m.oom:
        raise MemoryError(m.error)
    imported = read_snapshot(snap)
    label = f"{label_cuda(name)}: PyTorch's snapshot of a {model} step at batch {batch}, recorded here"
    imported.label = label
    replay = imported.replay()
    _release()
    return OwnSnapshot(label, f"recorded on {name} by PyTorch itself and replayed by gpulab's importer", imported,
                       replay, m.peak_bytes, int(m.allocator["peak_allocated_delta"]))


# --- lesson 14: the chosen batch, run for real -------------------------------------------------------------

@dataclass
class GpuBatchCheck:
    """The capstone's batch run on the GPU: its peaks next to the fake engine's prediction."""
    batch: int
    card: str
    label: str
    note: str
    predicted_peak: int = 0
    capacity: int = 0
    result: Any = None          # predict.step.StepResult, when it ran
    oom: bool = False
    refused: str = ""

    @property
    def ran(self) -> bool:
        return self.result is not None and not self.oom

    def rows(self) -> list[list[str]]:
        a = self.result.measurement.allocator
        return [["live tensors' peak", format_bytes(self.predicted_peak), format_bytes(self.result.peak_bytes)],
                ["max_memory_allocated − start", "—", format_bytes(a["peak_allocated_delta"])],
                ["max_memory_reserved − start", "—", format_bytes(a["peak_reserved_delta"])],
                [f"{self.card}: memory for the run", format_bytes(self.capacity), "—"]]

    def _repr_html_(self) -> str:
        if not self.ran:
            return _note_html(self.note)
        return _note_html(self.note) + html_table(["", f"fake engine (for {self.card})", self.label], self.rows(),
                                                  f"batch {self.batch}, a real training step on the GPU")


def check_batch_on_gpu(you: Any, fit_result: Any, steps: int = 2) -> GpuBatchCheck:
    """``you`` (course.capstone.YourModel) at ``fit_result``'s largest batch, ``steps`` real
    steps on the cuda engine, guarded by ``gpulab.step``: a predicted peak beyond the GPU's free
    memory is refused; an out-of-memory is caught, reported, and the memory freed."""
    from gpulab.predict.step import step
    card, batch = you.card.name, int(fit_result.largest_batch)
    base = dict(batch=batch, card=card, predicted_peak=int(fit_result.peak_bytes), capacity=int(fit_result.capacity_bytes))
    name = gpu_name()
    if name is None:
        return GpuBatchCheck(label=LABEL_CPU, note=f"{NO_GPU}: batch {batch} is the fake engine's answer for {card}; "
                                                   "no real step checked it", **base)
    if batch < 1:
        return GpuBatchCheck(label=label_cuda(name), note=f"nothing fits {card}: no batch to check on {name}", **base)
    label = label_cuda(name)
    try:
        result = step(you.workload, batch=batch, engine="cuda", steps=steps, **you.fit_options())
    except ValueError as exc:            # the guard's refusal, or a step that cannot run
        _release()
        return GpuBatchCheck(label=label, note=f"batch {batch} not run on {name}: {exc}", refused=str(exc), **base)
    m = result.measurement
    _release()
    if m.oom:
        return GpuBatchCheck(label=label, note=f"batch {batch} ran out of memory on {name} (memory freed): {m.error}",
                             result=result, oom=True, **base)
    reserved = int(m.allocator["peak_reserved_delta"])
    verdict = "within" if reserved <= fit_result.capacity_bytes else "beyond"
    return GpuBatchCheck(label=label, note=(f"batch {batch} ran on {name}: the allocator's reserved peak "
                                            f"{format_bytes(reserved)} is {verdict} {card}'s "
                                            f"{format_bytes(fit_result.capacity_bytes)} for the run"),
                         result=result, **base)
