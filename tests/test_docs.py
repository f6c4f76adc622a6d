"""The front door holds: README.md and the reference pages in docs/ say what is true of the tree.

* docs/cli.md is what ``docs/make_cli_md.py`` writes from ``gpulab.cli.build_parser()`` now;
* every relative link and image in README.md and the pages below points to a file that exists,
  and to a heading of that file where it names one (GitHub's anchors);
* every ``make TARGET`` they show is a target of the Makefile;
* every ``gpulab ...`` command in their code blocks parses with the real parser (parsed, not run),
  and every ``--flag`` named inline beside ``gpulab SUBCOMMAND`` is an option of that subcommand;
* README.md stays short (about 150 lines: the rest lives in docs/).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import unicodedata

import pytest

from conftest import ROOT

from gpulab.cli import build_parser

README = ROOT / "README.md"
PAGES = [README] + [ROOT / "docs" / f"{name}.md" for name in ("cli", "api", "engines", "validation", "cards", "setup", "teaching", "facilitation")]
README_MAX_LINES = 170
GENERATOR = ROOT / "docs" / "make_cli_md.py"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _generator():
    spec = importlib.util.spec_from_file_location("make_cli_md", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a link inside one is code, not a link)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(text)):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(page) -> list[str]:
    text = page.read_text()
    problems = []
    for target in _LINK.findall(_prose(text)):
        if re.match(r"[a-z]+:", target):     # https:, mailto: ...: not this tree's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{page.name}: {target} (no heading #{anchor} in {file.name})")
    return problems


def _commands(text: str, program: str) -> tuple[list[str], list[str]]:
    """Command lines starting with ``program``: (in code blocks, in inline code spans)."""
    blocks, inline = [], []
    for _, body in _FENCE.findall(text):
        for line in body.splitlines():
            line = re.sub(r"^\$\s+", "", line.strip())
            if line.startswith(program + " ") or line == program:
                blocks.append(line)
    for span in _INLINE.findall(_prose(text)):
        if span.startswith(program + " "):
            inline.append(span)
    return blocks, inline


def _argv(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M))
    for phony in re.findall(r"^\.PHONY\s*:(.*)$", text, re.M):
        targets |= set(phony.split())
    return targets


def _subcommands() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


# --- docs/cli.md is current ------------------------------------------------------------------------

def test_cli_md_is_generated_from_the_parser_as_it_is_now():
    gen = _generator()
    committed = (ROOT / "docs" / "cli.md").read_text() if (ROOT / "docs" / "cli.md").exists() else ""
    assert committed == gen.markdown(), f"docs/cli.md is not what the parser says now: run `{gen.COMMAND}`"


def test_cli_md_names_every_subcommand_and_option():
    text = (ROOT / "docs" / "cli.md").read_text()
    for name, sub in _subcommands().items():
        assert f"## `gpulab {name}`" in text, name
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in text, f"gpulab {name} {flag} is not in docs/cli.md"


# --- links, make targets, commands -----------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_image_exists(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert not broken_links(page)


def test_the_link_check_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Twice\n\n## Twice\n")
    page.write_text("[ok](there.md#a-heading-with-code) [ok](there.md#twice-1) ![no](gone.png) "
                    "[no](there.md#nowhere)\n\n```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == ["page.md: gone.png (no such file)",
                                  "page.md: there.md#nowhere (no heading #nowhere in there.md)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_shown_exists(page):
    targets = makefile_targets()
    blocks, inline = _commands(page.read_text(), "make")
    missing = []
    for line in blocks + inline:
        words = [w for w in _argv(line)[1:] if "=" not in w]
        if words and words[0] not in targets:
            missing.append(line)
    assert not missing, f"{page.name} shows make targets the Makefile does not have: {missing}"


def test_the_readme_names_both_commands_and_the_make_targets_exist():
    text = README.read_text()
    assert "make lab" in text and "make test" in text
    assert {"lab", "test", "quick", "test-colab"} <= makefile_targets()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_gpulab_command_shown_parses(page):
    blocks, inline = _commands(page.read_text(), "gpulab")
    parser, subs = build_parser(), _subcommands()
    failures = []
    for line in blocks:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(_argv(line)[1:])
        except SystemExit:
            failures.append(f"{line}: {err.getvalue().strip()}")
    for span in inline:                       # `gpulab fit MODEL --gpu CARD`: placeholders, so flags only
        words = _argv(span)[1:]
        if not words or words[0] not in subs:
            failures.append(f"{span}: no such subcommand")
            continue
        known = {f for a in subs[words[0]]._actions for f in a.option_strings}
        failures += [f"{span}: {w} is not an option of gpulab {words[0]}" for w in words
                     if w.startswith("--") and w not in known]
    assert not failures, f"{page.name}:\n" + "\n".join(failures)


def test_the_readme_shows_fit_with_its_output_and_commands_that_parse():
    blocks, _ = _commands(README.read_text(), "gpulab")
    assert any(line.startswith("gpulab fit ") for line in blocks)
    assert "largest batch that fits:" in README.read_text(), "the README's fit example lost its output"


def test_the_readme_stays_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md is {lines} lines (at most {README_MAX_LINES}): "
                                       f"move the detail to docs/")
