"""Write docs/cli.md, the reference of the ``gpulab`` command, from its argparse parser.

    .venv/bin/python docs/make_cli_md.py > docs/cli.md

Every subcommand of ``gpulab.cli.build_parser()`` in the parser's order: its one-line help, its
description, its usage (wrapped at a fixed width, so the file does not depend on the terminal),
each argument with its metavar, choices, default and help text, and its epilog. Nothing is
typed in here: change the parser's strings in ``gpulab/cli.py`` and run the command again.
``tests/test_docs.py`` fails when the committed file differs from what this writes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.cli import build_parser  # noqa: E402

__all__ = ["COMMAND", "WIDTH", "markdown"]

COMMAND = ".venv/bin/python docs/make_cli_md.py > docs/cli.md"
WIDTH = 100   # the usage lines' width


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) for each subcommand, in the order the parser lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _paragraphs(text: str | None) -> list[str]:
    """A description or epilog as markdown paragraphs: blank lines separate them; a paragraph's
    own line breaks are kept where a line starts with "- " (a list), joined otherwise."""
    out = []
    for block in (text or "").strip().split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if lines and all(line.startswith("- ") for line in lines):
            out.append("\n".join(lines))
        elif lines:
            out.append(" ".join(lines))
    return out


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{flags}`"
    metavar = action.metavar or (action.dest.upper() if not action.choices else None)
    if action.choices and not action.metavar:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    if action.nargs == "?":
        return f"`{flags} [{metavar}]`"
    if action.nargs in ("+", "*"):
        return f"`{flags} {metavar} [{metavar} ...]`"
    return f"`{flags} {metavar}`"


def _details(action: argparse.Action) -> str:
    bits = []
    if action.required and action.option_strings:
        bits.append("required")
    if action.choices and action.metavar:
        bits.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    default = action.default
    if action.option_strings and action.nargs != 0 and default not in (None, False, argparse.SUPPRESS):
        bits.append(f"default `{default}`")
    return f" ({'; '.join(bits)})" if bits else ""


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = " ".join((action.help or "").split())
        rows.append(f"- {_name(action)}{_details(action)}: {help_text}".rstrip(": ") if help_text
                    else f"- {_name(action)}{_details(action)}")
    return rows


def _section(title: str, summary: str, parser: argparse.ArgumentParser, level: str) -> list[str]:
    lines = [f"{level} `{title}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    for para in _paragraphs(parser.description):
        lines += [para, ""]
    lines += ["```text", _usage(parser), "```", ""]
    args = _arguments(parser)
    if args:
        lines += args + [""]
    for para in _paragraphs(parser.epilog):
        lines += [para, ""]
    return lines


def markdown() -> str:
    """docs/cli.md's text, from ``gpulab.cli.build_parser()``."""
    parser = build_parser()
    subs = _subcommands(parser)
    lines = ["# The `gpulab` command", "",
             f"<!-- Generated from gpulab.cli.build_parser() by `{COMMAND}`; do not edit by hand. -->", "",
             "Every subcommand, its usage and each option's help text, as each subcommand's `--help` prints "
             "them. The Python API behind them: [api.md](api.md).", "",
             " · ".join(f"[`{name}`](#gpulab-{name})" for name, _, _ in subs), ""]
    lines += _section("gpulab", "", parser, "##")
    for name, summary, sub in subs:
        lines += _section(f"gpulab {name}", summary, sub, "##")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
