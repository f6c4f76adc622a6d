"""Issue #34, items 2 and 5: the command parses before it imports, and says what it is doing.

Parse before import: ``--help``, a bad option or a bad value is answered before torch (or
transformers) is imported: checked in a fresh process by what is in ``sys.modules`` when the
answer is given, not by a clock (the times are in ``benchmarks/cli_startup.py``). Progress: a long
answer writes what it is doing on stderr, never stdout; ``--json`` keeps stdout one JSON object,
``--quiet`` silences stderr.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT
from gpulab import cli
from gpulab.command import checks
from gpulab.predict.progress import StreamProgress

BAD = [
    (["fit", "mlp", "--gpu", "H1000"], "cannot read --gpu"),
    (["fit", "mlp", "--gpu", "T4", "--bogus"], "unrecognized arguments: --bogus"),
    (["fit", "mlp", "--gpu", "T4", "--dtype", "fp17"], "unknown dtype 'fp17'"),
    (["step", "mlp", "--dtype", "int8"], "floating-point dtype"),
    (["fit", "mlp", "--gpu", "T4", "--chunked-loss", "1"], "from 2 to 64"),
    (["fit", "mlp", "--gpu", "T4", "--chunked-loss", "-8"], "or 0 (the default)"),
    (["fit", "mlp", "--gpu", "T4", "--checkpointing", "some"], "every-K"),
    (["fit", "mlp", "--gpu", "T4", "--optimizer", "lion"], "invalid choice: 'lion'"),
    (["fit", "mlp", "--gpu", "T4", "--amp", "fp8"], "invalid choice: 'fp8'"),
    (["fit", "mlp", "--gpu", "T4", "--context", "20GiB"], "--context 20GiB is the whole of T4"),
    (["fit", "mlp", "--gpu", "T4", "--context", "lots"], "cannot read --context"),
    (["serve", "hf:gpt2", "--gpu", "T4", "--context", "64", "--utilization", "1.5"], "(0, 1]"),
    (["serve", "hf:gpt2", "--gpu", "T4", "--context", "64", "--cuda-context", "1x"], "cannot read --cuda-context"),
    (["step", "mlp", "--steps", "50"], "at most 10"),
    (["launch"], "invalid choice: 'launch'"),
    # issue 44 item 6: refusals that need no model, each before torch loads (they took 5-9 s)
    (["fit", "hf:tiny-llama", "--gpu", "T4", "--fp8", "tensorwise"], "compute capability 7.5 (sm75)"),
    (["fit", "mlp", "--gpu", "1GiB"], "no larger than the CUDA context gpulab assumes"),
    (["fit", "mlp", "--gpu", "-1GB"], "cannot read --gpu '-1GB': a size must be at least 1 byte"),
    (["serve", "hf:gpt2", "--gpu", "T4", "--longest-context", "--context", "4096"], "--context 4096 would be ignored"),
    (["fit", "hf:tiny-llama", "--gpu", "T4", "--pp", "2", "--microbatches", "2000"], "microbatches"),
    (["fit", "hf:tiny-llama", "--gpu", "T4", "--sequence-parallel"], "--tp 2 or more"),
    (["fit", "hf:tiny-llama", "--gpu", "T4", "--loss-parallel"], "loss parallelism computes the loss on logits split"),
    (["fit", "hf:tiny-llama", "--gpu", "T4", "--lora", "4", "--lora-dropout", "nan"], "lora_dropout"),
]

# run in a fresh interpreter: the console script's entry point (pyproject.toml) on each argv, then
# whether torch or transformers had been imported by the time each answer was given
_PROBE = """
import contextlib, importlib, io, json, sys
module, name = sys.argv[1].split(":")
main = getattr(importlib.import_module(module), name)
seen = []
for argv in json.loads(sys.argv[2]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    seen.append({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                 "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules)})
print(json.dumps(seen))
"""


def _entry_point() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["gpulab"]


def test_help_and_bad_arguments_are_answered_before_torch_is_imported():
    cases = [["--help"], ["fit", "--help"], ["serve", "--help"], *(argv for argv, _ in BAD)]
    p = subprocess.run([sys.executable, "-c", _PROBE, _entry_point(), json.dumps(cases)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    for argv, s in zip(cases, seen):
        assert s["loaded"] == [], (argv, s)       # nothing heavy imported by the time of the answer
    for s in seen[:3]:
        assert s["code"] == 0 and "usage: gpulab" in s["out"]
    for (argv, words), s in zip(BAD, seen[3:]):
        assert s["code"] == 2 and s["out"] == "", (argv, s)
        assert s["err"].startswith("gpulab: error: ") and s["err"].count("\n") == 1, (argv, s["err"])
        assert words in s["err"], (argv, s["err"])


def test_python_dash_m_gpulab_imports_no_torch_for_help_or_a_bad_card():
    for argv in (["--help"], ["fit", "mlp", "--gpu", "H1000"]):
        p = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpulab", *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        assert "gpulab.cli" in imported and not imported & {"torch", "transformers", "torchvision"}, argv
        assert p.returncode == (0 if argv == ["--help"] else 2)


def test_the_public_names_still_come_from_gpulab():
    import importlib

    import gpulab
    from gpulab import Card, Category, Layout, MemoryTracker, Recipe, breakdown, fit, format_bytes, run, serve, step
    given = dict(Card=Card, Category=Category, Layout=Layout, MemoryTracker=MemoryTracker, Recipe=Recipe,
                 breakdown=breakdown, fit=fit, format_bytes=format_bytes, run=run, serve=serve, step=step)
    assert set(given) == set(gpulab.__all__) <= set(dir(gpulab))
    for name, value in given.items():   # each the same object as in the module it comes from
        assert value is getattr(importlib.import_module(gpulab._SOURCES[name]), name) is getattr(gpulab, name)
    with pytest.raises(AttributeError):
        gpulab.no_such_name


def test_the_torch_free_checks_agree_with_the_library():
    from gpulab import options
    from gpulab.models import adapt, registry
    from gpulab.training import chunked_loss, loop, optimizers
    from gpulab.predict import step
    from gpulab.units import _ALIASES, MODEL_DTYPES, check_model_dtype_name, dtype_name, parse_dtype
    assert options.ALL_OPTIMIZERS == optimizers.ALL_OPTIMIZERS
    assert options.AMP_NAMES == tuple(loop.AMP_DTYPES)
    assert options.MAX_STEPS == step.MAX_STEPS
    assert adapt.check_checkpointing is options.check_checkpointing
    assert chunked_loss.check_chunks is options.check_chunks
    assert MODEL_DTYPES == tuple(dtype_name(d) for d in registry._MODEL_DTYPES)
    for name in (*_ALIASES, *MODEL_DTYPES, "torch.bfloat16", "int8", "fp8", "float8_e5m2"):
        ok = dtype_name(parse_dtype(name)) in MODEL_DTYPES
        if ok:
            assert check_model_dtype_name(name) == dtype_name(parse_dtype(name))
        else:
            with pytest.raises(ValueError, match="floating-point dtype"):
                check_model_dtype_name(name)


def test_chunked_loss_zero_means_off():
    args = cli.build_parser().parse_args(["fit", "mlp", "--gpu", "T4", "--chunked-loss", "0"])
    assert args.chunked_loss == 0 and checks.recipe_keywords(args)["chunked_loss"] == 0
    assert cli.build_parser().parse_args(["fit", "mlp", "--gpu", "T4", "--chunked-loss", "8"]).chunked_loss == 8
    fit_help = cli.build_parser()._subparsers._group_actions[0].choices["fit"].format_help()
    assert "0, the default, is off" in " ".join(fit_help.split())


# --- progress ------------------------------------------------------------------------------------

def test_progress_goes_to_stderr_and_stdout_stays_one_json_object(capsys):
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)                                  # one object, nothing else
    lines = err.splitlines()
    assert lines and all(line.startswith("gpulab: [") for line in lines), err
    assert any("fake run at batch 2" in line for line in lines)
    assert any("replaying" in line and "allocator" in line for line in lines)
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["model"] == "mlp"


def test_serve_and_what_fits_say_what_they_run(capsys):
    assert cli.main(["serve", "hf:tiny-llama", "--gpu", "24GiB", "--context", "64", "--batch", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["batch"] == 2
    assert "fake run of one sequence" in err and "all 2 sequences" in err
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--optimizer", "adamw", "--what-fits", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "what_fits" in json.loads(out)
    assert "what fits at batch 2: the asked recipe" in err and "what fits at batch 2: bf16" in err


def test_on_a_terminal_one_line_is_rewritten_and_erased():
    stream = io.StringIO()
    p = StreamProgress(stream, tty=True)
    p(0.1, "fake run at batch 2")
    p(0.5, "fake run at batch 3")
    p.close()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") == 3 and text.endswith("\r\x1b[K")
    assert "fake run at batch 3" in text and p.messages == ["fake run at batch 2", "fake run at batch 3"]
    plain = io.StringIO()
    q = StreamProgress(plain, tty=False)
    q(0.1, "one")
    q(0.2, "two")
    q.close()
    assert plain.getvalue().count("\n") == 2 and "\r" not in plain.getvalue()
