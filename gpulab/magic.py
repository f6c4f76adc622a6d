"""The ``%%memtrack`` cell magic: run a cell and report memory line by line.

    %load_ext gpulab.magic

    %%memtrack --engine cpu
    x = torch.randn(1024, 1024)
    y = x @ x

The cell runs in the notebook's namespace (its variables stay defined afterwards) under
``gpulab.measure.linetrack.track_lines``; the cell's value is the ``LineReport`` (shown as a table).
The report is also stored as ``_memtrack`` in the namespace (and under ``-o NAME``).
Options: ``--engine auto|cpu|fake|cuda``, ``--device DEV``, ``--plot`` (live total per
line), ``--timeline`` (stacked by category), ``-o NAME``, ``--snapshot PATH`` (also write the
cell's timeline as a PyTorch memory snapshot pickle, ``gpulab.interop.snapshot.export_tracking``: open it
with ``torch.cuda._memory_viz`` or on pytorch.org/memory_viz; its segments are the simulated
allocator's; an existing file is refused unless ``--force``). ``{name}`` in the options line is the notebook variable's value (IPython expands it).
"""
from __future__ import annotations

import html

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gpulab.files import check_target
from gpulab.measure.linetrack import LineReport, track_lines

__all__ = ["MemtrackMagics", "load_ipython_extension", "unload_ipython_extension"]


@magics_class
class MemtrackMagics(Magics):
    last_report: LineReport | None = None

    @magic_arguments()
    @argument("--engine", "-e", default="auto", choices=["auto", "cpu", "fake", "cuda"],
              help="cpu: real tensors; fake: shapes only; cuda: the cell's CUDA tensors")
    @argument("--device", "-d", default=None, help="report this device's tensors (default: busiest)")
    @argument("--plot", action="store_true", help="also show the live total after each line")
    @argument("--timeline", action="store_true", help="also show the timeline stacked by category")
    @argument("-o", "--output", default=None, help="also store the report in this variable")
    @argument("--snapshot", default=None, metavar="PATH",
              help="also write a PyTorch memory snapshot (pickle) of the cell for torch.cuda._memory_viz")
    @argument("--force", action="store_true", help="with --snapshot: replace an existing file")
    @cell_magic
    def memtrack(self, line: str, cell: str) -> LineReport:
        """Run the cell and report memory per executed line (see ``gpulab.magic``)."""
        args = parse_argstring(self.memtrack, line)
        if args.snapshot:   # before the cell runs: its work is not lost to a bad path
            try:
                check_target(args.snapshot, overwrite=args.force, flag="--force")
            except OSError as exc:
                raise UsageError(f"%%memtrack --snapshot: {exc}") from None
        report = track_lines(cell, self.shell.user_ns, engine=args.engine, device=args.device)
        self.last_report = report
        self.shell.user_ns["_memtrack"] = report
        if args.output:
            self.shell.user_ns[args.output] = report
        if args.snapshot:
            from IPython.display import HTML, display
            from gpulab.interop.snapshot import export_tracking
            snap = export_tracking(report.tracking, args.snapshot, where=report.where, overwrite=args.force,
                                   label=f"exported by gpulab from %%memtrack ({report.label}); segments "
                                         "from the simulated allocator, not recorded on a GPU")
            self.shell.user_ns["_memtrack_snapshot"] = snap
            display(HTML(f"<span class='gpulab-label'>PyTorch memory snapshot written to "
                         f"<code>{html.escape(str(args.snapshot))}</code> ({len(snap.trace):,} trace entries): "
                         "open it with torch.cuda._memory_viz or drop it on https://pytorch.org/memory_viz</span>"))
        if args.plot or args.timeline:
            from IPython.display import display
            if args.plot:
                display(report.plot())
            if args.timeline:
                display(report.timeline())
        return report


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab.magic``."""
    ipython.register_magics(MemtrackMagics)


def unload_ipython_extension(ipython) -> None:  # nothing to undo: magics stay until restart
    pass
