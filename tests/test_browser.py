"""Real-browser test: every lesson opened in JupyterLab in headless Chromium, all cells run,
every gpulab panel poked (a slider moved or a dropdown changed, then Run clicked), and the
visible output must change with no error anywhere on the page.

One JupyterLab server and one browser serve all lessons; each lesson's kernel is shut down
after it. Screenshots go to ``test-artifacts/browser/``. ``GPULAB_UPDATE_SCREENSHOT=1`` also
writes ``docs/panel.png`` (a cropped, palette-compressed shot of one panel, for the README).

Needs Chromium (Debian's ``chromium`` package: ``make test`` installs it when missing) and
Playwright for Python (the ``test`` extra). ``playwright install`` is never needed: the test
launches the system Chromium. ``GPULAB_CHROMIUM`` overrides the browser path;
``GPULAB_LESSONS_DIR`` overrides the lessons folder (to test a draft lesson).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import LESSONS, ROOT

LESSONS_DIR = pathlib.Path(os.environ.get("GPULAB_LESSONS_DIR", LESSONS)).resolve()
NOTEBOOKS = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "browser"
PANEL_PNG = ROOT / "docs" / "panel.png"
# lessons whose first panel makes a good README picture, best first
SCREENSHOT_LESSONS = ("04", "01", "05", "02")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LESSON_STALL_S = 300     # no cell of a Run All finished for this long: stuck
LESSON_CAP_S = 900       # all cells of one lesson, however busy the machine
RUN_TIMEOUT_S = 120      # one panel run after a click


def _find_chromium() -> str | None:
    for cand in (os.environ.get("GPULAB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and os.path.exists(cand):
            return cand
    return None


def _install_chromium() -> None:
    """apt-get install Debian's chromium, as root or through passwordless sudo."""
    if shutil.which("apt-get") is None:
        return
    prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if prefix is None:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(prefix + ["apt-get", "update"], env=env, capture_output=True, timeout=600)
    subprocess.run(prefix + ["apt-get", "install", "-y", "chromium"], env=env, capture_output=True,
                   timeout=900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for s in self.api("GET", "/api/sessions") or []:
            self.api("DELETE", f"/api/sessions/{s['id']}")
        for k in self.api("GET", "/api/kernels") or []:
            self.api("DELETE", f"/api/kernels/{k['id']}")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find_chromium()
    if path is None:
        _install_chromium()
        path = _find_chromium()
    if path is None:
        pytest.skip("Chromium not found at /usr/bin/chromium and could not be installed "
                    "(run `apt-get install -y chromium` as root, or set GPULAB_CHROMIUM)")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A headless JupyterLab on a free localhost port, with throwaway config/runtime/settings dirs."""
    tmp = tmp_path_factory.mktemp("jupyter")
    token = secrets.token_hex(16)
    port = _free_port()
    env = dict(os.environ)
    env.update(JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "ws"),
               PYTHONUNBUFFERED="1")
    env.pop("MPLBACKEND", None)  # what a student gets: the kernel picks the inline backend
    env.pop("JUPYTER_PATH", None)
    # every cell in the DOM (no windowed rendering), no news/update toasts
    nb_settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    nb_settings.mkdir(parents=True)
    (nb_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # the lessons are the repository's files: a Run All that outlasts the autosave interval
    # (120 s) would write its outputs into them (lesson 12 did, and test_lessons then failed)
    dm_settings = tmp / "settings" / "@jupyterlab" / "docmanager-extension"
    dm_settings.mkdir(parents=True)
    (dm_settings / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    (tmp / "config" / "labconfig").mkdir(parents=True)
    (tmp / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    log = open(tmp / "lab.log", "w")
    jupyter = pathlib.Path(sys.executable).with_name("jupyter")
    proc = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={LESSONS_DIR}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=str(LESSONS_DIR), env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Lab(f"http://127.0.0.1:{port}", token)
    deadline = time.time() + 120
    while True:
        try:
            server.api("GET", "/api/status")
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield server
    try:
        server.shutdown_kernels()
    except Exception:
        pass
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed: pip install -e '.[test]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


# ---------------------------------------------------------------------------------------------
# page helpers

def _wait_kernel_idle(page, stall_s: float, cap_s: float = LESSON_CAP_S) -> None:
    """Wait until the notebook's kernel is idle and no cell shows [*] (twice in a row, 0.5 s apart,
    so a cell queued right after another does not slip through).

    Between two cells of a Run All the kernel is idle for a moment while the queued cells still
    show [*]: "idle but [*]" is a lesson still running, not a lost message (the suite's one
    failure of this kind was lesson 12 taking longer than the fixed 300 s wait on a loaded
    machine). So the wait follows progress: it goes on while cells keep finishing, fails when none
    has finished for ``stall_s`` seconds (or after ``cap_s`` in all), and says which cell it saw
    stuck, how many had run and what the kernel reported."""
    js = """() => {
      const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
      const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
      const prompts = [...document.querySelectorAll('.jp-CodeCell')].map(c => {
        const p = c.querySelector('.jp-InputPrompt');
        return {prompt: p ? p.textContent.trim() : '', src: (c.querySelector('.jp-InputArea-editor') || c).textContent.slice(0, 80)};
      });
      const running = prompts.findIndex(p => p.prompt.includes('[*]'));
      const done = prompts.filter(p => /\[\d+\]/.test(p.prompt)).length;
      return {status: k ? k.status : 'none', busy: running >= 0, running, done, cells: prompts.length,
              stuck: running >= 0 ? prompts[running].src : ''};
    }"""
    t0 = time.time()
    last_done, last_progress = -1, t0
    quiet = 0
    while True:
        st = page.evaluate(js)
        now = time.time()
        if st["done"] != last_done:
            last_done, last_progress = st["done"], now
        quiet = quiet + 1 if (st["status"] == "idle" and not st["busy"]) else 0
        if quiet >= 2:
            return
        if now - last_progress > stall_s or now - t0 > cap_s:
            why = (f"no cell finished for {now - last_progress:.0f} s" if now - last_progress > stall_s
                   else f"still running after {cap_s:.0f} s")
            raise AssertionError(
                f"{why}: {st['done']} of {st['cells']} code cells ran; kernel {st['status']}; "
                + (f"cell {st['running'] + 1} shows [*]: {st['stuck']!r}" if st["busy"] else "no cell shows [*]"))
        page.wait_for_timeout(500)


def _dismiss_dialogs(page) -> None:
    """A kernel-selection dialog (lesson without kernelspec) is accepted with its default."""
    for _ in range(3):
        dlg = page.locator(".jp-Dialog")
        if dlg.count() == 0:
            return
        page.keyboard.press("Enter")
        page.wait_for_timeout(300)


def _run_all(page) -> None:
    """Run > Run All Cells from the menu bar (falls back to the command, as a palette user would)."""
    try:
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).first.click(timeout=5000)
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).first.click(timeout=5000)
    except Exception:
        page.keyboard.press("Escape")
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def _page_errors(page) -> list[str]:
    errors = page.evaluate("""() => {
      const out = [];
      const vis = e => !!(e.offsetWidth || e.offsetHeight || e.getClientRects().length);
      document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        .forEach(e => { if (/Traceback|Error:/.test(e.innerText)) out.push('stderr/error output: ' + e.innerText.slice(0, 400)); });
      document.querySelectorAll('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]')
        .forEach(e => { if (/Traceback/.test(e.innerText)) out.push('traceback: ' + e.innerText.slice(0, 400)); });
      document.querySelectorAll('.gpulab-error').forEach(e => { if (vis(e)) out.push('gpulab-error: ' + e.innerText.slice(0, 400)); });
      document.querySelectorAll('.jp-RenderedText').forEach(e => {
        if (/Error displaying widget|Failed to load model class|A Jupyter widget could not be displayed/.test(e.innerText))
          out.push('widget not rendered: ' + e.innerText.slice(0, 200)); });
      return out;
    }""")
    return list(dict.fromkeys(errors))


def _output_text(panel) -> str:
    return panel.locator(".gpulab-output").first.inner_text()


def _status_text(panel) -> str:
    st = panel.locator(".gpulab-status")
    return st.first.inner_text() if st.count() else ""


def _wait_panel_idle(page, panel, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """The Run button is disabled while a run is in progress; wait for it to come back, then for
    the kernel to go idle (an auto-run panel runs on the kernel without disabling anything first)."""
    deadline = time.time() + timeout_s
    page.wait_for_timeout(300)
    btn = panel.locator("button.gpulab-run").first
    while time.time() < deadline:
        if btn.count() == 0 or btn.is_enabled():
            break
        page.wait_for_timeout(250)
    left = max(5.0, deadline - time.time())
    _wait_kernel_idle(page, left, cap_s=left)
    page.wait_for_timeout(400)  # the last output message reaches the DOM


def _nudge_control(page, panel) -> str | None:
    """Change one control, as a student would. Returns a description, or None when the panel has no
    control we can move. Sliders first (focus the handle, press ArrowRight or ArrowLeft at the end),
    then dropdowns (pick the next option), then checkboxes."""
    handles = panel.locator(".noUi-handle, .ui-slider-handle")
    for i in range(handles.count()):
        h = handles.nth(i)
        if not h.is_visible():
            continue
        before = h.get_attribute("aria-valuenow") or h.get_attribute("aria-valuetext")
        h.focus()
        h.press("ArrowRight")
        page.wait_for_timeout(200)
        after = h.get_attribute("aria-valuenow") or h.get_attribute("aria-valuetext")
        if after == before:  # already at the maximum
            h.press("ArrowLeft")
            h.press("ArrowLeft") if after == (h.get_attribute("aria-valuenow") or h.get_attribute("aria-valuetext")) else None
            page.wait_for_timeout(200)
            after = h.get_attribute("aria-valuenow") or h.get_attribute("aria-valuetext")
        if after != before:
            # a keyboard move on noUiSlider only fires 'change' on keyup/blur in some versions
            h.evaluate("e => e.blur()")
            return f"slider {i}: {before} -> {after}"
    selects = panel.locator(".widget-dropdown select")
    for i in range(selects.count()):
        s = selects.nth(i)
        if not s.is_visible() or not s.is_enabled():
            continue
        options = s.locator("option").all_inner_texts()
        if len(options) < 2:
            continue
        current = s.evaluate("e => e.options[e.selectedIndex] ? e.options[e.selectedIndex].text : ''")
        idx = options.index(current) if current in options else -1
        new = options[(idx + 1) % len(options)]
        s.select_option(label=new)
        return f"dropdown {i}: {current} -> {new}"
    boxes = panel.locator(".widget-checkbox input[type=checkbox]")
    for i in range(boxes.count()):
        if boxes.nth(i).is_visible():
            boxes.nth(i).click()
            return f"checkbox {i}"
    return None


def _panel_screenshot(page, panel, path) -> None:
    """Screenshot one panel whole: a panel taller than the window would be clipped by the
    notebook's scroll area, so grow the window to fit it for the shot."""
    size = page.viewport_size
    box = panel.bounding_box()
    need = int(box["height"]) + 250 if box else size["height"]
    if need > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": min(need, 6000)})
        page.wait_for_timeout(300)
    try:
        panel.scroll_into_view_if_needed()
        panel.screenshot(path=str(path))
    finally:
        page.set_viewport_size(size)


def _save_panel_png(page, panel, path: pathlib.Path) -> None:
    """A small PNG of one panel for the README: crop, downscale if wide, 8-bit palette."""
    from PIL import Image
    raw = path.with_suffix(".raw.png")
    _panel_screenshot(page, panel, raw)
    img = Image.open(raw).convert("RGB")
    if img.width > 1000:
        img = img.resize((1000, round(img.height * 1000 / img.width)), Image.LANCZOS)
    for colors in (256, 128, 64):
        img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if path.stat().st_size < 200_000:
            break
    raw.unlink()


# ---------------------------------------------------------------------------------------------

def test_there_are_lessons_for_the_browser():
    assert NOTEBOOKS, f"no lessons found in {LESSONS_DIR}"


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.timeout(LESSON_CAP_S + 300)   # the Run All wait's cap, then the panels
@pytest.mark.xdist_group("browser")  # one JupyterLab server and browser for all lessons
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_in_browser(path, lab, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    console_errors: list[str] = []
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    t0 = time.perf_counter()
    report: list[str] = []
    stored = path.read_bytes()
    try:
        # a workspace of its own, reset, so only this lesson's tab is open (JupyterLab would
        # otherwise restore the previous lesson's tab next to it)
        page.goto(f"{lab.url}/lab/workspaces/{path.stem}/tree/{path.name}?reset&token={lab.token}",
                  wait_until="domcontentloaded")
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=90_000)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                               "&& window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
        _dismiss_dialogs(page)
        # the kernel must be up before Run All, or the first cells wait on a dialog-less start
        page.wait_for_function("""() => { const s = window.jupyterapp.shell.currentWidget.sessionContext;
            return s.session && s.session.kernel && s.session.kernel.status === 'idle'; }""", timeout=120_000)
        open_tabs = page.locator(".jp-NotebookPanel").count()
        assert open_tabs == 1, f"{open_tabs} notebooks open, expected only {path.name}"
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(position={"x": 5, "y": 5})
        _run_all(page)
        page.wait_for_timeout(1000)
        _wait_kernel_idle(page, LESSON_STALL_S)
        page.wait_for_timeout(1000)
        run_s = time.perf_counter() - t0
        page.screenshot(path=str(ARTIFACTS / f"{path.stem}.png"))

        errors = _page_errors(page)
        assert not errors, f"{path.name} after Run All:\n" + "\n".join(errors)
        not_run = page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
            .filter(e => /\\[\\s*\\]/.test(e.textContent)).length""")
        assert not_run == 0, f"{path.name}: {not_run} code cells were not executed"

        panels = page.locator(".gpulab-panel")
        n = panels.count()
        for i in range(n):
            panel = panels.nth(i)
            panel.scroll_into_view_if_needed()
            _wait_panel_idle(page, panel)
            before = _output_text(panel)
            _panel_screenshot(page, panel, ARTIFACTS / f"{path.stem}_panel{i}_before.png")
            moved = _nudge_control(page, panel)
            _wait_panel_idle(page, panel)          # auto-run panels rerun on the change
            btn = panel.locator("button.gpulab-run").first
            if btn.count() and btn.is_visible():
                btn.click()
                _wait_panel_idle(page, panel)
            after = _output_text(panel)
            status = _status_text(panel)
            _panel_screenshot(page, panel, ARTIFACTS / f"{path.stem}_panel{i}.png")
            errors = _page_errors(page)
            assert not errors, f"{path.name} panel {i} after {moved}:\n" + "\n".join(errors)
            assert btn.count() == 0 or btn.is_enabled(), f"{path.name} panel {i}: Run button still disabled"
            assert "failed" not in status, f"{path.name} panel {i}: status {status!r}"
            assert after.strip(), f"{path.name} panel {i}: empty output after a run"
            assert "<Figure size" not in after, (
                f"{path.name} panel {i}: a matplotlib figure shows as its text repr, not a picture "
                f"(the kernel has no PNG formatter for Figure unless pyplot/the inline backend was "
                f"loaded):\n{after[:500]}")
            if moved is not None:
                assert after != before, (f"{path.name} panel {i}: output did not change after {moved} "
                                         f"and Run (status {status!r}):\n{after[:500]}")
            else:
                assert "done in" in status or "not run" in status, \
                    f"{path.name} panel {i} has no control to move and Run did not finish: {status!r}"
            report.append(f"panel {i}: {moved or 'Run only'}; status {status!r}")
            if (os.environ.get("GPULAB_UPDATE_SCREENSHOT") == "1" and i == 0
                    and path.name[:2] == _screenshot_lesson()):
                PANEL_PNG.parent.mkdir(parents=True, exist_ok=True)
                _save_panel_png(page, panel, PANEL_PNG)
                report.append(f"wrote {PANEL_PNG} ({PANEL_PNG.stat().st_size} bytes)")
        page.screenshot(path=str(ARTIFACTS / f"{path.stem}_after_panels.png"))
        assert not console_errors, f"{path.name}: JavaScript errors: {console_errors[:5]}"
        assert path.read_bytes() == stored, f"{path.name} was saved by JupyterLab during the test"
        print(f"{path.name}: run all {run_s:.1f} s, {n} panels, total {time.perf_counter() - t0:.1f} s; "
              + "; ".join(report))
    finally:
        ctx.close()
        lab.shutdown_kernels()


def _screenshot_lesson() -> str | None:
    """The lesson number whose first panel becomes docs/panel.png: the first present in
    SCREENSHOT_LESSONS that has a panel (checked by source text), else the first with a panel."""
    with_panel = [p.name[:2] for p in NOTEBOOKS if "_panel(" in p.read_text() or "Panel(" in p.read_text()]
    for num in SCREENSHOT_LESSONS:
        if num in with_panel:
            return num
    return with_panel[0] if with_panel else None
