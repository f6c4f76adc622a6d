"""`gpulab fit` at scale against the time of an import (issue 34): 8B on one card, a 70B shape on 8
GPUs (FSDP2), a 405B shape on 64 GPUs (ZeRO-3), with checkpointing where the issue asks, with and
without ``--what-fits``, and a bad option; with ``--new-models`` also issue 35's configs (``NEW_MODELS``:
Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite, Gemma-2-2B/9B, Gemma-3-1B, Llama-3.1-70B/405B,
Qwen2.5-72B), each ``gpulab fit`` (bf16 AdamW, 2048 tokens, on the layout its size needs) and
``gpulab serve`` (one H100, 8192 tokens) beside ``serve`` of 8B dense, and Gemma-2-9B at 32K on 24 GiB
(issue 35's done-when); each a whole command in a fresh process, as a user runs it.

    PYTHONPATH=. python benchmarks/fit_speed.py [--quick] [--repeat-off] [--new-models] [--layouts] [--only TEXT]
                                                [--floor-each] [--repeat N] [--time-cost]

``--layouts`` adds issue 45's layouts (Llama-3.1-70B on 64 H100 as TP 8 × PP 4 with sequence parallelism;
70B with CP 8 under FSDP2; Mixtral-8x7B with EP 8 under FSDP2, all bf16 AdamW at 4096 tokens) and issue 46's
``--what-fits`` for 8B on 24 GiB at 4096 tokens (and the same ``fit`` without it: the part before the candidates) and ``--fastest`` over recipes × the layouts of 8 H100 for 8B (and ``--fastest layout``, the layouts alone), each against the fake-tensor floor (``import torch,
transformers, torch._dynamo`` plus one ``FakeTensorMode()``: what every fake-tensor tool pays before its
first op) timed right before it; ``--repeat N`` times each floor-and-command pair N times and prints the
min and the median of the ratios (a shared machine's load moves both), of the wall times and of the CPU
times (user + system: on a shared machine they move less with the load; on a quiet one they agree).

``--time-cost`` (issue 46, item 7) runs ``TIME_COST``'s commands (answers on cards with speed figures, so
each has a predicted step time) with ``--no-time`` and without, back to back, ``--repeat N`` times: the CPU
seconds of each and the share the time model adds (CPU time, min and median over the repeats), beside the
fake-tensor floor's CPU seconds; ``--only`` picks among them.

It prints each command's seconds and its ratio to the import floor (``python -c "import torch,
transformers"``) measured in the same run, and whether the answer's depth was laid out from a few
layers (``FitResult.layers``), with the load average (``/proc/loadavg``) before and after: the
machine is shared. ``--repeat-off`` runs the same commands with the layer repeat switched
off (``GPULAB_LAYER_REPEAT=0``), to print the ratio of the two. Ratios, not absolute times: the
machine's load moves both. The 70B and 405B configs are written as config.json files with the
published configs' shapes (meta-llama/Llama-3.1-70B and -405B: hidden 8192 / 16384, 80 / 126 layers,
64 / 128 heads, 8 KV heads, MLP 28672 / 53248, vocabulary 128256). A benchmark: it prints, it
asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {   # the published config.json fields that differ from Llama-3-8B's
    "llama-3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          intermediate_size=28672),
    "llama-3.1-405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                           intermediate_size=53248),
}


# issue 35's configs and the layout each is fit on: one card where its bf16 AdamW state can fit one,
# else the sharded layouts the 70B / 405B shapes above use
_ONE = ("1 H100", ["--gpu", "H100"])
_EIGHT = ("8 H100, FSDP2", ["--gpu", "H100", "--gpus", "8", "--strategy", "fsdp2"])
NEW_MODELS = {"mixtral-8x7b": _EIGHT, "qwen3-30b-a3b": _EIGHT, "deepseek-v2-lite": _EIGHT, "gemma-2-2b": _ONE,
              "gemma-2-9b": _EIGHT, "gemma-3-1b": _ONE, "llama-3.1-70b": _EIGHT,
              "llama-3.1-405b": ("64 H100, ZeRO-3, checkpointing", ["--gpu", "H100", "--gpus", "64", "--strategy",
                                                                    "zero3", "--checkpointing"]),
              "qwen2.5-72b-instruct": _EIGHT}


# issue 45's layouts and issue 46's what-fits at 4096 tokens, each answered against the fake-tensor floor
_BF16_4096 = ["--dtype", "bf16", "--optimizer", "adamw", "--seq-len", "4096", "--json"]
LAYOUTS = [
    ("70B, 64 H100, TP 8 x PP 4, SP, 4096",
     ["fit", "hf:llama-3.1-70b", "--gpu", "H100", "--gpus", "64", "--tp", "8", "--pp", "4", "--sequence-parallel",
      *_BF16_4096]),
    ("70B, 8 H100, CP 8, FSDP2, 4096",
     ["fit", "hf:llama-3.1-70b", "--gpu", "H100", "--gpus", "8", "--cp", "8", "--strategy", "fsdp2", *_BF16_4096]),
    ("Mixtral-8x7B, 8 H100, EP 8, FSDP2, 4096",
     ["fit", "hf:mixtral-8x7b", "--gpu", "H100", "--gpus", "8", "--ep", "8", "--strategy", "fsdp2", *_BF16_4096]),
    ("8B, 24 GiB, --what-fits, 4096",
     ["fit", "hf:llama-3-8b", "--gpu", "24GiB", "--what-fits", *_BF16_4096]),
    # the fit answer that --what-fits gives first (its own search: 6 of the 37 fake runs; the two 8-bit AdamW
    # candidates are derived from AdamW runs, predict.eight_bit_timeline), timed alone: a bound
    # under --what-fits' ratio however cheap its candidates become
    ("8B, 24 GiB, fit alone (the part of --what-fits before its candidates), 4096",
     ["fit", "hf:llama-3-8b", "--gpu", "24GiB", *_BF16_4096]),
    # issue 46's fastest plan across recipes x layouts (predict.fastest_plans, its pruning), and across the
    # layouts of 8 H100 for the asked recipe alone (--fastest layout: predict.fastest, its cost bound)
    ("8B, 8 H100, --fastest (recipes x layouts), 4096",
     ["fit", "hf:llama-3-8b", "--gpu", "H100", "--gpus", "8", "--fastest", *_BF16_4096]),
    ("8B, 8 H100, --fastest layout (asked recipe), 4096",
     ["fit", "hf:llama-3-8b", "--gpu", "H100", "--gpus", "8", "--fastest", "layout", *_BF16_4096]),
]
# issue 46's cost of the time model: answers with a predicted step time (cards with speed figures)
TIME_COST = [
    ("8B, 1 H100, bf16 AdamW, 2048",
     ["fit", "hf:llama-3-8b", "--gpu", "H100", "--dtype", "bf16", "--optimizer", "adamw", "--seq-len", "2048",
      "--json"]),
    *LAYOUTS[:3],
    ("8B, H100, fp32 AdamW, --what-fits, 4096",   # the asked recipe does not fit; most candidates do, each timed
     ["fit", "hf:llama-3-8b", "--gpu", "H100", "--optimizer", "adamw", "--seq-len", "4096", "--what-fits", "--json"]),
]
# the floor every fake-tensor tool pays (issues 45 and 46): torch, transformers and torch._dynamo imported, one FakeTensorMode
FAKE_FLOOR = ("import torch, transformers, torch._dynamo; from torch._subclasses.fake_tensor import FakeTensorMode; "
              "FakeTensorMode()")


def _serve(name: str, gpu: str, context: int) -> list[str]:
    return ["serve", f"hf:{name}", "--gpu", gpu, "--context", str(context), "--json"]


def _config_file(folder: str, name: str) -> str:
    from gpulab.models import hf_configs
    cfg = hf_configs.make_config("llama-3-8b").to_dict()
    cfg.update(SHAPES[name])
    path = os.path.join(folder, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _timed(cmd: list[str], env: dict[str, str], cpu: list[float] | None = None) -> tuple[float, str]:
    """(wall seconds, the answer in short) of ``cmd``; its CPU seconds (user + system, its children's
    included) appended to ``cpu`` when given: on a shared machine the CPU time moves less with the load
    than the wall time, and on a quiet one the two agree (a fit is one Python thread)."""
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - t0
    if cpu is not None:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if p.returncode not in (0, 2):
        return seconds, f"failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}"
    try:
        answer = json.loads(p.stdout)
        experts = _experts(answer)
        if "plans" in answer:   # gpulab fit --fastest --gpus N: the plans tried
            f = answer.get("fastest") or {}
            pairs = (f"{answer['pairs']} pairs, {answer['pruned_memory']} pruned by memory, {answer['pruned_time']} by "
                     f"time, " if "pairs" in answer else "")
            return seconds, (f"{pairs}{answer['tried']} plans tried, {len(answer['ranked'])} fit, "
                             f"{len(answer['skipped'])} layouts left out; fastest: {f.get('name', 'none')}"
                             + (f", {f['time']['items_per_s']:,.0f} tokens/s" if f else ""))
        if "largest_batch" not in answer:   # gpulab serve
            return seconds, (f"fits: {answer.get('fits')}, {answer.get('max_sequences')} sequences (vLLM-style)"
                             + experts)
        fits = answer.get("what_fits")
        if answer.get("time"):   # the predicted step, where the card has speed figures
            experts += f"; step {answer['time']['seconds'] * 1e3:,.3f} ms predicted"
        if fits:   # --what-fits: the recipes that fit beside the asked one's answer
            fastest = (fits.get("fastest") or {}).get("name")
            return seconds, (f"batch {answer.get('largest_batch')}, {answer.get('runs')} fake runs; what fits at batch "
                             f"{fits['batch']}: {', '.join(fits['fitting']) or 'nothing tried'}"
                             + (f"; fastest: {fastest}" if fastest else "") + experts)
        return seconds, (f"batch {answer.get('largest_batch')}, {answer.get('runs')} fake runs; "
                         f"{answer.get('layers') or 'depth: full'}" + experts)
    except (json.JSONDecodeError, TypeError):
        return seconds, (p.stderr.strip().splitlines() or ["(no output)"])[-1][:120]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 8B command only")
    ap.add_argument("--repeat-off", action="store_true", help="also run every command with the layer repeat off")
    ap.add_argument("--new-models", action="store_true", help="also issue 35's MoE fits and Gemma-2's serve")
    ap.add_argument("--layouts", action="store_true",
                    help="also issue 45's layouts and issue 46's --what-fits at 4096 tokens, against the fake-tensor floor")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --layouts: time each fake-tensor floor and command pair this many times (min, median)")
    ap.add_argument("--only", default="", help="only the commands whose description holds this text")
    ap.add_argument("--floor-each", action="store_true",
                    help="time the import floor again right before each command and give its ratio to that one "
                         "(a shared machine's load moves between commands)")
    ap.add_argument("--time-cost", action="store_true",
                    help="only TIME_COST's commands, each with --no-time and without: the share the time model adds")
    args = ap.parse_args()
    if args.time_cost:
        return _time_cost(sys.executable, {**os.environ, "PYTHONPATH": os.getcwd()}, max(1, args.repeat), args.only)
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    folder = tempfile.mkdtemp(prefix="gpulab-fit-speed-")
    commands = [("8B, 80 GiB, bf16 AdamW, 2048",
                 ["fit", "hf:llama-3-8b", "--gpu", "80GiB", "--dtype", "bf16", "--optimizer", "adamw",
                  "--seq-len", "2048", "--json"])]
    if not args.quick:
        commands += [
            ("70B shape, 8 H100, FSDP2, checkpointing, 4096",
             ["fit", "hf:" + _config_file(folder, "llama-3.1-70b"), "--gpu", "H100", "--gpus", "8", "--strategy", "fsdp2",
              "--dtype", "bf16", "--optimizer", "adamw", "--checkpointing", "--seq-len", "4096", "--json"]),
            ("405B shape, 64 H100, ZeRO-3, checkpointing, 4096",
             ["fit", "hf:" + _config_file(folder, "llama-3.1-405b"), "--gpu", "H100", "--gpus", "64", "--strategy", "zero3",
              "--dtype", "bf16", "--optimizer", "adamw", "--checkpointing", "--seq-len", "4096", "--json"]),
            ("8B, 24 GiB, --what-fits",
             ["fit", "hf:llama-3-8b", "--gpu", "24GiB", "--dtype", "bf16", "--optimizer", "adamw", "--seq-len",
              "2048", "--what-fits", "--json"]),
        ]
    if args.new_models:   # issue 35's configs, each fit (bf16 AdamW, 2048 tokens) and serve (8192 tokens) beside 8B dense
        commands += [("serve 8B (dense), H100, 8192 tokens", _serve("llama-3-8b", "H100", 8192))]
        for name, layout in NEW_MODELS.items():
            commands.append((f"{name}, {layout[0]}", ["fit", f"hf:{name}", *layout[1], "--dtype", "bf16", "--optimizer",
                                                       "adamw", "--seq-len", "2048", "--json"]))
            commands.append((f"serve {name}, H100, 8192 tokens", _serve(name, "H100", 8192)))
        # issue 35's done-when: 32768 is past the 8192 positions of gemma-2-9b's config.json, answered with that assumption named
        commands.append(("serve gemma-2-9b, 24 GiB, 32768 tokens", _serve("gemma-2-9b", "24GiB", 32768)))
    if args.layouts:
        commands += LAYOUTS
    commands.append(("a bad option", ["fit", "hf:llama-3-8b", "--gpu", "H100", "--optimiser", "adamw"]))
    commands = [c for c in commands if args.only in c[0]]
    print(f"load average before: {_load()}")
    floor, _ = _timed([py, "-c", "import torch, transformers"], env)
    print(f"import floor (python -c 'import torch, transformers'): {floor:.1f} s")
    # torch 2.15 imports torch._dynamo for any fake run (FakeTensorMode.__init__: import torch._dynamo.config;
    # a TorchDispatchMode's __torch_dispatch__ wrapped by torch._disable_dynamo) and any optimizer step
    dynamo, _ = _timed([py, "-c", "import torch, transformers, torch._dynamo"], env)
    print(f"  + torch._dynamo, which every fake run and optimizer step imports: {dynamo:.1f} s "
          f"({dynamo / floor:.2f}x the floor)")
    for what, cmd in commands:
        if (what, cmd) in LAYOUTS:   # against the fake-tensor floor, timed right before each repeat
            print(_against_fake_floor(what, cmd, py, env, max(1, args.repeat)), flush=True)
            continue
        if args.floor_each and "bad option" not in what:
            floor, _ = _timed([py, "-c", "import torch, transformers"], env)
        seconds, answer = _timed([py, "-m", "gpulab", *cmd], env)
        line = (f"{what:48s} {seconds:7.1f} s  {seconds / floor:5.2f}x the floor"
                + (f" ({floor:.1f} s just before)" if args.floor_each else "") + f"  {answer}")
        if args.repeat_off and "bad option" not in what:
            off, _ = _timed([py, "-m", "gpulab", *cmd], {**env, "GPULAB_LAYER_REPEAT": "0"})
            line += f"\n{'':48s} {off:7.1f} s  {off / floor:5.2f}x with the layer repeat off ({off / seconds:.2f}x slower)"
        print(line, flush=True)
    print(f"load average after: {_load()}")
    return 0


def _against_fake_floor(what: str, cmd: list[str], py: str, env: dict[str, str], repeat: int) -> str:
    """``repeat`` pairs of (the fake-tensor floor, the command), each pair back to back: the
    seconds and ratios, their min and median."""
    ratios, cpu_ratios, lines, answer = [], [], [], ""
    for _ in range(repeat):
        cpu: list[float] = []
        floor, _ = _timed([py, "-c", FAKE_FLOOR], env, cpu)
        seconds, answer = _timed([py, "-m", "gpulab", *cmd], env, cpu)
        ratios.append(seconds / floor)
        cpu_ratios.append(cpu[1] / cpu[0])
        lines.append(f"{seconds:.1f} s / {floor:.1f} s wall, {cpu[1]:.1f} s / {cpu[0]:.1f} s CPU")
    ratios.sort()
    cpu_ratios.sort()
    return (f"{what:48s} {ratios[0]:5.2f}x min, {statistics.median(ratios):5.2f}x median the fake-tensor floor; "
            f"CPU time {cpu_ratios[0]:5.2f}x min, {statistics.median(cpu_ratios):5.2f}x median "
            f"({'; '.join(lines)}; load {_load()})  {answer}")


def _time_cost(py: str, env: dict[str, str], repeat: int, only: str) -> int:
    """Each of ``TIME_COST``'s commands with ``--no-time`` and without, back to back, ``repeat`` times: the
    CPU seconds of each (user + system of the process and its children) and what the time adds, as a share
    of the command without it (min and median over the repeats)."""
    print(f"load average before: {_load()}")
    cpu: list[float] = []
    _timed([py, "-c", FAKE_FLOOR], env, cpu)
    print(f"fake-tensor floor: {cpu[0]:.1f} s CPU")
    for what, cmd in [c for c in TIME_COST if only in c[0]]:
        added, pairs = [], []
        for _ in range(repeat):
            cpu = []
            _timed([py, "-m", "gpulab", *cmd, "--no-time"], env, cpu)
            _, answer = _timed([py, "-m", "gpulab", *cmd], env, cpu)
            added.append(cpu[1] / cpu[0] - 1)
            pairs.append(f"{cpu[1]:.1f}/{cpu[0]:.1f}")
        added.sort()
        print(f"{what:40s} time adds {added[0]:+.1%} min, {statistics.median(added):+.1%} median of the CPU time "
              f"(with/without, s: {'; '.join(pairs)}; load {_load()})  {answer}", flush=True)
    print(f"load average after: {_load()}")
    return 0


def _experts(answer: dict) -> str:
    """A mixture of experts' answer: how its experts ran (the routing it states), shortened."""
    label = answer.get("label") or ""
    text = answer.get("experts_note") or next((part for part in label.split("; ") if part.startswith("MoE")), "")
    return f"; experts: {text[:60]}" if text else ""


def _load() -> str:
    """The 1-, 5- and 15-minute load averages (the machine is shared: ratios, not seconds)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
