"""The CLI's own process loads transformers without torchvision and torchao (``models.lean_imports``,
issue 34: about 0.3 of the import floor), and answers the same as a process that loads them."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

ARGV = ["fit", "hf:tiny-llama", "--gpu", "2GiB", "--seq-len", "32", "--json", "--quiet"]

# a fresh process: the CLI's main as the console script calls it (argv from sys.argv), with
# skip_unused switched off when asked, then which of the two packages were imported
_PROBE = """
import contextlib, io, json, sys
import gpulab.models.lean_imports as lean
if sys.argv[1] == "off":
    lean.skip_unused = lambda: False
from gpulab.cli import main
sys.argv = ["gpulab", *json.loads(sys.argv[2])]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main()
print(json.dumps({"code": code, "answer": json.loads(out.getvalue()),
                  "loaded": sorted(m for m in ("torchvision", "torchao") if m in sys.modules)}))
"""


def _probe(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _PROBE, mode, json.dumps(ARGV)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_cli_process_skips_torchvision_and_torchao_and_answers_the_same():
    lean, full = _probe("on"), _probe("off")
    assert lean["code"] == full["code"] == 0
    assert lean["loaded"] == [], lean["loaded"]
    assert full["loaded"] == ["torchao", "torchvision"], full["loaded"]   # installed here: else this proves nothing
    for answer in (lean["answer"], full["answer"]):
        answer.pop("seconds")
    assert lean["answer"] == full["answer"]


def test_too_late_changes_nothing():
    """Once transformers' image utilities are loaded (their checks bound), skip_unused leaves them be."""
    code = ("import transformers.image_utils, transformers.utils.import_utils as iu\n"
            "from gpulab.models.lean_imports import skip_unused\n"
            "before = iu.is_torchvision_available\n"
            "print(skip_unused(), iu.is_torchvision_available is before)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.stdout.split() == ["False", "True"], p.stderr[-2000:]
