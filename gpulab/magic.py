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

An error raised by the cell's own code is shown as the student's line and the error, in a few lines
(``cell_error_lines``; IPython shows an exception's ``_render_traceback_`` instead of its frames),
not as gpulab's and torch's frames. The exception still propagates with its type; a syntax error,
found before anything ran, becomes a ``UsageError`` carrying the same lines.
"""
from __future__ import annotations

import html
import linecache
import traceback

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gpulab.files import check_target
from gpulab.measure.linetrack import LineReport, track_lines

__all__ = ["MemtrackMagics", "cell_error_lines", "load_ipython_extension", "unload_ipython_extension"]


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
        try:
            report = track_lines(cell, self.shell.user_ns, engine=args.engine, device=args.device)
        except Exception as exc:
            lines = cell_error_lines(exc, cell)
            if lines is not None and isinstance(exc, SyntaxError):
                # IPython formats any SyntaxError its own way (showsyntaxerror, with gpulab's frames);
                # the cell never ran, so the lines go out as a usage error: no frames at all
                raise UsageError("\n".join(lines)) from None
            if lines is not None:
                try:
                    exc._render_traceback_ = lambda: lines   # IPython shows these lines, not the frames
                except (AttributeError, TypeError):          # an exception type without a __dict__
                    pass
            raise
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


_CONTEXT = 1   # lines of the cell shown above the failing one


def cell_error_lines(exc: BaseException, cell: str) -> list[str] | None:
    """The student's view of an error raised while a ``%%memtrack`` cell ran: the cell's line that
    failed (with the line above it), where the error was raised if that is outside the cell (one
    line), and ``Type: message``. None when no frame of the cell is involved (an error of gpulab's
    own, before the cell ran): then IPython's full traceback is the honest answer."""
    src = cell.splitlines()
    frames = list(traceback.walk_tb(exc.__traceback__))
    if isinstance(exc, SyntaxError) and str(exc.filename or "").startswith("<memtrack-"):
        filename, marked = exc.filename, [exc.lineno or 1]
    else:
        cell_frames = [(f, n) for f, n in frames if f.f_code.co_filename.startswith("<memtrack-")]
        if not cell_frames:
            return None
        filename = cell_frames[0][0].f_code.co_filename     # the cell's own exec
        marked = []                                         # the cell's line, then the lines it called into
        for f, n in cell_frames:
            if f.f_code.co_filename == filename and n not in marked:
                marked.append(n)
        marked = marked[:1] + marked[1:][-2:]
    # the cell's source under its file name, for tracebacks and debuggers asked for later (%tb, %debug)
    linecache.cache[filename] = (len(cell), None, [ln + "\n" for ln in src], filename)
    out = [f"Error in your %%memtrack cell, line {marked[0]}:"]
    shown = list(range(max(1, marked[0] - _CONTEXT), marked[0] + 1)) + marked[1:]
    for n in shown:
        if 1 <= n <= len(src):
            out.append(f"{'---->' if n in marked else '     '} {n:>3} {src[n - 1]}")
    if frames and not isinstance(exc, SyntaxError):
        last, last_line = frames[-1]
        where = last.f_code.co_filename
        if not where.startswith("<memtrack-"):
            out.append(f"      (raised in {last.f_code.co_name}, {where}:{last_line})")
    message = str(exc) if not isinstance(exc, SyntaxError) else exc.msg
    out.append(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
    return out


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab.magic``."""
    ipython.register_magics(MemtrackMagics)


def unload_ipython_extension(ipython) -> None:  # nothing to undo: magics stay until restart
    pass
