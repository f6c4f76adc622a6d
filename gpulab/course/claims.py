"""Claims from the reference articles, put to the test.

A lesson's "what the articles claim, tested" section is a list of ``ClaimCheck``: what the
article says (paraphrased, with the article it comes from), the evidence we measured or
computed, each piece carrying its honest label, and a verdict (*holds*, *breaks*, or a
qualified one such as *holds in MB, breaks in MiB*) with the reason. The verdict is computed
from the evidence by the function that builds the check, never typed in a notebook.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from gpulab.tables import STYLE

__all__ = [
    "BREAKS", "ClaimCheck", "ClaimReport", "Evidence", "HOLDS", "REFERENCES_FILE", "REFERENCES_URL",
    "source_html", "source_text"
]

HOLDS = "holds"
BREAKS = "breaks"


@dataclass(frozen=True)
class Evidence:
    """One number behind a verdict, and where it came from (an engine label or "formula")."""

    what: str
    value: str
    label: str


@dataclass
class ClaimCheck:
    claim: str                 # the article's claim, paraphrased
    source: str                # which reference article says it
    verdict: str               # "holds", "breaks", or "holds in X, breaks in Y"
    why: str                   # one or two sentences: why it holds or where it breaks
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        """True only for an unqualified "holds"."""
        return self.verdict == HOLDS

    def __repr__(self) -> str:
        return f"ClaimCheck({self.claim!r}: {self.verdict})"


# Where docs/references.md lies, seen from a lesson in lessons/ (its anchors are ref-000 ... ref-003).
REFERENCES_URL = "../docs/references.md"
REFERENCES_FILE = "docs/references.md"
_ARTICLE = re.compile(r"\b(?:[Aa]rticles?|[Rr]efs?)\s+(?=\d{3}\b)")
_NUMBER = re.compile(r"\b(00\d)\b")


def source_html(source: str) -> str:
    """A claim's source as HTML, with each reference ("ref 003", "refs 000 and 003"; the older
    "article 003" is read too) turned into a link to its entry in docs/references.md ("ref 003")."""
    text = html.escape(_ARTICLE.sub("", source))
    return _NUMBER.sub(lambda m: f"<a href='{REFERENCES_URL}#ref-{m[1]}' target='_blank'>ref {m[1]}</a>", text)


def source_text(source: str) -> str:
    """A claim's source as plain text: "ref 003" gains where the reference is listed
    ("ref 003, docs/references.md"), so a student reading a repr can look it up."""
    return f"{source}, {REFERENCES_FILE}" if _NUMBER.search(source) else source


@dataclass
class ClaimReport:
    """A list of checks with an HTML view (one card per claim)."""

    title: str
    checks: list[ClaimCheck]

    def __iter__(self):
        return iter(self.checks)

    def __len__(self) -> int:
        return len(self.checks)

    def __getitem__(self, i: int) -> ClaimCheck:
        return self.checks[i]

    def __repr__(self) -> str:
        return "\n".join([self.title] + [f"- {c.claim} [{source_text(c.source)}]: {c.verdict}. {c.why}"
                                          for c in self.checks])

    def _repr_html_(self) -> str:
        cards = []
        for c in self.checks:
            color = "#2a7" if c.verdict == HOLDS else ("#c33" if c.verdict == BREAKS else "#d80")
            rows = "".join(
                f"<tr><td>{html.escape(e.what)}</td><td>{html.escape(e.value)}</td>"
                f"<td class='gpulab-label'>{html.escape(e.label)}</td></tr>" for e in c.evidence)
            table = (f"<table class='gpulab-table'><tr><th>evidence</th><th>value</th><th>source</th></tr>"
                     f"{rows}</table>") if rows else ""
            cards.append(
                f"<div class='gpulab-claim' style='border-left:4px solid {color};padding:2px 8px;margin:8px 0'>"
                f"<div><b>Claim:</b> {html.escape(c.claim)} <span class='gpulab-label'>"
                f"({source_html(c.source)})</span></div>"
                f"<div><b style='color:{color}'>Verdict: {html.escape(c.verdict)}.</b> {html.escape(c.why)}</div>"
                f"{table}</div>")
        return f"{STYLE}<h4 style='margin:4px 0'>{html.escape(self.title)}</h4>" + "".join(cards)
