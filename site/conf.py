"""Sphinx configuration of the course site (``make site``; see docs/site.md).

The Makefile copies what the site shows into ``build/site/src``: ``index.md`` (the README, the
landing page), ``lessons/*.ipynb``, ``docs/``, and ``_assets/`` (``site/assets``), keeping their
times, so that the README's and the lessons' relative links resolve as in the repository. (Not
symlinks: MyST resolves a link from the file's real path.) Sphinx reads that folder with this
file as its configuration (``-c site``) and writes ``build/site/html``. Lessons execute on the
CPU, in ``build/site/src/lessons``, by myst-nb through jupyter-cache
(``build/site/jupyter_cache``): a rebuild executes again only lessons whose code changed (the Makefile clears the cache when a file under gpulab/ changes).

Nothing here is fetched from the internet when a page is viewed: the theme ships its fonts and
icons, MathJax comes from the ``sphinx-mathjax-offline`` wheel, the ipywidgets renderer
(@jupyter-widgets/html-manager's ``embed.js``) from the npm registry at build time into
``build/site/vendor/static/widgets`` (see the Makefile), and the Colab/Binder badge pictures the lessons and the
README load from colab.research.google.com and mybinder.org are replaced by local copies.

``SITE_LESSONS=00,07`` builds only those lessons (for iterating on the site: each lesson executes
for up to a minute or two on a CPU).
"""
from __future__ import annotations

import json
import os
import pathlib
import posixpath
import re

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BUILD = ROOT / "build" / "site"

# The one place the repository's address lives for the site: the launch buttons (Binder, Colab),
# the repository button. The README's badges and the lessons' Colab links assume the same path.
REPO_ORG, REPO_NAME, REPO_BRANCH = "gpulab", "gpulab", "main"
REPO_URL = f"https://github.com/{REPO_ORG}/{REPO_NAME}"

project = "gpulab"
author = "the gpulab authors"
copyright = "the gpulab authors (MIT licence)"
html_title = "gpulab: where does GPU memory go?"

extensions = ["myst_nb", "sphinx-mathjax-offline"]
root_doc = "index"
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# Which lessons: all of them, or the numbers in SITE_LESSONS ("00,07").
_subset = [s.strip() for s in os.environ.get("SITE_LESSONS", "").split(",") if s.strip()]
_lessons = sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
exclude_patterns = ["**/.ipynb_checkpoints", "lessons/lesson*_files", "docs/_build"]
exclude_patterns += [f"lessons/{n}" for n in _lessons if _subset and n[:2] not in _subset]
# notebooks other than the numbered lessons (drafts, scratch) stay out
exclude_patterns += [f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb")
                     if p.name not in _lessons]

# --- MyST -------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "html_image",
                          "strikethrough"]
myst_heading_anchors = 4          # the README and docs link to #section-anchors
suppress_warnings = ["myst.strikethrough"]

# --- executing the lessons --------------------------------------------------------------------
nb_execution_mode = "cache"
nb_execution_cache_path = str(BUILD / "jupyter_cache")
nb_execution_timeout = 1200       # seconds per cell: a busy 2-core machine, the largest sweeps
nb_execution_allow_errors = False
nb_execution_raise_on_error = False   # a failing lesson is reported (and its page says so) ...
nb_execution_show_tb = True           # ... with its traceback in the build log
nb_merge_streams = True
nb_execution_excludepatterns: list[str] = []

# The ipywidgets renderer, served from this site (no CDN). embed.js is the standalone build:
# it carries @jupyter-widgets/base, controls and output, which is all gpulab's panels use.
_WIDGETS = BUILD / "vendor" / "static" / "widgets"
if (_WIDGETS / "embed.js").exists():
    nb_ipywidgets_js = {"widgets/embed.js": {}}
else:   # npm was not available: the pages show the widgets' text form, never a CDN script
    nb_ipywidgets_js = {}

# --- HTML -------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_static_path = [str(HERE / "static")] + ([str(_WIDGETS.parent)] if (_WIDGETS / "embed.js").exists() else [])
html_theme_options = {
    "repository_url": REPO_URL,
    "repository_branch": REPO_BRANCH,
    "path_to_docs": "",                     # the staged tree mirrors the repository's root
    "use_repository_button": True,
    "use_download_button": True,            # the page's .ipynb and .md
    "use_fullscreen_button": False,
    "launch_buttons": {
        "binderhub_url": "https://mybinder.org",
        "colab_url": "https://colab.research.google.com",
        "notebook_interface": "jupyterlab",
    },
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_css_files = ["gpulab-site.css"]
html_last_updated_fmt = None
html_copy_source = True
html_show_sourcelink = False

# Badge pictures the README and the lessons load from the services themselves: local copies,
# so that no page needs the internet to render. (The links around them stay as they are.)
_BADGES = {
    "https://colab.research.google.com/assets/colab-badge.svg": "/_assets/colab-badge.svg",
    "https://mybinder.org/badge_logo.svg": "/_assets/binder-badge.svg",
}

# Sidebar: the landing page (the README) gets the lessons and the docs as hidden toctrees, so
# a new docs/*.md page or lesson comes in without editing anything here.
_TOCTREES = """

```{toctree}
:hidden:
:caption: Lessons
:glob:

lessons/[0-9][0-9]_*
```

```{toctree}
:hidden:
:caption: Docs
:glob:

docs/*
```
"""


# At the top of each lesson (after its first cell, beside the Colab cell): what the page is, and
# where the lesson runs.
STATIC_NOTE = """:::{note}
This page is the lesson as it ran **on a CPU** when the site was built: its tables, plots and
panels are saved outputs, labelled as the lesson labels them. A panel's controls move here, but
nothing recomputes (a static page runs no Python). To run the lesson, open it on Colab or Binder
from the rocket icon at the top of the page, or in JupyterLab on your machine with `make lab`.
:::"""


_HTML_ANCHOR = re.compile(r"""^<a (?:id|name)=["']([A-Za-z][\w.-]*)["']>\s*</a>[ \t]*$""", re.M)


def _source_read(app, docname, source):
    text = source[0]
    for remote, local in _BADGES.items():   # "/..." is the source folder's root in Sphinx
        text = text.replace(remote, local)
    if not text.lstrip().startswith("{"):   # Markdown: an HTML anchor line becomes a MyST target,
        text = _HTML_ANCHOR.sub(r"(\1)=", text)   # so links to page.md#anchor resolve (and say so)
    if docname == root_doc:
        text += _TOCTREES
    if docname.startswith("lessons/") and text.lstrip().startswith("{"):
        nb = json.loads(text)
        note = {"cell_type": "markdown", "metadata": {}, "source": STATIC_NOTE}
        nb["cells"].insert(1 if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown" else 0, note)
        text = json.dumps(nb)
    source[0] = text


class RepositoryLinks(SphinxPostTransform):
    """A relative link to a file of the repository that the site does not carry (a module, the
    Makefile, ``gpulab/recorded/README.md``, a lesson left out by SITE_LESSONS) points at that file
    on GitHub, instead of MyST's dead ``#target`` anchor. Runs before MyST resolves links (9)."""

    default_priority = 8

    def run(self, **kwargs):
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst":
                continue
            refdoc = node.get("refdoc", self.env.docname)
            anchor = node.get("reftargetid") or ""
            if node.get("refdomain") == "doc":
                docname = node["reftarget"]
                if docname in self.env.all_docs:
                    continue
                rel = pathlib.PurePosixPath(docname)
                if rel.is_absolute():   # MyST gives a path outside the source folder absolute
                    continue
                found = [rel.with_suffix(x) for x in (".ipynb", ".md") if (ROOT / rel.with_suffix(x)).exists()]
                if not found:
                    continue
                path = str(found[0])
            elif node.get("refdomain") is None:
                target = node["reftarget"]
                if "://" in target or target.startswith(("#", "mailto:")):
                    continue
                target, _, anchor = target.partition("#")
                path = posixpath.normpath(posixpath.join(posixpath.dirname(refdoc), target))
                if path.startswith("..") or not (ROOT / path).exists():
                    continue
            else:
                continue
            kind = "tree" if (ROOT / path).is_dir() else "blob"
            url = f"{REPO_URL}/{kind}/{REPO_BRANCH}/{path}" + (f"#{anchor}" if anchor else "")
            ref = nodes.reference("", "", refuri=url, internal=False)
            ref += node.children[0].deepcopy() if node.children else nodes.literal(path, path)
            node.replace_self(ref)


_RAW_HREF = re.compile(r"""href=(["'])([^"':#]+\.(?:ipynb|md))(#[^"']*)?\1""")


class RawHtmlLinks(SphinxPostTransform):
    """HTML that a cell printed (gpulab's tables link lessons as ``01_tensor_bytes.ipynb``) links
    the page the site has for that notebook (``01_tensor_bytes.html``), or the file on GitHub
    when the site does not carry it. Markdown links are MyST's; this is only raw HTML."""

    default_priority = 8

    def run(self, **kwargs):
        docdir = posixpath.dirname(self.env.docname)

        def fix(m):
            quote, target, anchor = m.group(1), m.group(2), m.group(3) or ""
            path = posixpath.normpath(posixpath.join(docdir, target))
            docname = posixpath.splitext(path)[0]
            if docname in self.env.all_docs:
                url = posixpath.splitext(target)[0] + ".html" + anchor
            elif not path.startswith("..") and (ROOT / path).exists():
                url = f"{REPO_URL}/blob/{REPO_BRANCH}/{path}{anchor}"
            else:
                return m.group(0)
            return f"href={quote}{url}{quote}"

        for node in list(self.document.findall(nodes.raw)):
            if "html" in node.get("format", "").split() and (".ipynb" in node.astext() or ".md" in node.astext()):
                text = _RAW_HREF.sub(fix, node.astext())
                if text != node.astext():
                    node.replace_self(nodes.raw(text, text, format=node["format"]))


def setup(app):
    app.add_post_transform(RawHtmlLinks)
    # @jupyter-widgets/base typesets widget text with MathJax 2's MathJax.Hub.Queue; the site
    # loads MathJax 3 (after which this shim runs: both are deferred, in this order)
    app.add_js_file("mathjax2-shim.js", loading_method="defer", priority=900)
    app.connect("source-read", _source_read)
    app.add_post_transform(RepositoryLinks)
