"""Lesson 00's library: what this machine is, which engine answers, how to read labels (the units of
memory, MiB vs MB, are lesson 01's: ``gpulab.course.byte_units``).

* ``machine_report()``: Python/torch versions, CPU and RAM, GPU facts from NVML (what
  nvidia-smi reads) when there is a GPU, and the engine the lessons will use, with the reason.
* ``label_guide()``: the honest labels every number carries, and which ones this machine can
  produce.
* ``engine_demo(size_mib, engine, cpu_limit_mib)``: one float32 tensor, answered by an engine,
  next to the formula and the simulated allocator.
* ``oom_story(...)``: the motivating story: a model that "should fit" by its parameter count,
  one training step's peak by category (fake engine, CUDA's kernels), and the verdict for a card.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.measure.engines import DEFAULT_MAX_CPU_BYTES, LABEL_CPU, LABEL_FAKE_CPU, LABEL_FAKE_CUDA, LABEL_FORMULA, LABEL_SIMULATED, RunContext, engine_status, label_cuda, label_recorded, run
from gpulab.course.exercises import ChoiceExercise
from gpulab.measure.tracking import TrackingResult
from gpulab.units import GiB, MiB, format_bytes
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "BEYOND_TENSORS_LESSON", "CATEGORY_LESSONS", "EngineDemo", "LabelGuide", "MachineReport", "OomStory",
    "SIZE_OPTIONS_MIB", "engine_demo", "exercise_where_memory_went", "label_guide", "machine_report",
    "nvidia_smi_style", "oom_story"
]

try:  # the caching-allocator simulator (optional here)
    from gpulab.allocator.simulator import CachingAllocator
except ImportError:  # pragma: no cover
    CachingAllocator = None



def nvidia_smi_style(nbytes: int | None) -> str:
    """'24,576 MiB = 24.0 GiB = 25.8 GB': nvidia-smi's unit, the binary unit, the decimal one."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / MiB:,.0f} MiB = {format_bytes(nbytes)} = {format_bytes(nbytes, 'decimal')}"


# --- the machine ------------------------------------------------------------------------------------

@dataclass
class MachineReport:
    """This machine, as the lessons see it. Every fact names its source."""

    info: dict[str, Any]            # gpulab.cli.env_info()
    cpu_cores: int
    ram_total: int | None
    ram_available: int | None

    @property
    def engine(self) -> str:
        return self.info["engine"]

    @property
    def engine_reason(self) -> str:
        return self.info["engine_reason"]

    @property
    def gpus(self) -> list[dict[str, Any]]:
        return list(self.info["device"]["gpus"])

    def rows(self) -> list[list[str]]:
        i = self.info
        rows = [["Python", i["python"], "platform"],
                ["torch / torchvision", f"{i['torch']} / {i['torchvision']}", "torch.__version__"],
                ["CPU cores this process may use", str(self.cpu_cores), "os.sched_getaffinity"],
                ["RAM total / available now",
                 "n/a" if self.ram_total is None else
                 f"{format_bytes(self.ram_total)} / {format_bytes(self.ram_available)}", "psutil"],
                ["CUDA available to torch", str(i["cuda_available"]), "torch.cuda.is_available()"],
                ["CUDA version torch was built for", str(i["cuda_version"]), "torch.version.cuda"]]
        for g in self.gpus:
            src = "NVML (what nvidia-smi reads)" if g["source"] == "nvml" else g["source"]
            rows += [[f"GPU {g['index']}", g["name"], src],
                     [f"GPU {g['index']} memory total", nvidia_smi_style(g["total_bytes"]), src],
                     [f"GPU {g['index']} memory used (all processes)", nvidia_smi_style(g["used_bytes"]), src],
                     [f"GPU {g['index']} driver / compute capability",
                      f"{g['driver']} / {g['compute_capability']}", src]]
        if i["device"]["reason"]:
            rows.append(["why no GPU facts" if not self.gpus else "note", i["device"]["reason"],
                         "gpulab.measure.gpu.device_report()"])
        rows.append(["engine auto picks here (small experiments; big ones go to fake without a GPU)",
                     f"{i['engine']}: {i['engine_reason']}", "gpulab.measure.engines.choose_engine('auto')"])
        return rows

    def __repr__(self) -> str:
        return "\n".join(f"{a}: {b}  [{c}]" for a, b, c in self.rows())

    def _repr_html_(self) -> str:
        engines = [[name, "yes" if d["available"] else "no", d["why"]]
                   for name, d in self.info["engines"].items()]
        return (html_table(["fact", "value", "source"], self.rows(), "this machine")
                + html_table(["engine", "available here", "why"], engines,
                             f"the lessons will use: {self.engine}"))


def machine_report() -> MachineReport:
    from gpulab.cli import env_info

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    try:
        import psutil
        vm = psutil.virtual_memory()
        total, avail = int(vm.total), int(vm.available)
    except ImportError:  # pragma: no cover
        total = avail = None
    return MachineReport(env_info(), cores, total, avail)


# --- labels -----------------------------------------------------------------------------------------

@dataclass
class LabelGuide:
    rows: list[tuple[str, str, bool]]   # (label, what it means, can this machine produce it)

    def __repr__(self) -> str:
        return "\n".join(f"{'*' if ok else ' '} {lab}: {what}" for lab, what, ok in self.rows)

    def _repr_html_(self) -> str:
        return html_table(["label on a number", "what it means", "on this machine"],
                          [[lab, what, "yes" if ok else "no"] for lab, what, ok in self.rows],
                          "every number in the lessons carries one of these labels")


def _recorded_rows() -> list[tuple[str, str, bool]]:
    """The recorded-runs label, one row per record gpulab ships (its GPU, date and torch, and the CUDA
    runtime and driver of its ``provenance``), so the lesson never types which GPU they came from."""
    from gpulab.record.lookup import load_records
    records = load_records()
    if not records:
        return [(label_recorded("<GPU name>", "<date>", "<version>"),
                 "a GPU measurement shipped with gpulab (none ships with this version)", False)]
    rows = []
    for r in records:
        prov = r.data.get("provenance", {})
        newer = "" if str(prov.get("torch", "")) == torch.__version__ else \
            f"; this machine runs torch {torch.__version__}, so a run here on the same card may differ"
        rows.append((r.label, f"a GPU measurement shipped with gpulab (gpulab/recorded/{r.path.name}): real, but "
                              f"not from this machine; CUDA runtime {prov.get('cuda_runtime', '?')}, driver "
                              f"{prov.get('driver', '?')}{newer}", True))
    return rows


def label_guide() -> LabelGuide:
    status = engine_status()
    gpu = torch.cuda.get_device_name(0) if status["cuda"][0] else "<GPU name>"
    return LabelGuide([
        (LABEL_FORMULA, "computed from shapes, dtypes and counts by a function in gpulab.formulas; "
                        "nothing ran", True),
        (LABEL_CPU, "the code ran on the CPU with real data; a tracker counted every tensor storage "
                    "it created and freed", status["cpu"][0]),
        (LABEL_FAKE_CPU, "the code ran on fake tensors (shapes and dtypes, no data, no compute), following "
                         "the CPU kernels' choices; the same tracker counted the storages they would allocate", status["fake"][0]),
        (LABEL_FAKE_CUDA, "fake tensors again, answering for a GPU: CUDA's kernel choices (foreach optimizers, "
                          "bool dropout masks, step counters in host memory), storages in 512-byte blocks; "
                          "no CUDA context or workspaces (see gpulab.measure.fake_cuda.STILL_DIFFERS)", status["fake"][0]),
        (LABEL_SIMULATED, "a model of PyTorch's CUDA caching allocator replayed those storages: what "
                          "memory_allocated / memory_reserved would say on a GPU", CachingAllocator is not None),
        (label_cuda(gpu), "the code ran on that GPU; the numbers come from the caching allocator's "
                          "counters and NVML", status["cuda"][0]),
        *_recorded_rows(),
    ])


# --- which engine answers ---------------------------------------------------------------------------

@dataclass
class EngineDemo:
    """One float32 tensor of ``size_bytes``, answered by an engine."""

    size_bytes: int
    requested: str
    engine: str
    reason: str
    label: str
    cpu_limit_bytes: int
    formula_bytes: int
    measured_bytes: int
    seconds: float
    simulated_allocated: int | None
    simulated_reserved: int | None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    nvml_used: int | None = None
    formula_label: str = LABEL_FORMULA
    simulated_label: str = LABEL_SIMULATED

    @property
    def error(self) -> float | None:
        return error_percent(self.formula_bytes, self.measured_bytes)

    def bars(self) -> list[tuple[str, int, str]]:
        """(what, bytes, label) for each number, in display order."""
        out = [("numel × 4 B", self.formula_bytes, self.formula_label),
               ("storage bytes", self.measured_bytes, self.label)]
        if self.simulated_allocated is not None:
            out += [("memory_allocated", self.simulated_allocated, self.simulated_label),
                    ("memory_reserved", self.simulated_reserved, self.simulated_label)]
        if self.cuda_allocated is not None:
            out.append(("memory_allocated − baseline (this run)", self.cuda_allocated, self.label))
        if self.cuda_reserved is not None:
            out.append(("max_memory_reserved − baseline (this run)", self.cuda_reserved, self.label))
        return out

    def __repr__(self) -> str:
        return (f"EngineDemo({format_bytes(self.size_bytes)}: engine {self.engine} ({self.reason}), "
                f"measured {self.measured_bytes:,} B [{self.label}])")

    def _repr_html_(self) -> str:
        head = (f"<div><code>torch.empty({self.size_bytes // 4:,}, dtype=torch.float32)</code>, "
                f"{format_bytes(self.size_bytes)} = {format_bytes(self.size_bytes, 'decimal')}. "
                f"Asked for <b>{html.escape(self.requested)}</b>; answered by the <b>{self.engine}</b> engine: "
                f"{html.escape(self.reason)}.</div>")
        rows = [[what, f"{b:,} B", format_bytes(b), format_bytes(b, "decimal"), lab]
                for what, b, lab in self.bars()]
        table = html_table(["number", "bytes", "binary", "decimal", "label (where it came from)"], rows,
                           f"formula error vs measured: {fmt_error(self.error)}; took {self.seconds:.2f} s; "
                           f"cpu engine limit for 'auto': {format_bytes(self.cpu_limit_bytes)}")
        return head + table


SIZE_OPTIONS_MIB = (1, 4, 16, 256, 1024, 4096, 65536)


def engine_demo(size_mib: int = 4, engine: str = "auto",
                cpu_limit_mib: int = DEFAULT_MAX_CPU_BYTES // MiB) -> EngineDemo:
    """Allocate one float32 tensor of ``size_mib`` MiB on the engine ``choose_engine`` picks."""
    if not isinstance(size_mib, int) or size_mib < 1:
        raise ValueError(f"size must be a positive whole number of MiB, got {size_mib!r}")
    if not isinstance(cpu_limit_mib, int) or cpu_limit_mib < 1:
        raise ValueError(f"the cpu limit must be a positive whole number of MiB, got {cpu_limit_mib!r}")
    nbytes = size_mib * MiB
    limit = cpu_limit_mib * MiB
    n = nbytes // 4

    def experiment(ctx: RunContext) -> int | None:
        t = torch.empty(n, dtype=torch.float32, device=ctx.device)
        return ctx.snapshot("tensor").allocated_bytes

    m = run(experiment, engine, predicted_bytes=nbytes, max_cpu_bytes=limit)
    if m.oom:
        raise MemoryError(f"out of memory on the {m.engine} engine ({m.error}); choose the fake engine")
    raw = TrackingResult.build(m.tracking.records, m.tracking.events, device=m.tracking.device, rounded=False)
    sim_a = sim_r = None
    if CachingAllocator is not None:
        sim = CachingAllocator()
        sim.malloc(nbytes)
        sim_a, sim_r = sim.memory_allocated(), sim.memory_reserved()
    demo = EngineDemo(nbytes, engine, m.engine, m.reason, m.label, limit, F.tensor_bytes((n,), "float32"),
                      raw.peak_bytes, m.seconds, sim_a, sim_r)
    if m.engine == "cuda" and m.allocator:
        demo.cuda_allocated = m.value
        demo.cuda_reserved = m.allocator["peak_reserved_delta"]   # this run's, not the process's
        demo.nvml_used = m.allocator.get("nvml_used")
    return demo


# --- the story: "it should fit" ---------------------------------------------------------------------

# where each category of a training step's memory is explained in the course
CATEGORY_LESSONS: dict[str, list[tuple[str, str]]] = {
    "parameters": [("02 · parameters", "02_parameters.ipynb")],
    "buffers": [("02 · parameters", "02_parameters.ipynb")],
    "inputs": [("01 · tensor bytes", "01_tensor_bytes.ipynb"), ("04 · a training step", "04_training_step.ipynb")],
    "gradients": [("04 · a training step", "04_training_step.ipynb")],
    "optimizer_state": [("05 · optimizers", "05_optimizers.ipynb")],
    "activations": [("03 · activations and FLOPs", "03_activations_and_flops.ipynb"),
                    ("06 · inplace and inference", "06_inplace_and_inference.ipynb"),
                    ("07 · checkpointing", "07_checkpointing.ipynb"), ("08 · mixed precision", "08_mixed_precision.ipynb")],
    "temporaries": [("06 · inplace and inference", "06_inplace_and_inference.ipynb"),
                    ("10 · tracking memory", "10_tracking_memory.ipynb")],
}
BEYOND_TENSORS_LESSON = ("09 · the caching allocator", "09_caching_allocator.ipynb")


@dataclass
class OomStory:
    """A model that fits by its parameter count, one training step's peak, and a card."""
    model: str
    batch: int
    optimizer: str
    card_bytes: int
    param_bytes: int          # formula: parameters × 4 B (float32)
    step: Any                 # experiments.StepResult (steady state: the second step)

    @property
    def n_params(self) -> int:
        return self.param_bytes // 4

    @property
    def adam_bytes(self) -> int:
        """Formula: parameters, gradients and Adam's two states, 4 × params × 4 B."""
        return 4 * self.param_bytes

    @property
    def peak_bytes(self) -> int:
        return self.step.peak_bytes

    @property
    def peak_by_category(self) -> dict[str, int]:
        return {c: b for c, b in self.step.peak_by_category.items() if b}

    @property
    def label(self) -> str:
        return self.step.label

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.card_bytes

    @property
    def margin_bytes(self) -> int:
        """Card minus peak: negative when the step does not fit."""
        return self.card_bytes - self.peak_bytes

    @property
    def largest(self) -> str:
        return max(self.peak_by_category, key=self.peak_by_category.get)

    @property
    def verdict(self) -> str:
        if self.fits:
            return (f"fits: the peak {format_bytes(self.peak_bytes)} is {format_bytes(self.margin_bytes)} under the "
                    f"{format_bytes(self.card_bytes)} card")
        return (f"does not fit: the peak {format_bytes(self.peak_bytes)} is {format_bytes(-self.margin_bytes)} over the "
                f"{format_bytes(self.card_bytes)} card ({self.peak_bytes / self.card_bytes:.2f}× the card)")

    def rows(self) -> list[list[str]]:
        rows = []
        for c, b in sorted(self.peak_by_category.items(), key=lambda kv: -kv[1]):
            rows.append([c, format_bytes(b), f"{100 * b / self.peak_bytes:.0f}%",
                         ", ".join(name for name, _ in CATEGORY_LESSONS.get(c, []))])
        return rows

    def _repr_html_(self) -> str:
        links = lambda c: ", ".join(f"<a href='{f}'>{html.escape(n)}</a>" for n, f in CATEGORY_LESSONS.get(c, []))
        body = "".join(
            f"<tr><td>{html.escape(c)}</td><td>{format_bytes(b)}</td><td>{100 * b / self.peak_bytes:.0f}%</td>"
            f"<td>{links(c)}</td></tr>"
            for c, b in sorted(self.peak_by_category.items(), key=lambda kv: -kv[1]))
        n, f = BEYOND_TENSORS_LESSON
        head = (f"<p><b>{html.escape(self.model)}</b>, batch {self.batch}, {html.escape(self.optimizer)}, float32, "
                f"second training step (the optimizer state exists by then).<br>"
                f"Parameters: {self.n_params / 1e6:.1f} M × 4 B = <b>{format_bytes(self.param_bytes)}</b> "
                f"({LABEL_FORMULA}); with gradients and Adam's two states, 4 × that = "
                f"{format_bytes(self.adam_bytes)} ({LABEL_FORMULA}).<br>"
                f"The step's peak: <b>{format_bytes(self.peak_bytes)}</b> ({html.escape(self.label)}), in the "
                f"{html.escape(self.step.measurement.tracking.peak_phase)} phase.<br>"
                f"Card: {format_bytes(self.card_bytes)}. Verdict: <b>{html.escape(self.verdict)}</b>.</p>")
        table = html_table(["category at the peak", "bytes", "share of the peak", "explained in"], [], "")
        table = table.replace("</table>", body + "</table>")
        return (head + table + f"<p class='gpulab-label'>{html.escape(self.label)}; binary units. What the "
                f"GPU holds beyond these tensors (the CUDA context, the allocator's cached blocks) comes on top: "
                f"<a href='{f}'>{html.escape(n)}</a>.</p>")

    def __repr__(self) -> str:
        return (f"OomStory({self.model}, batch={self.batch}, {self.optimizer}, peak={format_bytes(self.peak_bytes)}, "
                f"card={format_bytes(self.card_bytes)}, {'fits' if self.fits else 'does not fit'}, label={self.label!r})")

    def figure(self):
        """One horizontal bar: the peak stacked by category, the parameters' formula and the card as lines."""
        from gpulab.plots import CATEGORY_COLORS, LessonFigure
        fig = LessonFigure(figsize=(7.5, 2.6), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        left = 0.0
        for c, b in sorted(self.peak_by_category.items(), key=lambda kv: -kv[1]):
            ax.barh([0], [b / GiB], left=left, color=CATEGORY_COLORS.get(c, "#999999"), label=c.replace("_", " "))
            left += b / GiB
        ax.axvline(self.card_bytes / GiB, color="#C44E52", lw=2)
        ax.text(self.card_bytes / GiB, 0.45, f" card {format_bytes(self.card_bytes)}", color="#C44E52", fontsize=8)
        ax.axvline(self.param_bytes / GiB, color="#333333", ls="--", lw=1)
        ax.text(self.param_bytes / GiB, -0.52, f" params × 4 B ({LABEL_FORMULA})", fontsize=7)
        ax.set_yticks([])
        ax.set_ylim(-0.6, 0.6)
        ax.set_xlabel("GiB")
        ax.set_title(f"{self.model}, batch {self.batch}, {self.optimizer}: the step's peak by category "
                     f"({self.label})", fontsize=8)
        fig.legend(fontsize=7, ncol=6, loc="outside lower center")
        return fig


def oom_story(model: str = "vgg16", batch: int = 128, optimizer: str = "adam", card_gib: float = 8,
              engine: str = "fake") -> OomStory:
    """The motivating story of lesson 00: ``model`` at ``batch`` with ``optimizer`` on a
    ``card_gib`` GiB card. Two training steps run on ``engine`` (the fake engine by default,
    following CUDA's kernels: a GPU question answered instantly, without a GPU); the second step
    is the steady state, with the optimizer state alive."""
    from gpulab.predict.step import step as tracked_step
    if not card_gib or card_gib <= 0:
        raise ValueError(f"card size must be a positive number of GiB, got {card_gib!r}")
    step = tracked_step(model, batch=batch, optimizer=optimizer, engine=engine, steps=2, guard=False)
    param_bytes = step.predicted["parameters"]
    return OomStory(step.model, batch, optimizer, int(card_gib * GiB), param_bytes, step)


def exercise_where_memory_went(story: OomStory | None = None) -> ChoiceExercise:
    """Predict-first (qualitative): which category is largest at the step's peak. The answer is
    read from the story's measurement."""
    cache: dict[str, OomStory] = {}

    def get() -> OomStory:
        if "s" not in cache:
            cache["s"] = story if story is not None else oom_story()
        return cache["s"]

    keys = {"a": "parameters", "b": "optimizer_state", "c": "activations", "d": "gradients"}

    def expected() -> str:
        largest = get().largest
        return next((k for k, c in keys.items() if c == largest), "c")

    def explain() -> str:
        st = get()
        parts = ", ".join(f"{c} {format_bytes(st.peak_by_category.get(c, 0))}" for c in keys.values())
        return (f"At the peak ({st.label}): {parts}. Activations, the outputs each layer keeps for backward, grow "
                f"with the batch; parameters, gradients and optimizer state do not. Lesson 03 counts them layer by "
                f"layer, and lessons 06–08 shrink them.")

    return ChoiceExercise(
        question=("Before you look at the table: at the peak of that training step, which category takes the most "
                  "memory?"),
        options={"a": "the parameters", "b": "Adam's optimizer state", "c": "the activations saved for backward",
                 "d": "the gradients"},
        expected=expected, explain=explain,
        hint="Look again at what is alive at the peak, and which of it grows with the batch")
