import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"


def core_day_lessons(text: str | None = None) -> set[str]:
    """The two-digit numbers of the lessons in docs/teaching.md's one-day workshop table (its rows
    whose second column names a lesson, "| 0:15–0:32 | 00 start here | ..."): the lessons
    ``make test`` runs in the browser (``make test-browser-all`` runs every lesson)."""
    import re
    text = (ROOT / "docs" / "teaching.md").read_text() if text is None else text
    day = text[text.index("## A one-day workshop"):]
    day = day[:day.index("\n## ", 3)]
    return set(re.findall(r"^\| [0-9]+:[0-9]{2}–[0-9]+:[0-9]{2} \| ([0-9]{2}) ", day, re.M))



def cuda(test):
    """A test that needs a CUDA GPU: marked ``cuda`` (so ``pytest -m cuda`` selects it, as the GPU
    validation runs it) and skipped without one."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@pytest.fixture(autouse=True)
def _agg_backend(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")


def notebook_errors(nb) -> list[str]:
    """Every sign of failure in an executed notebook: error outputs, tracebacks on stderr,
    and panels that showed an error (in a cell's output or in the stored widget state,
    where Output widgets keep their contents)."""
    import json

    errors = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
            if out.get("output_type") == "stream" and out.get("name") == "stderr" and "Traceback" in out.get("text", ""):
                errors.append(f"cell {i}: traceback on stderr")
            data = json.dumps(out.get("data", {}))
            if "gpulab-error" in data:
                j = data.index("gpulab-error")
                errors.append(f"cell {i}: a panel showed an error: {data[j:j + 300]}")
    state = json.dumps(nb.metadata.get("widgets", {}))
    if "gpulab-error" in state:
        j = state.index("gpulab-error")
        errors.append(f"a panel showed an error (widget state): {state[j:j + 300]}")
    return errors + rendering_errors(nb)


# a cell whose last line shows a figure: a plot method or a figure-making function
FIGURE_CALL = re.compile(r"(\.plot\(|plot_\w*\(|\w_figure\(|\.figure\(|\.timeline\(|timeline\(|_bars\()")
ESCAPED_AS_TEXT = ("&#x27;", "&gt;", "&lt;", "&amp;", "&quot;")          # entities shown as text in text/plain
DOUBLE_ESCAPED = ("&amp;#x27;", "&amp;gt;", "&amp;lt;", "&amp;quot;", "&amp;amp;")   # HTML escaped twice


def rendering_errors(nb) -> list[str]:
    """What a student would see wrongly rendered (#47 item 8): a figure shown as its text
    (``<Figure size ...>``), a cell whose last line shows a figure without an image among its outputs,
    HTML entities shown as text (``&#x27;``, ``&gt;`` in a plain-text output, or escaped twice in HTML),
    in a cell's outputs or in a panel's Output widget (the stored widget state)."""
    import json

    errors = []
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        outs = cell.get("outputs", [])
        # what shows as text: streams, and plain-text outputs with no richer form beside them (a figure's
        # PNG carries "<Figure size ...>" as its text/plain, which the front end does not show)
        plain = "".join(_shown_text(o) for o in outs)
        html = json.dumps([o.get("data", {}).get("text/html", "") for o in outs if "data" in o])
        if "<Figure size" in plain:
            errors.append(f"cell {i}: a figure shows as text ({plain[plain.index('<Figure size'):][:60]!r}), not a picture")
        if any(e in plain for e in ESCAPED_AS_TEXT):
            errors.append(f"cell {i}: HTML entities shown as text: {plain[:200]!r}")
        if any(e in html for e in DOUBLE_ESCAPED):
            errors.append(f"cell {i}: HTML escaped twice (entities shown as text)")
        src = [ln for ln in "".join(cell.get("source", "")).splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if src and "_panel(" not in "".join(cell.get("source", "")) and FIGURE_CALL.search(src[-1]) \
                and not any("image/png" in o.get("data", {}) for o in outs):
            errors.append(f"cell {i}: its last line ({src[-1].strip()[:60]!r}) shows a figure, but no image came out")
    for outs in _widget_outputs(nb.metadata.get("widgets", {})):   # what panels' Output widgets show
        plain = "".join(_shown_text(o) for o in outs)
        if "<Figure size" in plain:
            errors.append("a panel shows a figure as text (widget state): <Figure size ...>")
        if any(e in json.dumps(outs) for e in DOUBLE_ESCAPED):
            errors.append("a panel shows HTML escaped twice (widget state)")
    return errors


def _shown_text(o: dict) -> str:
    """The text a front end shows for one output: a stream's, or a plain-text-only result's."""
    if o.get("output_type") == "stream":
        t = o.get("text", "")
    else:
        data = o.get("data", {})
        rich = {"text/html", "image/png", "application/vnd.jupyter.widget-view+json"} & set(data)
        t = "" if rich else data.get("text/plain", "")
    return t if isinstance(t, str) else "".join(t)


def _widget_outputs(node) -> list[list[dict]]:
    """Every ``outputs`` list in a stored widget state (Output widgets keep what they show there)."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("outputs"), list):
            found.append([o for o in node["outputs"] if isinstance(o, dict)])
        for v in node.values():
            found += _widget_outputs(v)
    elif isinstance(node, list):
        for v in node:
            found += _widget_outputs(v)
    return found


# ---------------------------------------------------------------------------------------------
# Executing notebooks without a lost-wake-up stall

POLL_SLICE_S = 1.0


def _sliced(inner):
    """A zmq.asyncio channel's ``get_msg(timeout)`` that waits in slices of ``POLL_SLICE_S``.

    Why: nbclient waits for a cell's reply with ``await socket.poll(timeout)`` on jupyter_client's
    zmq.asyncio sockets. A zmq socket's file descriptor is edge-triggered, and under CPU load
    pyzmq (27.x here) sometimes misses the edge: the reply sits on the client's socket (its
    ``zmq.EVENTS`` says POLLIN, read with gdb from a stalled run) while the poll sleeps until its
    timeout; then pyzmq's final ``poll(0)`` finds the message and the run goes on. That was the
    "stall of about 10 minutes, then it passed" in the rerun test (cell timeout 600 s), with the
    kernel finished and idle and the test process idle too. Neither the notebook, the panel nor
    the kernel is involved (it happens with ipykernel 6 and 7 alike), and JupyterLab does not
    read kernels this way (its server uses tornado's ZMQStream), so students do not meet it.
    Waiting in slices makes pyzmq re-check the socket every second: a missed edge costs at most
    one slice, never the whole timeout."""
    import time
    from queue import Empty

    async def get_msg(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else max(0.0, min(POLL_SLICE_S, deadline - time.monotonic()))
            try:
                return await inner(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
    return get_msg


def notebook_client(nb, **kwargs):
    """An nbclient ``NotebookClient`` whose shell and iopub waits cannot miss a message (see
    ``_sliced``); use it for every notebook the tests execute."""
    from nbclient import NotebookClient
    from nbclient.util import run_sync

    class SlicedPollClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = _sliced(channel.get_msg)
            return kc

        # nbclient binds the sync twin to the base class's coroutine: bind it to ours
        start_new_kernel_client = run_sync(async_start_new_kernel_client)

    return SlicedPollClient(nb, **kwargs)


# ---------------------------------------------------------------------------------------------
# A stand-in GPU (tests/cuda_standin.py): the cuda engine's code on every run, without CUDA

@pytest.fixture
def standin_gpu(monkeypatch):
    """torch.cuda answered by a stand-in: tensors on meta, counters from gpulab's simulator.
    Yields the ``StandInGPU`` (its ``sim``, ``calls`` and ``order`` for assertions)."""
    from cuda_standin import standin_gpu as install
    with install(monkeypatch) as gpu:
        yield gpu


def run_main(argv, capsys):
    """gpulab.cli.main in-process: (exit code, stdout, stderr)."""
    from gpulab import cli
    try:
        code = cli.main(argv)
    except SystemExit as e:       # argparse errors exit through SystemExit(2)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
