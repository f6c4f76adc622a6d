"""Bad input against gpulab: the CLI, the Python API, the snapshot and OOM-message readers, the
distributed runner. Prints one line per case and a count by outcome; rerunnable.

    PYTHONPATH=. python benchmarks/bad_inputs.py [--only cli|api|snapshot|oom|distributed] [-v]

Outcomes:
  clean     refused with a one-line message (the CLI: exit 2 and one stderr line, no traceback;
            the API: ValueError / TypeError / KeyError / FileNotFoundError with a message)
  answer    taken and answered (a value the input admits, e.g. a size written another way)
  BAD       a traceback, an exception of another type (AttributeError, IndexError, ...), a message
            of several lines, the CLI's "internal error" (a bug's line, not a refusal), or a case that
            ran past its time limit; a case marked ``refuse`` (an input no answer can be right for, or an
            option that would be ignored) that was answered; a ``--json`` refusal whose stdout is not one
            JSON object with an "error"; a case marked ``fast`` that took more than 2 s (it needs no model)

Each case runs in this process under a time limit (SIGALRM), the CLI through `gpulab.cli.main`
with its stdout and stderr captured. Exit status: the number of BAD cases (0 when none).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import pickle
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

CLEAN_TYPES = (ValueError, TypeError, KeyError, FileNotFoundError, IsADirectoryError, PermissionError)


@dataclass
class Case:
    group: str
    name: str
    fn: Callable[[], object]
    limit_s: int = 60
    refuse: bool = False      # an answer is wrong: the input must be refused
    said: str = ""            # words the refusal must hold (the field or option named)
    ok: tuple = ()            # further exception types that count as a clear refusal here
    fast: bool = False        # needs no model: refused before torch would load (within 2 s in this process)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _one_line(msg: str) -> bool:
    return bool(msg.strip()) and "\n" not in msg.strip() and "Traceback" not in msg


def run_case(case: Case) -> tuple[str, str]:
    outcome, detail = _run_case(case)
    if outcome == "answer" and case.refuse:
        return "BAD", f"answered, where it must be refused: {detail}"
    if outcome == "clean" and case.said and case.said not in detail:
        return "BAD", f"refused without naming {case.said!r}: {detail}"
    return outcome, detail


def _run_case(case: Case) -> tuple[str, str]:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(case.limit_s)
    t0 = time.perf_counter()
    try:
        out = case.fn()
    except _Timeout:
        return "BAD", f"still running after {case.limit_s} s"
    except CLEAN_TYPES + case.ok as exc:
        msg = str(exc)
        return ("clean" if _one_line(" ".join(msg.split())) and msg else "BAD"), f"{type(exc).__name__}: {msg[:300]}"
    except BaseException as exc:  # noqa: BLE001 - what we are counting
        return "BAD", f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - t0
    if isinstance(out, tuple) and len(out) == 4 and out[0] == "cli":
        _, code, err, stdout = out
        if code == 0:
            return "answer", "exit 0: " + " | ".join(stdout.splitlines()[:3])[:200]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        ok = code in (2, 130) and len(lines) == 1 and "Traceback" not in err and "internal error" not in err
        detail = f"exit {code}: {' | '.join(lines)[:300]}"
        if ok and "--json" in out_argv(case):
            try:
                ok = "error" in json.loads(stdout)
            except ValueError:
                ok = False
            detail += "" if ok else f" (stdout is not one JSON object with an error: {stdout[:60]!r})"
        if ok and case.fast and seconds > 2:
            return "BAD", f"took {seconds:.1f} s to refuse an input that needs no model: {detail}"
        return ("clean" if ok else "BAD"), detail
    return "answer", repr(out)[:120]


def out_argv(case: Case) -> tuple:
    return getattr(case.fn, "argv", ())


# --------------------------------------------------------------------------- the CLI
class _Cli:
    """A CLI case's call, with its argv kept (``--json`` cases check stdout)."""

    def __init__(self, *argv: str):
        self.argv = argv

    def __call__(self):
        return _cli(*self.argv)


def _cli(*argv: str):
    from gpulab import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            if not isinstance(exc.code, int) and exc.code is not None:
                err.write(str(exc.code) + "\n")
        except BaseException:  # a traceback that reaches the user
            import traceback
            traceback.print_exc(file=err)
            code = 1
    return ("cli", code, err.getvalue(), out.getvalue())


def cli_cases(tmp: pathlib.Path) -> list[Case]:
    cases: list[Case] = []
    bad_models = ["nosuchmodel", "hf:nosuch", "hf:", "torchvision:", "torchvision:nosuch", "", " ", "vgg16 ",
                  "../etc/passwd", "hf:gpt2/../../x", "x" * 5000, "hf:path/that/does/not/exist.json"]
    for m in bad_models:
        cases.append(Case("cli", f"breakdown {m[:20]!r}", lambda m=m: _cli("breakdown", m)))
        cases.append(Case("cli", f"step {m[:20]!r}", lambda m=m: _cli("step", m, "--engine", "fake")))
        cases.append(Case("cli", f"fit {m[:20]!r}", lambda m=m: _cli("fit", m, "--gpu", "24GiB")))
    bad_ints = ["0", "-1", "1.5", "abc", "1e3", str(10 ** 30), "nan", "", "0x10"]
    for opt in ("--batch", "--image-size", "--seq-len", "--steps"):
        for v in bad_ints:
            cases.append(Case("cli", f"step mlp {opt} {v[:12]}",
                              lambda opt=opt, v=v: _cli("step", "mlp", "--engine", "fake", opt, v)))
    for v in ("0", "-8GiB", "abc", "24", "24 GiB", "1e400GiB", "nanGiB", "H1000", "", "80XB", str(10 ** 40)):
        cases.append(Case("cli", f"fit mlp --gpu {v[:12]!r}", lambda v=v: _cli("fit", "mlp", "--gpu", v)))
    for v in ("-1GiB", "abc", "1e400GiB", "100TiB"):
        cases.append(Case("cli", f"fit mlp --context {v}", lambda v=v: _cli("fit", "mlp", "--gpu", "24GiB",
                                                                              "--context", v)))
    for opt, v in (("--dtype", "float128"), ("--dtype", "int8"), ("--dtype", ""), ("--optimizer", "adamw9"),
                   ("--amp", "fp8"), ("--engine", "tpu"), ("--engine", ""), ("--fake-target", "rocm")):
        cases.append(Case("cli", f"step mlp {opt} {v!r}", lambda opt=opt, v=v: _cli("step", "mlp", opt, v)))
    for extra in (["--context", "100000"], ["--context", "0"], ["--context", "64", "--batch", "0"],
                  ["--context", "64", "--weights", "int3"], ["--context", "64", "--kv-dtype", "int2"],
                  ["--context", "64", "--utilization", "1.5"], ["--context", "64", "--utilization", "nan"],
                  ["--context", "64", "--block-size", "-16"], ["--context", "64", "--cuda-context", "abc"]):
        cases.append(Case("cli", f"serve tiny-llama {' '.join(extra)[:30]}",
                          lambda extra=extra: _cli("serve", "hf:tiny-llama", "--gpu", "24GiB", *extra)))
    for m in ("hf:bert-base-uncased", "hf:nosuch", "mlp", ""):
        cases.append(Case("cli", f"serve {m!r}", lambda m=m: _cli("serve", m, "--gpu", "24GiB", "--context", "64")))
    for extra in (["--lora", "0"], ["--lora", "-2"], ["--quantize", "nf4"], ["--quantize", "fp4", "--lora", "4"],
                  ["--lora", "4", "--lora-targets", "nope"], ["--lora", "4", "--lora-dropout", "1.5"],
                  ["--lora-dropout", "0.1"], ["--optimizer-impl", "fast"], ["--what-fits", "0"],
                  ["--lora", "100000"], ["--gpus", "0"], ["--gpus", "4"], ["--strategy", "fsdp2"],
                  ["--offload-optimizer"], ["--gpus", "2", "--strategy", "zero4"],
                  ["--gpus", "2", "--strategy", "ddp", "--offload-optimizer"], ["--gpus", "2", "--strategy", "zero3"],
                  ["--gpus", "2", "--strategy", "zero2", "--dtype", "bf16", "--optimizer", "sgd"],
                  ["--gpus", "2", "--strategy", "zero2", "--dtype", "bf16", "--optimizer", "adamw", "--lora", "4"],
                  ["--checkpointing", "some"], ["--checkpointing", "every-0"], ["--checkpointing", "every-x"]):
        cases.append(Case("cli", f"fit tiny-llama {' '.join(extra)[:30]}",
                          lambda extra=extra: _cli("fit", "hf:tiny-llama", "--gpu", "24GiB", "--seq-len", "32",
                                                   *extra)))
    cases.append(Case("cli", "fit mlp --checkpointing", lambda: _cli("fit", "mlp", "--gpu", "24GiB", "--checkpointing")))
    cases.append(Case("cli", "fit mlp --checkpointing selective",
                      lambda: _cli("fit", "mlp", "--gpu", "24GiB", "--checkpointing", "selective")))
    cases.append(Case("cli", "step (no model)", lambda: _cli("step")))
    cases.append(Case("cli", "no command", lambda: _cli()))
    cases.append(Case("cli", "unknown command", lambda: _cli("train", "mlp")))
    cases.append(Case("cli", "fit without --gpu", lambda: _cli("fit", "mlp")))
    cases.append(Case("cli", "unknown flag", lambda: _cli("step", "mlp", "--nosuch")))
    afile = tmp / "a_file"
    afile.write_text("x")
    cases.append(Case("cli", "record --out is a file", lambda: _cli("record", "--out", str(afile))))
    cases.append(Case("cli", "record (no GPU)", lambda: _cli("record", "--out", str(tmp / "rec"))))
    # config.json files transformers refuses: a field of the wrong type, fields that do not fit together
    llama = ('{"model_type": "llama", "vocab_size": %s, "hidden_size": %s, "intermediate_size": 128, '
             '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}')
    for what, values in (("vocab_size a string", ('"500"', 64)), ("hidden_size 66, 4 heads", (500, 66))):
        folder = tmp / what.replace(" ", "_").replace(",", "")
        folder.mkdir()
        (folder / "config.json").write_text(llama % values)
        cases.append(Case("cli", f"step config.json, {what}",
                          lambda f=folder: _cli("step", f"hf:{f / 'config.json'}", "--engine", "fake")))
        cases.append(Case("cli", f"fit config folder, {what}",
                          lambda f=folder: _cli("fit", f"hf:{f}", "--gpu", "24GiB")))
    cases += issue44_cli_cases(tmp)
    return cases


def issue44_cli_cases(tmp: pathlib.Path) -> list[Case]:
    """Issue 44 item 6's inputs and their siblings: each must be refused, naming what is wrong."""
    cases: list[Case] = []

    def refuse(name: str, *argv: str, said: str = "", fast: bool = False) -> None:
        cases.append(Case("cli", name, _Cli(*argv), refuse=True, said=said, fast=fast))

    llama = {"model_type": "llama", "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    deepseek = {"model_type": "deepseek_v2", "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
                "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
                "num_experts_per_tok": 2, "kv_lora_rank": 32}
    configs = [("4 heads, 3 KV heads", llama, dict(num_key_value_heads=3), "num_key_value_heads"),
               ("8 KV heads of 4", llama, dict(num_key_value_heads=8), "num_key_value_heads"),
               ("num_attention_heads 0", llama, dict(num_attention_heads=0), "num_attention_heads"),
               ("intermediate_size -5", llama, dict(intermediate_size=-5), "intermediate_size"),
               ("num_hidden_layers -3", llama, dict(num_hidden_layers=-3), "num_hidden_layers"),
               ("num_hidden_layers 0", llama, dict(num_hidden_layers=0), "num_hidden_layers"),
               ("vocab_size 0", llama, dict(vocab_size=0), "vocab_size"),
               ("head_dim 0", llama, dict(head_dim=0), "head_dim"),
               ("sliding_window 0", {**llama, "model_type": "mistral"}, dict(sliding_window=0), "sliding_window"),
               ("sliding_window -4", {**llama, "model_type": "mistral"}, dict(sliding_window=-4), "sliding_window"),
               ("num_experts_per_tok 0", mixtral, dict(num_experts_per_tok=0), "num_experts_per_tok"),
               ("num_experts_per_tok 9 of 4", mixtral, dict(num_experts_per_tok=9), "num_experts_per_tok"),
               ("num_local_experts 0", mixtral, dict(num_local_experts=0), "num_local_experts"),
               ("num_local_experts -2", mixtral, dict(num_local_experts=-2), "num_local_experts"),
               ("kv_lora_rank 0", deepseek, dict(kv_lora_rank=0), "kv_lora_rank"),
               ("q_lora_rank 0", deepseek, dict(q_lora_rank=0), "q_lora_rank")]
    for what, base, change, field in configs:
        folder = tmp / ("i44_" + "".join(c if c.isalnum() else "_" for c in what))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        refuse(f"fit config, {what}", "fit", f"hf:{folder}", "--gpu", "24GiB", "--seq-len", "32", "--quiet",
               said=field)
        refuse(f"serve config, {what}", "serve", f"hf:{folder}", "--gpu", "24GiB", "--context", "32", "--quiet",
               said=field)
    (tmp / "i44_empty").mkdir()
    (tmp / "i44_loop").symlink_to(tmp / "i44_loop")
    refuse("fit a folder with no config.json", "fit", f"hf:{tmp / 'i44_empty'}", "--gpu", "24GiB", said="no config.json")
    refuse("fit a symlink loop", "fit", f"hf:{tmp / 'i44_loop'}", "--gpu", "24GiB", said="symbolic link")
    for gpu, recipe in (("T4", "tensorwise"), ("A100-40GB", "rowwise"), ("V100-32GB", "tensorwise"),
                        ("RTX 3090", "rowwise")):
        refuse(f"fit --gpu {gpu} --fp8 {recipe}", "fit", "hf:tiny-llama", "--gpu", gpu, "--fp8", recipe,
               "--seq-len", "32", "--quiet", said="compute capability", fast=True)
    refuse("step --gpu T4 --fp8 tensorwise", "step", "hf:tiny-llama", "--engine", "fake", "--gpu", "T4", "--fp8",
           "tensorwise", said="compute capability", fast=True)
    refuse("fit --gpu 1GiB (below the context)", "fit", "mlp", "--gpu", "1GiB", "--quiet", said="--context", fast=True)
    refuse("fit --gpu 1GiB --json", "fit", "mlp", "--gpu", "1GiB", "--quiet", "--json", said="--context", fast=True)
    for v in ("-1GB", "-24GiB", "-.5GiB"):
        refuse(f"fit --gpu {v}", "fit", "mlp", "--gpu", v, said="at least 1 byte", fast=True)
    refuse("fit --context -1GiB", "fit", "mlp", "--gpu", "24GiB", "--context", "-1GiB", said="--context", fast=True)
    refuse("serve --cuda-context -1GiB", "serve", "hf:tiny-llama", "--gpu", "24GiB", "--context", "32",
           "--cuda-context", "-1GiB", said="--cuda-context", fast=True)
    refuse("serve --longest-context --context 4096", "serve", "hf:tiny-llama", "--gpu", "24GiB", "--longest-context",
           "--context", "4096", said="--context 4096", fast=True)
    refuse("fit tiny-llama --image-size 64", "fit", "hf:tiny-llama", "--gpu", "24GiB", "--image-size", "64",
           "--quiet", said="--image-size")
    refuse("step tiny-llama --image-size 64", "step", "hf:tiny-llama", "--engine", "fake", "--image-size", "64",
           said="--image-size")
    refuse("fit resnet18 --seq-len 64", "fit", "resnet18", "--gpu", "24GiB", "--seq-len", "64", "--quiet",
           said="--seq-len")
    refuse("breakdown vgg16 --seq-len 64", "breakdown", "vgg16", "--seq-len", "64", said="--seq-len")
    for extra, said in ((["--pp", "2", "--microbatches", "2000"], "microbatches"),
                        (["--sequence-parallel"], "--tp"), (["--lora", "4", "--lora-dropout", "nan"], "lora_dropout"),
                        (["--lora-dropout", "0.1"], "lora"), (["--tp", "3", "--gpus", "4"], ""),
                        (["--schedule", "interleaved", "--virtual-stages", "0"], "")):
        refuse(f"fit tiny-llama {' '.join(extra)}", "fit", "hf:tiny-llama", "--gpu", "24GiB", *extra, said=said,
               fast=True)
    for argv in (["fit", "mlp", "--gpu", "H1000", "--json"], ["fit", "mlp", "--gpu", "24GiB", "--bogus", "--json"],
                 ["fit", "nosuchmodel", "--gpu", "24GiB", "--json"], ["step", "mlp", "--batch", "0", "--json"],
                 ["serve", "mlp", "--gpu", "24GiB", "--context", "64", "--json"]):
        refuse(f"--json: {' '.join(argv[:4])[:40]}", *argv)
    return cases


# --------------------------------------------------------------------------- the Python API
def api_cases(tmp: pathlib.Path) -> list[Case]:
    import torch
    from torch import nn

    import gpulab

    lin = nn.Linear(4, 2)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("my model's own bug")

    cases = [
        Case("api", "step(None)", lambda: gpulab.step(None)),
        Case("api", "step(42)", lambda: gpulab.step(42)),
        Case("api", "step(a builder returning 5)", lambda: gpulab.step(lambda: 5, batch=2)),
        Case("api", "fit(a builder returning None)", lambda: gpulab.fit(lambda: None, "24GiB")),
        Case("api", "step('nosuch')", lambda: gpulab.step("nosuch")),
        Case("api", "step(Linear, wrong input shape)", lambda: gpulab.step(lin, torch.randn(1, 3), engine="cpu")),
        Case("api", "step(Linear) without input", lambda: gpulab.step(lin)),
        Case("api", "step(model raising)", lambda: gpulab.step(Boom(), torch.randn(1, 4), engine="cpu")),
        Case("api", "fit(model raising)", lambda: gpulab.fit(Boom(), "4GiB", inputs=torch.randn(1, 4))),
        Case("api", "step(a class, not an instance)", lambda: gpulab.step(nn.Linear, torch.randn(1, 4))),
        Case("api", "fit('mlp', 'abc')", lambda: gpulab.fit("mlp", "abc")),
        Case("api", "fit('mlp', -1)", lambda: gpulab.fit("mlp", -1)),
        Case("api", "fit('mlp', None)", lambda: gpulab.fit("mlp", None)),
        Case("api", "fit('mlp', float('nan'))", lambda: gpulab.fit("mlp", float("nan"))),
        Case("api", "breakdown('hf:nosuch')", lambda: gpulab.breakdown("hf:nosuch")),
        Case("api", "breakdown('vgg16', image_size=8)", lambda: gpulab.breakdown("vgg16", 1, 8)),
        Case("api", "breakdown('vgg16', batch=0)", lambda: gpulab.breakdown("vgg16", 0)),
        Case("api", "format_bytes('x')", lambda: gpulab.format_bytes("x")),
        Case("api", "run(non-callable)", lambda: gpulab.run(42, engine="cpu")),
        Case("api", "run(engine='tpu')", lambda: gpulab.run(lambda: torch.ones(2), engine="tpu")),
        Case("api", "step(tiny-llama, checkpointing='half')",
             lambda: gpulab.step("hf:tiny-llama", batch=1, engine="fake", checkpointing="half")),
        Case("api", "step(tiny-llama, checkpointing=2)",
             lambda: gpulab.step("hf:tiny-llama", batch=1, engine="fake", checkpointing=2)),
        Case("api", "serve('hf:llama-3-8b', 'H100', context_len=32768)",
             lambda: gpulab.serve("hf:llama-3-8b", "H100", context_len=32768)),
    ]
    from gpulab.measure.tracking import MemoryTracker
    from gpulab.units import GiB
    cases += [
        Case("api", "fit('mlp', -5)", lambda: gpulab.fit("mlp", -5), refuse=True, said="not a card's size"),
        Case("api", "fit('mlp', 0)", lambda: gpulab.fit("mlp", 0), refuse=True, said="not a card's size"),
        Case("api", "fit('mlp', '1GiB') (below the context)", lambda: gpulab.fit("mlp", "1GiB"), refuse=True,
             said="context_bytes="),
        Case("api", "fit('mlp', 2GiB, context_bytes=-1)", lambda: gpulab.fit("mlp", 2 * GiB, context_bytes=-1),
             refuse=True, said="context_bytes"),
        Case("api", "serve(tiny-llama, context_bytes=-1)",
             lambda: gpulab.serve("hf:tiny-llama", "4GiB", context_len=32, context_bytes=-1), refuse=True,
             said="context_bytes"),
        Case("api", "fit(tiny-llama, 'T4', fp8='tensorwise')",
             lambda: gpulab.fit("hf:tiny-llama", "T4", fp8="tensorwise", seq_len=32), refuse=True, said="sm75"),
        Case("api", "step(tiny-llama, gpu='A100-80GB', fp8='rowwise')",
             lambda: gpulab.step("hf:tiny-llama", engine="fake", gpu="A100-80GB", fp8="rowwise", batch=1),
             refuse=True, said="sm80"),
        Case("api", "fit(tiny-llama, image_size=64)",
             lambda: gpulab.fit("hf:tiny-llama", "24GiB", image_size=64), refuse=True, said="image_size"),
        Case("api", "step('resnet18', seq_len=64)", lambda: gpulab.step("resnet18", engine="fake", seq_len=64),
             refuse=True, said="seq_len"),
        Case("api", "MemoryTracker().__exit__ without __enter__",
             lambda: MemoryTracker().__exit__(None, None, None), refuse=True, said="__enter__", ok=(RuntimeError,)),
        Case("api", "fit('mlp', 99999999TiB) says 'at least'",
             lambda: _said_a_bound(gpulab.fit("mlp", "99999999TiB"))),
    ]
    for panel, kw, said in (("sharding_panel", dict(world_size=99), "from 1 to 4"),
                            ("sharding_panel", dict(strategy="zero9"), "one of"),
                            ("sharding_panel", dict(width=5000), "from 32 to 512"),
                            ("largest_batch_panel", dict(context_mib=9999), "from 0 to 2048"),
                            ("step_panel", dict(batch=3), "one of"),
                            ("step_panel", dict(model="nosuch"), "one of"),
                            ("rounding_panel", dict(max_elements=1), "from 16 to 2048"),
                            ("engine_panel", dict(size_mib=3), "one of")):
        cases.append(Case("api", f"{panel}({', '.join(f'{k}={v!r}' for k, v in kw.items())})",
                          lambda panel=panel, kw=kw: _panel(panel, **kw), refuse=True, said=said))
    for kw, v in (("batch", 0), ("batch", -3), ("batch", 1.5), ("batch", "8"), ("batch", 10 ** 30),
                  ("optimizer", "adamw9"), ("optimizer", None), ("engine", "tpu"), ("dtype", "float128"),
                  ("amp", "fp8"), ("steps", 0), ("steps", -1), ("steps", 10 ** 9), ("seq_len", 0),
                  ("image_size", -1), ("fake_target", "rocm")):
        cases.append(Case("api", f"step('mlp', {kw}={v!r})"[:60],
                          lambda kw=kw, v=v: gpulab.step("mlp", engine="fake", **{kw: v})))
    for kw, v in (("optimizer", "nosuch"), ("dtype", "float128"), ("amp", "fp8"), ("seq_len", -1),
                  ("steps", 0), ("steps", 10 ** 9), ("context_bytes", -1)):
        cases.append(Case("api", f"fit('mlp', '24GiB', {kw}={v!r})"[:60],
                          lambda kw=kw, v=v: gpulab.fit("mlp", "24GiB", **{kw: v})))
    return cases


def _said_a_bound(result) -> str:
    """A fit answer at the search's limit must say it is a bound (it said the limit as the answer)."""
    if result.at_search_limit and "at least" not in repr(result):
        raise AssertionError(f"the search's limit reported as the answer: {result!r}")
    return repr(result)


def _panel(name: str, **kw):
    import gpulab.widgets as W
    return getattr(W, name)(**kw)


# --------------------------------------------------------------------------- snapshot reader
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def snapshot_cases(tmp: pathlib.Path) -> list[Case]:
    from gpulab.interop import snapshot_import

    def write(name: str, data: bytes) -> pathlib.Path:
        p = tmp / name
        p.write_bytes(data)
        return p

    files = {
        "empty": b"",
        "text": b"hello, not a pickle\n",
        "truncated": pickle.dumps({"segments": [], "device_traces": [[]]})[:-5],
        "a list": pickle.dumps([1, 2, 3]),
        "no segments": pickle.dumps({"device_traces": [[]]}),
        "segments not a list": pickle.dumps({"segments": 3, "device_traces": []}),
        "trace entry not a dict": pickle.dumps({"segments": [], "device_traces": [[1, 2]]}),
        "segment missing keys": pickle.dumps({"segments": [{"address": 0}], "device_traces": [[]]}),
        "negative sizes": pickle.dumps({"segments": [{"address": 0, "total_size": -5, "blocks": [],
                                                      "device": 0, "stream": 0, "segment_type": "large"}],
                                        "device_traces": [[]]}),
        "os.system reduce": pickle.dumps(_Evil()),
        "gzip bytes": b"\x1f\x8b\x08\x00" + b"\x00" * 20,
    }
    seg = {"address": 0, "total_size": 2 << 20, "device": 0, "stream": 0, "segment_type": "small", "blocks": [{"size": 512, "state": "active_allocated", "address": 0}]}
    wrong = {   # issue 44 item 6: wrong-typed segments gave a raw KeyError (and siblings)
        "block without size": {**seg, "blocks": [{"state": "active_allocated"}]},
        "blocks not a list": {**seg, "blocks": 5},
        "blocks of ints": {**seg, "blocks": [1, 2]},
        "address a string": {**seg, "address": "0x0"},
        "total_size None": {**seg, "total_size": None},
        "device a string": {**seg, "device": "cuda"},
    }
    for name, s in wrong.items():
        files[f"segment: {name}"] = pickle.dumps({"segments": [s], "device_traces": [[]]})
    for name, entry in (("alloc without size", {"action": "alloc", "addr": 0, "stream": 0}),
                        ("addr a string", {"action": "alloc", "addr": "x", "size": 512, "stream": 0}),
                        ("action a number", {"action": 5})):
        files[f"trace: {name}"] = pickle.dumps({"segments": [seg], "device_traces": [[entry]]})
    cases = []
    for name, data in files.items():
        p = write(name.replace(" ", "_").replace(":", "") + ".pickle", data)
        cases.append(Case("snapshot", f"read {name}", lambda p=p: snapshot_import.read_snapshot(str(p)).replay(),
                          refuse=name.startswith(("segment:", "trace:")) or name == "negative sizes"))
    cases.append(Case("snapshot", "read a missing file", lambda: snapshot_import.read_snapshot(str(tmp / "nope"))))
    cases.append(Case("snapshot", "read a directory", lambda: snapshot_import.read_snapshot(str(tmp))))
    cases.append(Case("snapshot", "read None", lambda: snapshot_import.read_snapshot(None)))
    return cases


# --------------------------------------------------------------------------- OOM-message reader
def oom_cases(tmp: pathlib.Path) -> list[Case]:
    from gpulab.interop import oom_message

    texts = {
        "None": None, "bytes": b"CUDA out of memory", "int": 42, "empty": "", "unrelated text": "hello world",
        "half a message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        "negative figures": ("CUDA out of memory. Tried to allocate -2.00 GiB. GPU 0 has a total capacity of "
                             "-1 GiB of which 0 bytes is free."),
        "huge figures": ("CUDA out of memory. Tried to allocate 1e400 GiB. GPU 0 has a total capacity of "
                         "1e400 GiB of which 0 bytes is free."),
        "torch 2.1 (capacty)": ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
                                "GPU 0 has a total capacty of 14.75 GiB of which 3.06 MiB is free. Process 12345 "
                                "has 14.74 GiB memory in use. Of the allocated memory 14.50 GiB is allocated by "
                                "PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."),
    }
    cases = []
    for name, t in texts.items():
        cases.append(Case("oom", f"reproduce({name})", lambda t=t: oom_message.reproduce(t)))
    return cases


# --------------------------------------------------------------------------- distributed runner
def distributed_cases(tmp: pathlib.Path) -> list[Case]:
    from gpulab.distributed import runner as distributed

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import dist_experiments as de  # noqa: E402 - the tests' importable experiments

    cases = [
        Case("distributed", "world_size=0", lambda: distributed.run_distributed(de.all_reduce_rank, 0)),
        Case("distributed", "world_size=-1", lambda: distributed.run_distributed(de.all_reduce_rank, -1)),
        Case("distributed", "world_size=99", lambda: distributed.run_distributed(de.all_reduce_rank, 99)),
        Case("distributed", "world_size='2'", lambda: distributed.run_distributed(de.all_reduce_rank, "2")),
        Case("distributed", "a lambda", lambda: distributed.run_distributed(lambda ctx: 1, 2)),
        Case("distributed", "not callable", lambda: distributed.run_distributed(42, 2)),
        Case("distributed", "backend='mpi9'", lambda: distributed.run_distributed(de.all_reduce_rank, 2, backend="mpi9")),
        Case("distributed", "timeout_s=0", lambda: distributed.run_distributed(de.all_reduce_rank, 2, timeout_s=0)),
        Case("distributed", "timeout_s=-5", lambda: distributed.run_distributed(de.all_reduce_rank, 2, timeout_s=-5)),
    ]
    return cases


GROUPS = {"cli": cli_cases, "api": api_cases, "snapshot": snapshot_cases, "oom": oom_cases,
          "distributed": distributed_cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(GROUPS), action="append")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case, not only the BAD ones")
    args = ap.parse_args(argv)
    counts: dict[str, dict[str, int]] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpulab-bad-") as d:
        tmp = pathlib.Path(d)
        for group in args.only or list(GROUPS):
            for case in GROUPS[group](tmp):
                outcome, detail = run_case(case)
                counts.setdefault(group, {}).setdefault(outcome, 0)
                counts[group][outcome] += 1
                if args.verbose or outcome == "BAD":
                    print(f"{outcome:6} {group:11} {case.name:45} {detail}", flush=True)
    total = {k: sum(c.get(k, 0) for c in counts.values()) for k in ("clean", "answer", "BAD")}
    print()
    for group, c in counts.items():
        print(f"{group:12} " + "  ".join(f"{k} {c.get(k, 0)}" for k in ("clean", "answer", "BAD")))
    print(f"{'all':12} " + "  ".join(f"{k} {v}" for k, v in total.items())
          + f"   ({sum(total.values())} inputs, {time.time() - t0:.0f} s)")
    return min(total["BAD"], 100)


if __name__ == "__main__":
    sys.exit(main())
