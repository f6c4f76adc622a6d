"""The CLI's own process loads transformers without torchvision and torchao (``models.lean_imports``,
issue 34: about 0.3 of the import floor) and peft without bitsandbytes and torchao (issue 46 item 7), and
answers the same as a process that loads them: a QLoRA fit, whose LoRA wraps gpulab's quantized linear
layers through peft's dispatchers (bitsandbytes' and torchao's among them)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

ARGV = ["fit", "hf:tiny-llama", "--gpu", "2GiB", "--seq-len", "32", "--lora", "16", "--quantize", "nf4", "--json",
        "--quiet"]
_WATCHED = ("bitsandbytes", "torchao", "torchvision")

# a fresh process: the CLI's main as the console script calls it (argv from sys.argv), with
# skip_unused switched off when asked, then which of the packages were imported. The answer compared is
# the process's second (its fake runs made again): a process's first LoRA build makes a few storages once,
# as many as the modules peft imports inside that build make (measured: 2 KiB more than the second build
# with bitsandbytes' and torchao's dispatchers, 1 KiB without), which layer_repeat's learning already
# meets by running the first small run again
_PROBE = """
import contextlib, io, json, sys
import gpulab.models.lean_imports as lean
if sys.argv[1] == "off":
    lean.skip_unused = lambda: False
from gpulab.cli import main
from gpulab.predict import run_cache
sys.argv = ["gpulab", *json.loads(sys.argv[2])]
for _ in range(2):   # the second answer: the first run's model build can make a few storages once
    run_cache.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main()
print(json.dumps({"code": code, "answer": json.loads(out.getvalue()),
                  "loaded": sorted(m for m in %r if sys.modules.get(m) is not None)}))
"""


def _probe(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _PROBE % (_WATCHED,), mode, json.dumps(ARGV)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_cli_process_skips_torchvision_torchao_and_bitsandbytes_and_answers_the_same():
    lean, full = _probe("on"), _probe("off")
    assert lean["code"] == full["code"] == 0
    assert lean["loaded"] == [], lean["loaded"]
    assert full["loaded"] == list(_WATCHED), full["loaded"]   # installed here: else this proves nothing
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
