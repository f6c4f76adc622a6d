"""The course site (``make site``, docs/site.md) checked in a real browser: headless Chromium
(Debian's, as in test_browser.py) on the built folder served on 127.0.0.1.

* every page renders: a title, a body with text, no JavaScript error, no failed request;
* no page needs the internet: every request that leaves 127.0.0.1 is blocked and counted
  (links to other sites are only links: they are not followed), except PyTorch's own memory
  viewer in lesson 13, which loads its script from a CDN and says so (ALLOWED_EXTERNAL);
* every ``<img>`` loads (``naturalWidth > 0``), widget output included;
* no internal link is broken: every internal href answers 200, and its ``#anchor`` exists;
* every lesson executed without an error (no myst-nb report);
* every lesson page has Colab and Binder launch links to that lesson's notebook in the repository
  (site/conf.py's REPO_URL), and each lesson built has its page;
* the saved ipywidgets state renders as widgets (@jupyter-widgets/html-manager, served locally);
* the search box finds a word that is in a lesson.

Skipped unless the site is built (``build/site/html/index.html``), so ``make test`` does not build
it: ``make test-site`` builds it, then runs this file (marker ``site``). ``GPULAB_SITE_DIR``
points at another built folder. Screenshots of the landing page, a lesson and the search go to
``test-artifacts/site/``. Everything waits with a timeout; the crawl as a whole has a deadline.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import pathlib
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import LESSONS, ROOT
from test_browser import CHROMIUM_ARGS, browser, chromium  # noqa: F401  (fixtures)

SITE = pathlib.Path(os.environ.get("GPULAB_SITE_DIR", ROOT / "build" / "site" / "html")).resolve()
ARTIFACTS = ROOT / "test-artifacts" / "site"
REPO = "gpulab/gpulab"          # site/conf.py: REPO_ORG/REPO_NAME
BRANCH = "main"
SEARCH_WORD = "checkpointing"   # in lesson 07 (and others)
PAGE_TIMEOUT_MS = 30_000
CRAWL_DEADLINE_S = 600

pytestmark = [
    pytest.mark.site,
    pytest.mark.xdist_group("site"),   # one crawl, one server, on one worker under -n auto
    pytest.mark.skipif(not (SITE / "index.html").exists(),
                       reason=f"the site is not built ({SITE}/index.html): run `make test-site`"),
]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url():
    """The built folder served over HTTP on a free port of 127.0.0.1 (loopback only)."""
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _lesson_pages() -> list[pathlib.Path]:
    return sorted((SITE / "lessons").glob("[0-9][0-9]_*.html"))


class Crawl:
    """What a visit of every page found: per page its problems, ids, links and images."""

    def __init__(self):
        self.problems: list[str] = []
        self.external_requests: set[str] = set()
        self.ids: dict[str, set[str]] = {}
        self.links: dict[str, set[str]] = {}     # page -> internal hrefs (absolute, with #)
        self.images = 0
        self.pages: list[str] = []
        self.figure_text: dict[str, int] = {}    # page -> "<Figure size ...>" texts shown


_IN_PAGE_JS = """() => {
  const imgs = [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}));
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id)
      .concat([...document.querySelectorAll('a[name]')].map(e => e.getAttribute('name')));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const main = document.querySelector('main, article, [role=main]') || document.body;
  return {title: document.title, text: (main.innerText || '').trim().length, imgs, ids, links,
          figures: (document.body.innerText.match(/<Figure size [^>]*>/g) || []).length,
          views: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length,
          widgets: document.querySelectorAll('.jupyter-widgets, .widget-inline-hbox, .widget-output').length};
}"""


def _settle(page) -> None:
    """Every image either loaded or failed, and the fonts loaded (not "network idle": the page
    may keep a connection open)."""
    page.wait_for_function("() => document.readyState === 'complete' && "
                           "[...document.images].every(i => i.complete)", timeout=PAGE_TIMEOUT_MS)
    page.evaluate("() => document.fonts.ready.then(() => true)")


# What a page may ask the internet for, and why. Lesson 13 shows PyTorch's own memory viewer
# (torch.cuda._memory_viz.trace_plot) in a frame; PyTorch's page imports MemoryViz.js from a CDN
# (and it d3), the torch wheel does not ship that script, and the lesson says so above the frame,
# which shows a line saying it is offline when it is. Nothing else may leave 127.0.0.1.
ALLOWED_EXTERNAL = (
    re.compile(r"^https://cdn\.jsdelivr\.net/gh/pytorch/pytorch@[^/]+/torch/utils/viz/MemoryViz\.js$"),
    re.compile(r"^https://cdn\.skypack\.dev/d3"),
)

# console errors that say nothing about the page: the browser's own favicon request (Sphinx
# writes no favicon), and pydata-sphinx-theme's notice on a first visit (no theme stored yet)
_HARMLESS = (re.compile(r"Got invalid theme mode"),)


def _visit(page, url: str, crawl: Crawl) -> dict:
    errors: list[str] = []

    def on_console(m):
        if m.type != "error" or any(h.search(m.text) for h in _HARMLESS):
            return
        where = (m.location or {}).get("url", "")
        if where.endswith("favicon.ico"):
            return
        if where.startswith(("http:", "https:")) and urllib.parse.urlsplit(where).hostname != "127.0.0.1":
            # a request that the route did not see (a module import in an srcdoc frame): the
            # browser reports it when it fails
            crawl.external_requests.add(where)
            return
        errors.append(f"console: {m.text}" + (f" ({where})" if where else ""))
    on_pageerror = lambda e: errors.append(f"page error: {e}")
    page.on("console", on_console)
    page.on("pageerror", on_pageerror)
    try:
        resp = page.goto(url, wait_until="load", timeout=PAGE_TIMEOUT_MS)
        if resp is None or resp.status != 200:
            crawl.problems.append(f"{url}: HTTP {resp and resp.status}")
        _settle(page)
        info = page.evaluate(_IN_PAGE_JS)
        if info["views"]:   # saved widget state: wait for html-manager to draw the widgets
            try:
                page.wait_for_function(
                    "() => document.querySelectorAll('.jupyter-widgets, .widget-output').length > 0",
                    timeout=PAGE_TIMEOUT_MS)
                _settle(page)
            except Exception:
                pass
            info = page.evaluate(_IN_PAGE_JS)
            if not info["widgets"]:
                crawl.problems.append(f"{url}: {info['views']} saved widget view(s), none rendered")
    finally:
        page.remove_listener("console", on_console)
        page.remove_listener("pageerror", on_pageerror)
    crawl.problems += [f"{url}: {e}" for e in errors]
    if not info["title"].strip():
        crawl.problems.append(f"{url}: no title")
    if info["text"] < 20:
        crawl.problems.append(f"{url}: an empty body ({info['text']} characters)")
    for img in info["imgs"]:
        if not img["ok"]:
            crawl.problems.append(f"{url}: image did not load: {img['src'][:120]}")
    crawl.images += len(info["imgs"])
    if info["figures"]:
        crawl.figure_text[url] = info["figures"]
    return info


def _crawl(browser, base: str) -> Crawl:
    crawl = Crawl()
    context = browser.new_context(viewport={"width": 1280, "height": 900})

    def route(r):
        host = urllib.parse.urlsplit(r.request.url).hostname
        if r.request.url.startswith("data:") or host == "127.0.0.1":
            return r.continue_()
        crawl.external_requests.add(r.request.url)
        return r.abort()
    context.route("**/*", route)
    page = context.new_page()
    # every page on disk, plus what links reach (a page only reachable by a link is still seen)
    todo = [base + p.relative_to(SITE).as_posix() for p in sorted(SITE.rglob("*.html"))
            if not p.relative_to(SITE).parts[0].startswith(("_static", "_sources"))]
    seen: set[str] = set()
    deadline = time.monotonic() + CRAWL_DEADLINE_S
    while todo:
        url = todo.pop(0)
        if url in seen:
            continue
        seen.add(url)
        if time.monotonic() > deadline:
            crawl.problems.append(f"the crawl ran past {CRAWL_DEADLINE_S} s; {len(todo) + 1} pages not visited")
            break
        info = _visit(page, url, crawl)
        crawl.pages.append(url)
        crawl.ids[url] = set(info["ids"])
        internal = {h for h in info["links"] if h.startswith(base)}
        crawl.links[url] = internal
        for h in internal:
            target = h.split("#", 1)[0]
            if target.endswith(".html") and target not in seen:
                todo.append(target)
    context.close()
    return crawl


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def crawl(browser, site_url) -> Crawl:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return _crawl(browser, site_url)


def test_every_page_renders_offline_with_its_images(crawl):
    (ARTIFACTS / "crawl.json").write_text(json.dumps(
        {"pages": crawl.pages, "images": crawl.images, "problems": crawl.problems,
         "external_requests": sorted(crawl.external_requests),
         "figure_text": crawl.figure_text}, indent=1))
    print(f"{len(crawl.pages)} pages, {crawl.images} images; '<Figure size ...>' shown as text: "
          f"{crawl.figure_text or 'nowhere'}")
    assert len(crawl.pages) >= 3
    external = sorted(u for u in crawl.external_requests if not any(a.search(u) for a in ALLOWED_EXTERNAL))
    assert not external, "pages asked the internet for (blocked): " + "\n".join(external)
    assert not crawl.problems, "\n".join(crawl.problems)


def test_no_plot_is_shown_as_figure_text(crawl):
    """A cell that returns a matplotlib Figure should show the plot, not its repr."""
    assert not crawl.figure_text, f"'<Figure size ...>' shown as text: {crawl.figure_text}"


def test_no_internal_link_is_broken(crawl, site_url):
    broken = []
    status: dict[str, int] = {}
    deadline = time.monotonic() + CRAWL_DEADLINE_S
    for page, hrefs in sorted(crawl.links.items()):
        for href in sorted(hrefs):
            target, _, anchor = href.partition("#")
            if target not in status:
                assert time.monotonic() < deadline, f"link check ran past {CRAWL_DEADLINE_S} s"
                status[target] = _status(target)
            if status[target] != 200:
                broken.append(f"{page} -> {href}: HTTP {status[target]}")
            elif anchor and target in crawl.ids:
                if urllib.parse.unquote(anchor) not in crawl.ids[target]:
                    broken.append(f"{page} -> {href}: no element with id '{anchor}'")
    print(f"{sum(map(len, crawl.links.values()))} internal links to {len(status)} targets checked")
    assert status, "no internal links found"
    assert not broken, "\n".join(broken)


def test_every_lesson_executed_without_error():
    """myst-nb writes reports/<lesson>.err.log (the traceback) for a lesson whose execution failed
    (the build goes on, and its page lacks the outputs); the Makefile clears them before a build."""
    reports = sorted((SITE / "reports").rglob("*.err.log"))
    assert not reports, "lessons that failed to execute:\n" + "\n".join(
        f"{r.relative_to(SITE)}:\n{r.read_text()[-1500:]}" for r in reports)


def test_every_lesson_has_its_page_and_launch_buttons(browser, site_url):
    pages = _lesson_pages()
    built = {p.stem for p in pages}
    subset = [s.strip() for s in os.environ.get("SITE_LESSONS", "").split(",") if s.strip()]
    expected = {p.stem for p in LESSONS.glob("[0-9][0-9]_*.ipynb") if not subset or p.name[:2] in subset}
    assert expected <= built, f"lessons without a page: {sorted(expected - built)}"
    page = browser.new_page()
    missing = []
    try:
        for p in pages:
            page.goto(f"{site_url}lessons/{p.name}", wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)
            hrefs = page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)")
            nb = f"lessons/{p.stem}.ipynb"
            colab = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/{nb}"
            binder = f"https://mybinder.org/v2/gh/{REPO}/{BRANCH}?urlpath=lab/tree/{nb}"
            if colab not in hrefs:
                missing.append(f"{p.name}: no Colab link {colab}")
            if binder not in hrefs:
                missing.append(f"{p.name}: no Binder link {binder}")
    finally:
        page.close()
    assert not missing, "\n".join(missing)


def test_lesson_page_shows_widgets_and_plots(browser, site_url):
    """A lesson page with a panel: the panel's saved state is drawn (controls and the Output
    widget), and the page has its plots as images; the screenshot is for a person to look at."""
    pages = _lesson_pages()
    with_views = [p for p in pages if "application/vnd.jupyter.widget-view+json" in p.read_text()]
    if not with_views:
        pytest.skip("no lesson page with saved widget state")
    p = next((q for q in with_views if q.name.startswith("07")), with_views[0])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{site_url}lessons/{p.name}", wait_until="load", timeout=PAGE_TIMEOUT_MS)
        page.wait_for_function("() => document.querySelectorAll('.jupyter-widgets').length > 0",
                               timeout=PAGE_TIMEOUT_MS)
        _settle(page)
        widgets = page.locator(".jupyter-widgets")
        widgets.first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"{p.stem}_panel.png"))
        page.screenshot(path=str(ARTIFACTS / f"{p.stem}_full.png"), full_page=True)
        controls = page.locator(".widget-slider, .widget-dropdown, .widget-button, .widget-toggle-buttons").count()
        assert controls > 0, f"{p.name}: the panel's controls are not drawn"
        imgs = page.evaluate("() => [...document.querySelectorAll('main img')].filter(i => i.naturalWidth > 0).length")
        assert imgs > 0, f"{p.name}: no image on the page"
    finally:
        page.close()


def test_search_finds_a_word_from_a_lesson(browser, site_url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{site_url}search.html?q={SEARCH_WORD}", wait_until="load", timeout=PAGE_TIMEOUT_MS)
        page.wait_for_function("() => document.querySelectorAll('#search-results li a, ul.search li a').length > 0",
                               timeout=PAGE_TIMEOUT_MS)
        hits = page.eval_on_selector_all("#search-results li a, ul.search li a", "as => as.map(a => a.href)")
        page.screenshot(path=str(ARTIFACTS / "search.png"))
        lesson_hits = [h for h in hits if "/lessons/" in h]
        assert lesson_hits, f"searching '{SEARCH_WORD}' found no lesson: {hits}"
        # and the box itself: typing in the header's search field lands on the same results
        page.goto(f"{site_url}index.html", wait_until="load", timeout=PAGE_TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "index.png"))
        page.keyboard.press("Control+k")
        box = page.locator("input[name=q]:visible").first
        box.fill(SEARCH_WORD)
        box.press("Enter")
        page.wait_for_url(re.compile(r"search\.html\?q="), timeout=PAGE_TIMEOUT_MS)
        page.wait_for_function("() => document.querySelectorAll('#search-results li a, ul.search li a').length > 0",
                               timeout=PAGE_TIMEOUT_MS)
    finally:
        page.close()
