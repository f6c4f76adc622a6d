"""Published real-GPU memory figures next to gpulab's prediction of the same quantity.

    python benchmarks/published.py [--source KEY ...] [--json FILE]

Each row quotes a figure somebody measured on a GPU and published (the source, the exact text,
the GPU, what was measured and how), and sets beside it gpulab's prediction of that quantity for
the same setting: a fake-engine run following CUDA's kernels (training through ``gpulab.step``
with the recipe's options, generation through ``gpulab.predict.generation``), replayed through the
caching-allocator simulator where the published figure includes the allocator's cache. Then the
ratio (gpulab / published) and a tolerance that follows from what the published figure holds
that gpulab does not compute (the CUDA context, library workspaces, another torch version's saved
tensors, a kernel's workspace), written out for each source.

Then (``--time`` alone; ``--rows TEXT`` picks rows) published throughputs beside gpulab's predicted
time for one rank of the same setting, with what the prediction leaves out (communication, compile,
float8): torchtitan's tokens/s per GPU on H100s, Megatron-LM's weak-scaling table (per-GPU
teraFLOP/s and MFU, H100), and nccl-tests' bus bandwidth on an 8-GPU H100 NVLink node as NCCL's
maintainer states it beside gpulab's collective cost. Their ratios are reported; none tunes anything.
The Ultra-Scale Playbook's throughput plots are not here: no source readable from this project
(its figures are interactive plots in a Hugging Face Space) was found.

A benchmark, not a test: nothing is asserted. A row outside its tolerance prints MISS; the
closing notes of issue 23 explain each. Sources are independent of each other and of gpulab:
Hugging Face's documentation, Lightning AI's LitGPT, Alibaba's Qwen team, and PyTorch (torchao
and PyTorch's tutorials). Every figure was measured by them, on their GPUs; nothing here ran on a
GPU. A run takes about 2 minutes on a 2-core CPU. The figures, their sources and the recipes that
predict them live in ``gpulab.record.published`` (a lesson shows one with ``published_check``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.record.published import ROWS, SOURCES, Row, Source  # noqa: E402

__all__ = ["ROWS", "SOURCES", "TIME_ROWS", "Row", "Source", "TimeRow", "main", "time_rows"]


# --- published step times and throughputs (issue 46): the ratio of gpulab's predicted time ------------
# Each row quotes a throughput somebody measured on GPUs, with the setting it needs, beside gpulab's
# roofline prediction (gpulab.step(..., gpu="H100", time=True).time: predict/timing.py) of one rank's
# compute for the same setting. None of them tunes anything: the ratio is printed, with what the
# prediction leaves out (communication, the pipeline bubble, compile and float8 where it does not run them).

@dataclass(frozen=True)
class TimeRow:
    source: str         # URL and the file read (repository, path, commit)
    gpu: str
    name: str
    quote: str          # the source's own text holding the figure
    published: float    # tokens per second per GPU
    setting: str
    leaves_out: str     # what gpulab's prediction does not hold that the measured run paid for
    predict: Callable[[], tuple[float, str]]   # (the figure in ``unit``, how)
    unit: str = "tokens/s per GPU"


TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md ; "
              "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e20d1149fbf0b98c567af24c4b0433b22d "
              "(runs at torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b: train_configs/llama3_8b.toml and "
              "llama3_70b.toml give seq_len = 8192, the tables do not)")
TORCHTITAN_GPU = ("H100 96 GB HBM2e (2.4 TB/s), 500 W power limit, Grand Teton hosts of 8 NVLink-connected GPUs, "
                  "400 Gb/s RDMA per GPU; gpulab predicts on its H100 row (the SXM datasheet: 3.35 TB/s, 989 bf16 "
                  "TFLOPS dense), which the source says is faster than its card")


def _titan_tps(model: str, *, batch: int, checkpointing: str, tp: int = 1) -> tuple[float, str]:
    """One rank's step predicted on the H100 row, as tokens/s per GPU. With tp > 1 the rank's step is its
    share of the TP group's work (the timer costs each DTensor op as the rank's local kernel,
    ``predict.timing._local_share``) while the step's tokens are the group's: the tokens/s per GPU is the
    step's tokens/s over tp."""
    from gpulab.predict.step import step
    kw = {"tp": tp, "sequence_parallel": True} if tp > 1 else {}
    r = step(f"hf:{model}", batch=batch, seq_len=8192, optimizer="adamw", amp="bf16", engine="fake", use_cache=False,
             checkpointing=checkpointing, gpu="H100", time=True, **kw)
    t = r.time
    share = t.model_flops * tp / (6 * _parameters(model) * t.items)
    return t.items_per_s / tp, (f"{t.label}: step {t.seconds:.3f} s for {t.items:,} tokens"
                                + (f" over a TP group of {tp}" if tp > 1 else "") + f", MFU {t.mfu:.1%}; the "
                                f"step's model FLOPs are {share:.2f} x 6 x parameters x tokens; {t.assumptions.text}")


def _parameters(model: str) -> int:
    import torch

    from gpulab.models import hf_configs
    with torch.device("meta"):
        m = hf_configs.build_causal_lm(hf_configs.make_config(model))
    return sum(p.numel() for p in m.parameters())


_FSDP_COMM = ("FSDP2's all-gathers and reduce-scatters (torchtitan prefetches them to overlap compute; what stays "
              "exposed is not predicted: gpulab.step runs one unsharded rank)")
TIME_ROWS = [
    TimeRow(TORCHTITAN, TORCHTITAN_GPU, "torchtitan Llama 3.1 8B, FSDP 8 GPUs, eager", "| FSDP | 5,762 | 82.4 |",
            5762, "Llama 3.1 8B, 8 GPUs FSDP, local batch 2 x 8192, selective (op) activation checkpointing, bf16 "
            "mixed precision, AdamW, no compile, no float8 (table 1, first row); gpulab: llama-3-8b (the same "
            "shapes), batch 2 x 8192, checkpointing='selective', bf16 autocast", _FSDP_COMM,
            lambda: _titan_tps("llama-3-8b", batch=2, checkpointing="selective")),
    TimeRow(TORCHTITAN, TORCHTITAN_GPU, "torchtitan Llama 3.1 8B, FSDP 128 GPUs, eager", "| FSDP | 5,605 | 67.0 |",
            5605, "as above on 128 GPUs (table 3, first row): the same compute per GPU", _FSDP_COMM + "; across 16 "
            "hosts they cross the RDMA network",
            lambda: _titan_tps("llama-3-8b", batch=2, checkpointing="selective")),
    TimeRow(TORCHTITAN, TORCHTITAN_GPU, "torchtitan Llama 3.1 70B, FSDP 32 x TP 8, compile + float8",
            "| 2D | 829 | 71.9 |", 829,
            "Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16 x 8192, full activation checkpointing, "
            "torch.compile, float8 linears (table 4, first row); gpulab: one TP rank of llama-3.1-70b, tp=8 with "
            "sequence parallelism, batch 16 x 8192, checkpointing='full', bf16 autocast",
            "TP's all-gathers and reduce-scatters, on the critical path; FSDP's collectives; float8 matmuls (gpulab "
            "runs these in bf16, at half the fp8 peak) and compile's fusions",
            lambda: _titan_tps("llama-3.1-70b", batch=16, checkpointing="full", tp=8)),
]


# Megatron-LM's weak-scaling table (README "Performance Benchmarking", images/model_table.png): GPT models
# with a 131,072-token vocabulary at 4,096 tokens on H100s, per-GPU teraFLOP/s and MFU as printed there.
MEGATRON = ("https://github.com/NVIDIA/Megatron-LM/blob/main/images/model_table.png (README.md, \"Performance "
            "Benchmarking\": \"Vocabulary size: 131,072 tokens\", \"Sequence length: 4,096 tokens\", \"Throughputs "
            "include all operations (data loading, optimizer steps, communication, and logging)\"); NVIDIA/Megatron-LM "
            "@ d98e8a64ddf34856e74b24714e3bedb2f5a39553, images/model_table.png last changed in "
            "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4")
MEGATRON_GPU = ("H100 (the README's \"H100 clusters\"; MFU printed against 989 bf16 TFLOPS: 408.8 / 989 = 41%); "
                "gpulab predicts on its H100 row (SXM datasheet)")


def _megatron_gpt(hidden: int, heads: int, layers: int):
    """A GPT (GPT-2's architecture: LayerNorm, GeLU, a 4h MLP, learned positions) with the table's shape."""
    import transformers
    return transformers.GPT2Config(n_embd=hidden, n_head=heads, n_layer=layers, vocab_size=131072, n_positions=4096,
                                   use_cache=False)


def _megatron_tflops(hidden: int, heads: int, layers: int, *, batch: int) -> tuple[float, str]:
    """One GPU's predicted model TFLOP/s on the H100 row (model FLOPs: 3 x the forward's, counted by the
    timer) for ``batch`` sequences of 4,096 tokens."""
    from gpulab.predict.step import step
    r = step(_megatron_gpt(hidden, heads, layers), batch=batch, seq_len=4096, optimizer="adamw", amp="bf16",
             engine="fake", gpu="H100", time=True)
    t = r.time
    tflops = t.model_flops / t.seconds / 1e12
    return tflops, (f"{t.label}: step {t.seconds:.3f} s for {t.items:,} tokens, {tflops:,.1f} model TFLOP/s, MFU "
                    f"{t.mfu:.1%}; {t.assumptions.text}")


_MEGATRON_OUT = ("the data-parallel gradient reduce-scatter and parameter all-gather (overlapped there: "
                 "--overlap-grad-reduce, --overlap-param-gather) and data loading and logging, which the "
                 "published figure includes; Megatron's fused kernels (gpulab times eager PyTorch ops, a roofline "
                 "each); the table's own FLOP count (gpulab's is 3 x the forward's counted FLOPs)")


# NCCL's bus bandwidth on one 8-GPU H100 NVLink node, as NCCL's maintainer states it for nccl-tests
NCCL_212 = ("https://github.com/NVIDIA/nccl-tests/issues/212, comment by sjeaugey (NCCL, NVIDIA), 2024-05-06, on "
            "all_reduce_perf over 8 H100 SXM")
NCCL_GPU = "8 H100 SXM of one node, NVLink 4 through NVSwitch (line rate 450 GB/s a direction)"


def _nccl_busbw(kind: str) -> tuple[float, str]:
    """gpulab's bus bandwidth for ``kind`` over the 8 GPUs of an H100 node: S x NCCL's factor / its predicted
    time (``predict.comm_time``), for S = 8 GiB (nccl-tests' -e 8G, past where the bandwidth stops growing)."""
    from gpulab.predict.card_speeds import CARD_SPEEDS
    from gpulab.predict.comm_time import bus_factor, collective_seconds, link_for
    bw, link = link_for(CARD_SPEEDS["H100"].links, 8)
    nbytes = 8 * 2 ** 30
    t = collective_seconds(kind, nbytes, 8, bw)
    busbw = nbytes * bus_factor(kind, 8) / t / 1e9
    return busbw, (f"predict.comm_time: {kind} of 8 GiB over 8 ranks on {link} ({bw / 1e9:,.0f} GB/s a direction) "
                   f"takes {t * 1e3:,.2f} ms; busbw = S x {bus_factor(kind, 8):.3f} / t = {busbw:,.0f} GB/s")


TIME_ROWS += [
    TimeRow(MEGATRON, MEGATRON_GPU, "Megatron-LM GPT 1.7B, TP 1, DP 48 (weak scaling)",
            "| 1.7B | 16 | 2048 | 24 | 1 | 1 | 48 | 48 | 192 | 408.8 | 41% | 19.6 |", 408.8,
            "GPT 1.7B: 16 heads, hidden 2048, 24 layers, TP 1, PP 1, DP 48, 48 GPUs, global batch 192 x 4096 (4 "
            "sequences a GPU), per-GPU teraFLOP/s 408.8, MFU 41% (the table's first row, read from the image); "
            "gpulab: GPT-2's architecture at that shape, vocabulary 131,072, batch 4 x 4096 on one rank, bf16 "
            "autocast, AdamW", _MEGATRON_OUT, lambda: _megatron_tflops(2048, 16, 24, batch=4), "TFLOP/s per GPU"),
    TimeRow(MEGATRON, MEGATRON_GPU, "Megatron-LM GPT 7.1B, TP 2, DP 48 (weak scaling)",
            "| 7.1B | 32 | 4096 | 30 | 2 | 1 | 48 | 96 | 192 | 465.9 | 47% | 44.7 |", 465.9,
            "GPT 7.1B: 32 heads, hidden 4096, 30 layers, TP 2, PP 1, DP 48, 96 GPUs, global batch 192 x 4096 (4 "
            "sequences a TP group), per-GPU teraFLOP/s 465.9, MFU 47% (second row); gpulab: the TP group's work on "
            "one GPU (GPT-2's architecture has no transformers tensor-parallel plan, so gpulab runs it unsplit), "
            "batch 4 x 4096, bf16 autocast, AdamW: the model FLOP/s a GPU of the group runs if TP splits evenly",
            _MEGATRON_OUT + "; TP's collectives (overlapped there, --tp-comm-overlap) and the smaller GEMMs a TP "
            "rank runs", lambda: _megatron_tflops(4096, 32, 30, batch=4), "TFLOP/s per GPU"),
    TimeRow(NCCL_212, NCCL_GPU, "nccl-tests busbw, 8 H100 NVLink, ring / non-all-reduce",
            "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of "
            "370GB/s, which you can observe as \"BusBw\" when running non-allreduce operations, or when running with "
            "NCCL_ALGO=RING.", 370, "nccl-tests all_gather_perf (or all_reduce_perf with NCCL_ALGO=RING) on 8 GPUs, "
            "large sizes; gpulab: an all-gather of 8 GiB over 8 ranks",
            "NCCL's protocol overhead (~20%, the quote), which gpulab's COMM_ASSUMPTION names and leaves out",
            lambda: _nccl_busbw("all_gather"), "GB/s bus bandwidth"),
    TimeRow(NCCL_212, NCCL_GPU, "nccl-tests busbw, 8 H100 NVLink, all-reduce (NVLink SHARP)",
            "On 8 GPUs, you should reach a peak busBw of ~480GB/s (algbw ~275GB/s). You need to run on larger sizes "
            "though", 480, "nccl-tests all_reduce_perf on 8 GPUs, NCCL's default algorithm (NVLink SHARP: the "
            "switch reduces), large sizes; gpulab: an all-reduce of 8 GiB over 8 ranks, ring factor 2(n-1)/n",
            "NVLink SHARP: the NVSwitch does the reduction, so the bytes on each GPU's link are fewer than a ring's; "
            "gpulab costs every all-reduce as a ring (an upper bound on its time)",
            lambda: _nccl_busbw("all_reduce"), "GB/s bus bandwidth"),
]


def time_rows(names: list[str] | None = None) -> list[dict]:
    """Every time row's prediction and its ratio (predicted / published, in the row's unit) as data; ``names``:
    only the rows whose name holds one of them."""
    import time as _time
    out = []
    for r in TIME_ROWS:
        if names and not any(n.lower() in r.name.lower() for n in names):
            continue
        t0 = _time.perf_counter()
        predicted, how = r.predict()
        out.append({**{k: v for k, v in asdict(r).items() if k != "predict"}, "predicted": predicted,
                    "ratio": predicted / r.published, "how": how, "seconds": _time.perf_counter() - t0})
    return out


def print_time_rows(names: list[str] | None = None) -> list[dict]:
    out = time_rows(names)
    print("\n== published throughputs and bandwidths beside gpulab's predicted time; none tunes anything")
    print(f"   {'row':<62} {'published':>10} {'gpulab':>10} {'ratio':>6}  unit")
    for r in out:
        print(f"   {r['name']:<62} {r['published']:>10,.1f} {r['predicted']:>10,.1f} {r['ratio']:>6.2f}  {r['unit']}",
              flush=True)
        print(f"      quoted: {r['quote']}\n      setting: {r['setting']}\n      GPU: {r['gpu']}\n      "
              f"source: {r['source']}\n      gpulab: {r['how']}\n      the prediction leaves out: {r['leaves_out']}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", nargs="+", choices=sorted(SOURCES), help="only these sources' rows")
    p.add_argument("--json", metavar="FILE", help="also write every row (and its source) as JSON")
    p.add_argument("--time", action="store_true", help="only the published throughputs beside gpulab's predicted time")
    p.add_argument("--rows", nargs="+", metavar="TEXT", help="with --time: only the rows whose name holds TEXT")
    args = p.parse_args(argv)
    if args.time:
        timed = print_time_rows(args.rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(timed, f, indent=1)
        return 0
    rows = [r for r in ROWS if not args.source or r.source in args.source]
    out, misses, t_all = [], 0, time.perf_counter()
    for key in dict.fromkeys(r.source for r in rows):
        s = SOURCES[key]
        print(f"\n== {s.title}\n   {s.where}\n   GPU: {s.gpu}\n   measured: {s.metric}\n"
              f"   tolerance {s.tolerance[0]:.2f}-{s.tolerance[1]:.2f}: {s.why}")
        print(f"   {'row':<48} {'published':>12} {'gpulab':>12} {'ratio':>6}  {'':4} seconds")
        for r in (r for r in rows if r.source == key):
            t0 = time.perf_counter()
            predicted, how = r.predict()
            seconds = time.perf_counter() - t0
            published = r.published * s.unit
            ratio = predicted / published
            ok = s.tolerance[0] <= ratio <= s.tolerance[1]
            misses += not ok
            print(f"   {r.name:<48} {r.published:>8.2f} {s.unit_name:<3} {predicted / s.unit:>8.2f} {s.unit_name:<3} "
                  f"{ratio:>6.3f}  {'ok' if ok else 'MISS':4} {seconds:5.1f}", flush=True)
            print(f"      quoted: {r.quote}\n      setting: {r.setting}\n      gpulab: {how}")
            out.append({**{k: v for k, v in asdict(r).items() if k not in ("predict", "source")}, "source": asdict(s),
                        "published_bytes": published, "predicted_bytes": predicted, "ratio": ratio,
                        "within_tolerance": ok, "how": how, "seconds": seconds})
    orgs = {r["source"]["org"] for r in out}
    print(f"\n{len(out)} rows from {len({r['source']['key'] for r in out})} sources ({len(orgs)} independent "
          f"publishers: {', '.join(sorted(orgs))}): {len(out) - misses} within "
          f"tolerance, {misses} outside; {time.perf_counter() - t_all:.0f} s")
    if not args.source:
        out += [{**r, "kind": "time"} for r in print_time_rows()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
