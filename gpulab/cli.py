"""``gpulab env | breakdown MODEL | step MODEL | fit MODEL --gpu CARD | record`` (also ``python -m gpulab``).

MODEL is a lesson model, any torchvision classification model (``resnet50``,
``torchvision:resnet50``) or a built-in transformer config (``hf:gpt2``, ``hf:llama-3-8b`` ...).

Each command prints a readable table, or with ``--json`` exactly one JSON object on stdout.
Bad input gets one line on stderr naming what is valid, and exit code 2;
with ``--json`` the same message is also the one JSON object on stdout, ``{"error": "..."}``.

The arguments are parsed, and every value that needs no torch checked (choices, numbers, the
card and sizes, dtype names, checkpointing policies, loss chunks), before torch and transformers
are imported: ``--help`` or a bad value answers in a fraction of a second; only a command that
runs imports them. ``fit`` and ``serve`` say what they are doing on stderr as they go
(``predict.progress``; ``--quiet``: nothing), never on stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
from typing import Any, Sequence

from gpulab.command import answers, checks
from gpulab.options import (ALL_OPTIMIZERS, AMP_NAMES, FP8_RECIPES, MAX_STEPS, POLICY_TEXT, SCHEDULES, check_checkpointing,
                            check_chunks, check_fp8)
from gpulab.predict.progress import StreamProgress
from gpulab.units import check_model_dtype_name

__all__ = ["MODEL_HELP", "REPORT", "build_parser", "env_info", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        self._print_message(f"gpulab: error: {message}\n", sys.stderr)
        exc = SystemExit(2)
        exc.gpulab_error = message   # main() writes it as JSON too under --json
        raise exc


# options whose value may begin with "-" (a negative size: "--gpu -1GB"), which argparse reads as an
# option and answers "expected one argument": main() joins them ("--gpu=-1GB") so the size check answers
_SIZE_OPTIONS = ("--gpu", "--context", "--cuda-context")


def _join_negative_sizes(argv: list[str]) -> list[str]:
    out: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a in _SIZE_OPTIONS and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2] in "0123456789.":
            out.append(f"{a}={argv[i + 1]}")
            next(it, None)
        else:
            out.append(a)
    return out


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _checkpointing(text: str) -> str:
    try:
        return check_checkpointing(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"checkpointing must be a policy: {POLICY_TEXT}; got {text!r}") from None


def _steps(text: str) -> int:
    v = _positive_int(text)
    if v > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_STEPS} (the steady state is reached at step 2; "
                                         f"later steps repeat it), got {v}")
    return v


def _chunks(text: str) -> int:
    """--chunked-loss K: 0 (the default) is off, the model's own loss; else 2 to 64 chunks."""
    try:
        return check_chunks(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of chunks from 2 to 64 (torchtune uses 8), or 0 (the "
                                         f"default) for the model's own loss; got {text!r}") from None


def _fp8(text: str) -> str:
    try:
        return check_fp8(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtype(text: str) -> str:
    try:
        check_model_dtype_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of the card's memory in (0, 1], got {text!r}")
    return v


MODEL_HELP = ("a lesson model (vgg16, alexnet, resnet18, mlp, cnn), any torchvision classification model "
              "(resnet50, torchvision:vit_b_16 ...), or a built-in transformer config (hf:gpt2, hf:llama-3-8b ...)")


# the commands' descriptions (docs/cli.md is generated from them: docs/make_cli_md.py)
_JSON_HELP = "print one JSON object on stdout instead of the table"
_EPILOG = ("A bad option or value is answered in one line, exit status 2, before torch loads. fit and serve say what "
           "they are doing on stderr (--quiet: nothing); with --json, stdout holds one JSON object. The Python API "
           "behind each command: docs/api.md.")
_STEP_TEXT = ("Training steps of MODEL run on an engine under gpulab's tracker: the peak by category (parameters, "
              "gradients, optimizer state, activations, temporaries, inputs) beside the formulas, step 1's peak "
              "beside the steady state's.")
_FIT_TEXT = ("The largest batch whose two-step training run fits the card: the peak by category, the simulated "
             "allocator's overhead, the CUDA context assumed (a measurement, named) and the margin. Fake runs follow "
             "the card's CUDA kernels: no GPU and no memory needed. How it answers (the card's total, layers laid "
             "out from a few, sharding, TP/PP/CP/EP, experts' routing): docs/api.md.")
_RECORD_TEXT = ("Runs the lessons' record set on an NVIDIA GPU and writes one JSON file with its provenance; files "
                "written on a real GPU ship in gpulab/recorded/. Without a GPU: exit status 2.")


def _model_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--image-size", type=_positive_int, default=None, help="image models: the image side in pixels")
    s.add_argument("--seq-len", type=_positive_int, default=None, help="transformers: tokens per sequence")
    s.add_argument("--dtype", type=_dtype, default=None, help="the model's dtype: float32 (default), bf16, fp16")
    s.add_argument("--json", action="store_true", help=_JSON_HELP)


def _plan_options(f: argparse.ArgumentParser) -> None:
    """fit's answers beside the largest batch: what fits, the fastest plan, the predicted time."""
    f.add_argument("--what-fits", type=_positive_int, nargs="?", const=1, default=None, metavar="BATCH",
                   help="also list the recipes that fit at BATCH (default 1), each confirmed by a fake run and "
                        "ranked by predicted step time")
    f.add_argument("--fastest", nargs="?", const="plan", default=None, choices=("plan", "layout"),
                   help="the fastest plan that fits, by predicted step time: on one GPU, --what-fits's recipes (and "
                        "the asked one) at its batch; with --gpus N, the layouts of N GPUs (data parallelism "
                        "ddp/zero2/zero3/fsdp2, tp 1/2/4/8 within a node, pp dividing the layers, ep for experts; "
                        "--tp/--pp/--ep/--strategy given fix that degree) times the asked recipe and each single "
                        "change --what-fits knows (loss in chunks, optimizer step in backward, bf16, 8-bit state, "
                        "selective or full checkpointing), each at its largest batch, ranked by predicted tokens/s; "
                        "pairs whose memory floor passes the card or whose time bound cannot win are not run, and "
                        "the answer counts and names them. '--fastest layout' holds the asked recipe fixed "
                        "(layouts only)")
    f.add_argument("--no-time", action="store_true",
                   help="leave out the predicted step time (a roofline per op on the card's datasheet speeds)")


def _context_options(f: argparse.ArgumentParser) -> None:
    """fit's CUDA context: given, or assumed for the module loading."""
    f.add_argument("--context", default=None,
                   help="memory the CUDA context takes outside PyTorch's allocator (default: assumed from "
                        "--cuda-module-loading, with the published measurements it rests on)")
    f.add_argument("--cuda-module-loading", default="lazy", choices=("lazy", "eager"),
                   help="CUDA's module loading, which sets the assumed context size (lazy: CUDA's own default from "
                        "CUDA 12.2 on Linux and 12.3 on Windows; eager: older CUDA, or CUDA_MODULE_LOADING=EAGER)")


def _mesh_options(f: argparse.ArgumentParser) -> None:
    """fit's GPUs and how they hold the model: the mesh's data-parallel part (gpulab.options.Layout)."""
    f.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                   help="spread the step over N GPUs (with --strategy): the answer is one GPU's, the batch per GPU")
    f.add_argument("--strategy", default=None, choices=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
                   help="how N GPUs hold the model: ddp, DeepSpeed's zero1/zero2/zero3 (bf16/fp16 Adam), fsdp2")
    f.add_argument("--dp-replicate", type=_positive_int, default=None, metavar="N",
                   help="with --gpus: the mesh's replicas (torchtitan's data_parallel_replicate_degree; with "
                        "--strategy fsdp2 and --dp-shard: HSDP, replicas of shards); gpus = dp_replicate x "
                        "dp_shard x cp x tp x pp")
    f.add_argument("--dp-shard", type=_positive_int, default=None, metavar="N",
                   help="with --gpus: the ranks each replica's state is sharded over (torchtitan's "
                        "data_parallel_shard_degree; fsdp2 or zero*); default: what --gpus and --strategy leave")
    f.add_argument("--offload-optimizer", action="store_true",
                   help="with --strategy zero*/fsdp2: the optimizer state lives in host memory")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building and using it imports no torch (``gpulab.options``)."""
    p = _Parser(prog="gpulab", description="Where does GPU memory go? Measure it. "
                "(--debug anywhere: show the traceback of an error)", epilog=_EPILOG)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    e = sub.add_parser("env", help="Python/torch versions, GPU facts, the engine lessons will use")
    e.add_argument("--json", action="store_true", help=_JSON_HELP)
    b = sub.add_parser("breakdown", help="per-layer table: output shapes, params, bytes, FLOPs")
    _model_options(b)
    b.add_argument("--batch", type=_positive_int, default=None, help="batch size (default 1)")
    s = sub.add_parser("step", help="memory of training steps (steady state: 2 steps), by category, vs the formulas",
                       description=_STEP_TEXT)
    _model_options(s)
    s.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's own)")
    s.add_argument("--optimizer", default="adam", choices=list(ALL_OPTIMIZERS))
    s.add_argument("--amp", default=None, choices=list(AMP_NAMES), help="run the forward under torch.autocast")
    s.add_argument("--engine", default="auto", help="auto (cuda with a GPU, else cpu; fake if too large), cuda, cpu or fake")
    s.add_argument("--steps", type=_steps, default=2,
                   help="training steps (default 2: the optimizer state exists from the first step on)")
    s.add_argument("--fake-target", default="cuda", choices=["cuda", "cpu"],
                   help="fake engine: follow CUDA's kernels (default: a GPU's answer) or this CPU's")
    s.add_argument("--gpu", default=None, help="fake engine, CUDA target: the card whose kernels it follows (T4, "
                                               "H100 ...: its compute capability picks the attention kernel); on "
                                               "the card a step was recorded on, that step's cuDNN workspaces")
    s.add_argument("--time", action="store_true",
                   help="with --gpu (and the fake engine): also the step's predicted time on that card, a roofline "
                        "per op (step time, tokens/s, MFU, the assumptions named)")
    _recipe_options(s)
    f = sub.add_parser("fit", help="the largest batch whose training step fits a GPU (fake engine + allocator simulator)",
                       description=_FIT_TEXT)
    _model_options(f)
    f.add_argument("--gpu", required=True, help="a card (H100, A100-40GB, RTX4090, T4 ...) or a size (24GiB, 80GB)")
    f.add_argument("--optimizer", default="adam", choices=list(ALL_OPTIMIZERS))
    f.add_argument("--amp", default=None, choices=list(AMP_NAMES), help="run the forward under torch.autocast")
    _context_options(f)
    _mesh_options(f)
    _fsdp_policy_options(f)
    _plan_options(f)
    _recipe_options(f)
    _quiet_option(f)
    v = sub.add_parser("serve", help="will a language model serve on a GPU: weights, KV cache, prefill and decode "
                                     "peaks (fake tensors at full size), vLLM-style paged blocks")
    v.add_argument("model", help="a built-in transformer config (hf:llama-3-8b, hf:qwen2.5-7b ...) or hf:path/config.json")
    v.add_argument("--gpu", required=True, help="a card (H100, A100-40GB, RTX4090, T4 ...) or a size (24GiB, 80GB)")
    v.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="tokens per sequence, prompt and output together (or --longest-context)")
    v.add_argument("--longest-context", action="store_true",
                   help="instead of --context: the longest context at which --batch sequences fit the card "
                        "(each context tried measured on fake tensors at full size)")
    v.add_argument("--batch", type=_positive_int, default=1, help="sequences served at once (default 1)")
    v.add_argument("--dtype", type=_dtype, default="bf16", help="the model's dtype (default bf16)")
    v.add_argument("--weights", default=None, choices=("int8", "int4", "nf4"),
                   help="weight-only quantization as bitsandbytes stores it (int4: its 4-bit NF4 layout)")
    v.add_argument("--kv-dtype", default=None, choices=("bf16", "fp16", "fp32", "fp8"),
                   help="the KV cache's dtype (default: the model's)")
    v.add_argument("--block-size", type=_positive_int, default=16, help="vLLM's KV block size in tokens (default 16)")
    v.add_argument("--utilization", type=_fraction, default=0.9,
                   help="vLLM's gpu_memory_utilization: the share of the card it plans with (default 0.9)")
    v.add_argument("--cuda-context", default=None, metavar="SIZE",
                   help="memory the CUDA context takes outside PyTorch's allocator (default: gpulab's H200 "
                        f"measurement, {_assumed_context()} with lazy loading)")
    v.add_argument("--cuda-module-loading", default="lazy", choices=("lazy", "eager"),
                   help="CUDA's module loading, which sets the assumed context size (lazy: CUDA's own default from "
                        "CUDA 12.2 on Linux and 12.3 on Windows; eager: older CUDA, or CUDA_MODULE_LOADING=EAGER)")
    v.add_argument("--no-time", action="store_true",
                   help="leave out the predicted prefill and decode times (a roofline per op on the card's speeds)")
    v.add_argument("--json", action="store_true", help=_JSON_HELP)
    _quiet_option(v)
    r = sub.add_parser("record", help="on a GPU: measure the lessons' record set, write <out>/<gpu>.json",
                       description=_RECORD_TEXT)
    r.add_argument("--out", default=".", help="folder for the JSON file (default: the current folder)")
    r.add_argument("--quick", action="store_true", help="a small subset: checks the command, not for shipping")
    r.add_argument("--force", action="store_true", help="replace an existing record file for this GPU")
    r.add_argument("--json", action="store_true", help=_JSON_HELP)
    return p


def _quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (by default a long answer says what it is doing there; "
                        "stdout holds only the answer)")


def _record(args) -> int:
    """``gpulab record``: needs a GPU; without one, one line on stderr and exit 2."""
    import torch
    if not torch.cuda.is_available():   # main() says it in one line (and as JSON under --json), exit 2
        raise ValueError("gpulab record needs a CUDA GPU (torch.cuda.is_available() is False); nothing was recorded")
    from gpulab.files import check_target
    from gpulab.record.runner import record, record_path, write_record
    try:  # before measuring: a bad --out must not cost the whole run
        check_target(record_path(args.out, torch.cuda.get_device_name(0)), overwrite=args.force, flag="--force")
    except OSError as exc:
        raise ValueError(f"{exc}; nothing was recorded") from None
    data = record(quick=args.quick, command=["gpulab", *(sys.argv[1:] if args.argv is None else args.argv)])
    path = write_record(data, args.out, overwrite=args.force, flag="--force")
    summary = {"path": str(path), "gpu": data["provenance"]["gpu_name"], "experiments": len(data["experiments"]),
               "quick": data["quick"], "stand_in": data["provenance"]["stand_in"]}
    text = (f"recorded {summary['experiments']} experiments on {summary['gpu']} -> {path}"
            + (" (a stand-in GPU: this file must not ship)" if summary["stand_in"] else ""))
    return _emit(json.dumps(summary) if args.json else text)


def env_info() -> dict[str, Any]:
    import torch
    import torchvision

    from gpulab.measure.engines import choose_engine, engine_status
    from gpulab.measure.gpu import device_report

    choice = choose_engine("auto")
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "torchvision": torchvision.__version__, "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda, "device": device_report().as_dict(),
        "engine": choice.name, "engine_reason": choice.reason,
        "engines": {k: {"available": a, "why": w} for k, (a, w) in engine_status().items()},
    }


REPORT = "please report it with the command you ran"


def _fsdp_policy_options(f: argparse.ArgumentParser) -> None:
    """gpulab fit's FSDP2 MixedPrecisionPolicy and float8 all-gather."""
    f.add_argument("--param-dtype", default=None, choices=("bf16", "fp32", "fp16"),
                   help="with --strategy fsdp2: MixedPrecisionPolicy(param_dtype): parameters all-gathered and "
                        "computed in it, sharded master weights in --dtype (torchtitan: bf16 over fp32)")
    f.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="with --strategy fsdp2: MixedPrecisionPolicy(reduce_dtype): gradients reduce-scattered in "
                        "it (torchtitan: fp32; default: the parameters' dtype)")
    f.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fp8 tensorwise and --strategy fsdp2: weights all-gathered in float8, 1 byte each "
                        "(torchao's enable_fsdp_float8_all_gather)")


def _recipe_options(p: argparse.ArgumentParser) -> None:
    """The training recipe's flags (gpulab.step / gpulab.fit's recipe arguments)."""
    p.add_argument("--accumulate", type=_positive_int, default=1, metavar="K",
                   help="gradient accumulation: K micro-batches of --batch per optimizer step")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients' total norm to MAX before each step (clip_grad_norm_)")
    p.add_argument("--grad-scaler", action="store_true", help="with --amp fp16: torch.amp.GradScaler")
    p.add_argument("--keep-grads", action="store_true",
                   help="zero_grad(set_to_none=False): the gradients stay allocated, zeroed, between steps")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="one optimizer per parameter, stepped as soon as its gradient exists (torchtune's optimizer_in_bwd)")
    p.add_argument("--chunked-loss", type=_chunks, default=0, metavar="K",
                   help="a language model's head and loss K chunks of positions at a time, 2 to 64 (torchtune "
                        "uses 8); 0, the default, is off: the model's own loss")
    p.add_argument("--no-kv-cache-in-training", action="store_true",
                   help="a language model's training forward with use_cache=False (by default its config decides)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile: inductor's partition and memory plan (lowered and scheduled, no code generated), "
                        "beside the same graphs run op by op (the upper bound)")
    p.add_argument("--offload-activations", action="store_true",
                   help="saved activations copied to host memory (save_on_cpu); their peak is reported apart")
    p.add_argument("--optimizer-impl", default="default", choices=("default", "for-loop", "foreach", "fused"),
                   help="the optimizer's implementation (torch's default on the device, or one named)")
    p.add_argument("--checkpointing", nargs="?", const="full", default=False, type=_checkpointing, metavar="POLICY",
                   help=f"a transformers model's own activation checkpointing, full where no POLICY is given: "
                        f"{POLICY_TEXT}")
    p.add_argument("--lora", type=_positive_int, default=0, metavar="R",
                   help="LoRA adapters of rank R (peft) on a frozen base; only they train")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                   help="with --lora: the layers to adapt (default: peft's for the model type, e.g. q_proj v_proj)")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="with --lora: dropout on the adapters' inputs (peft's lora_dropout)")
    p.add_argument("--lora-dtype", choices=("fp32", "base"), default="fp32",
                   help="with --lora: the adapters in fp32 (peft's default) or in the model's dtype (base: torchtune's)")
    p.add_argument("--quantize", choices=("nf4", "fp4", "int8"), default=None,
                   help="with --lora: the base's linear layers stored as bitsandbytes stores them (4-bit NF4, "
                        "4-bit FP4: Linear4bit's default type, or int8)")
    p.add_argument("--no-double-quant", action="store_true",
                   help="with a 4-bit --quantize: one fp32 absmax per 64 weights instead of double quantization "
                        "(transformers' BitsAndBytesConfig default; Linear4bit's is double)")
    p.add_argument("--quant-compute-dtype", choices=("input", "fp32", "bf16", "fp16"), default="input",
                   help="with a 4-bit --quantize: bnb_4bit_compute_dtype (transformers' default fp32); "
                        "input (the default): the input's dtype, as Linear4bit computes without one")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: --quantize nf4 with --lora (rank 8 unless --lora says otherwise)")
    p.add_argument("--routing", default=None, metavar="ASSUMPTION",
                   help="a mixture of experts' routing, an assumption the answer states: left out, the model's own "
                        "experts kernel where it is transformers' grouped_mm (its memory is the same however tokens "
                        "are routed: no assumption needed), else balanced; balanced (tokens*k/E rows per expert), "
                        "capacity:F (each expert F times that, dropped or padded), worst (every token to the same k "
                        "experts) or router (the model's own experts kernel)")
    _parallel_options(p)



def _parallel_options(p: argparse.ArgumentParser) -> None:
    """The model-parallel flags (tensor, context, expert, pipeline) and fp8: gpulab.Layout's and the recipe's."""
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="tensor parallelism over N GPUs (torchtitan's layout: the blocks by the model's own "
                        "transformers plan, the embedding and head split by vocabulary; PyTorch's fake process "
                        "group, fake tensors): the answer is one rank's; with --gpus, N divides it")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: Megatron-style sequence parallelism (norms and the residual stream on a "
                        "sequence shard)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="with --tp: the logits stay split by vocabulary and the cross-entropy is computed on "
                        "them (torch.distributed.tensor.parallel.loss_parallel, as torchtitan does)")
    p.add_argument("--cp", type=_positive_int, default=1, metavar="N",
                   help="context parallelism over N ranks: the answer is one rank's sequence shard (seq_len/N), "
                        "ring attention's K/V buffers stated as a formula; 2N (with --sequence-parallel 2N x tp) "
                        "divides the sequence; with --gpus, tp x cp divides it")
    p.add_argument("--ep", type=_positive_int, default=1, metavar="N",
                   help="expert parallelism over N ranks for a mixture of experts: the rank holds experts/N "
                        "experts per layer, tokens dispatched by all-to-all (buffers sized by --routing); "
                        "N divides the experts and --gpus")
    p.add_argument("--pp", type=_positive_int, default=1, metavar="N",
                   help="pipeline parallelism over N stages (the layers split evenly: embedding on the first, "
                        "norm, head and loss on the last): fit answers per stage; with --gpus, tp x pp divides it")
    p.add_argument("--microbatches", type=_positive_int, default=None, metavar="M",
                   help="with --pp: micro-batches per step (default: N); --batch / the answer is one micro-batch")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="with --pp: 1f1b (stage i holds min(N - i, "
                   "M) micro-batches), gpipe (every stage holds M) or interleaved (V chunks a rank, torch's order)")
    p.add_argument("--virtual-stages", type=_positive_int, default=1, metavar="V", help="with --schedule "
                   "interleaved: model chunks per rank (Megatron-LM's virtual pipeline size); N x V divides the layers")
    p.add_argument("--pp-stage", type=int, default=0, metavar="S",
                   help="step with --pp: the stage to measure, 0 (the first) to N-1 (the last)")
    p.add_argument("--fp8", type=_fp8, default=None, metavar="RECIPE",
                   help=f"FP8 training as torchao converts it ({' or '.join(FP8_RECIPES)} scaling): the linear "
                        f"layers but the output head cast input and weight to float8 for each matmul")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr: bad input or a size this machine
    cannot hold (exit 2), an interrupt ("interrupted", exit 130), anything else an internal error
    that says so (exit 2; ``--debug`` shows its traceback). Under ``--json`` the same message is
    also written to stdout as one JSON object, ``{"error": "..."}``. A negative size after
    ``--gpu``/``--context``/``--cuda-context`` is read as that option's value, so its check answers."""
    own = argv is None   # this process's own command line: it only answers (models.lean_imports)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = _join_negative_sizes([a for a in argv if a != "--debug"])
    as_json = "--json" in argv   # an error is then also one JSON object on stdout: {"error": "..."}
    try:
        code = _main(argv, own)
    except KeyboardInterrupt:
        print("gpulab: interrupted", file=sys.stderr)
        return _json_error("interrupted", as_json, 130)
    except SystemExit as exc:   # argparse's refusal (one line on stderr already); --help exits 0
        if as_json and getattr(exc, "gpulab_error", None):
            _json_error(exc.gpulab_error, True)
        raise
    except (ValueError, OSError, OverflowError, MemoryError) as exc:   # what the user can change
        if debug:
            raise
        print(f"gpulab: error: {_one_line(exc)}", file=sys.stderr)
        return _json_error(_one_line(exc), as_json)
    except Exception as exc:  # noqa: BLE001 - a bug of gpulab's, or of torch's on this input
        if debug:
            raise
        text = f"internal error: {type(exc).__name__}: {_one_line(exc)} ({REPORT}; add --debug for the traceback)"
        print(f"gpulab: {text}", file=sys.stderr)
        return _json_error(text, as_json)
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """The ``gpulab`` script and ``python -m gpulab``: ``main`` on this process's command line, then
    the end without the interpreter's teardown (``_ended``); with ``argv`` given (a caller in Python),
    ``main(argv)`` and its code, the process left running."""
    return _ended(main()) if argv is None else main(argv)


def _ended(code: int) -> int:
    """A process that only answered (``python -m gpulab``, the ``gpulab`` script) ends here, its answer
    written: stdout and stderr flushed, logging shut down, then ``os._exit`` without the interpreter's
    teardown, which frees torch's and transformers' modules and the timelines kept one by one (measured
    on the 70B TP 8 × PP 4 fit: 1.3 to 1.9 s of CPU on the shared 2-core machine, more than a small
    fit's fake runs). Nothing else waits for the exit: every file gpulab writes is closed where it is
    written, and the other exit handlers torch and transformers' imports register (PIL's cache, filelock's
    and huggingface_hub's sessions) hold nothing that outlives the process. Where a stream cannot be
    flushed (a closed pipe), the usual exit."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return code
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    os._exit(code)


def _assumed_context() -> str:
    """The lazy-loading context size fit and serve assume, as the GPU validation printed it
    (``gpulab.predict.cards.CUDA_CONTEXT_ASSUMED``; no torch import)."""
    from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED
    from gpulab.units import MiB
    return f"{CUDA_CONTEXT_ASSUMED / MiB:,.2f} MiB"


def _json_error(text: str, as_json: bool, code: int = 2) -> int:
    """Under --json, the error as the one JSON object on stdout (the line on stderr stays for people)."""
    if as_json:
        _emit(json.dumps({"error": text}))
    return code


def _one_line(exc: BaseException) -> str:
    """The message on one line, without the C++ stack that torch's errors carry."""
    text = str(exc).split("Exception raised from")[0]
    text = " ".join(text.split()).rstrip(' "')
    return text if len(text) <= 400 else text[:397] + "..."


def _main(argv: list[str], own: bool = False) -> int:
    args = build_parser().parse_args(argv)
    checks.check_values(args)   # still no torch: a bad card or size is refused here
    if args.command == "record":
        args.argv = list(argv)
        return _record(args)
    progress = StreamProgress(sys.stderr) if args.command in ("fit", "serve") and not args.quiet else None
    try:
        if progress is not None and progress.tty:
            progress(0.0, "importing torch and transformers")
        if own and args.command != "env":   # a process that only answers: transformers without torchvision, torchao
            from gpulab.models.lean_imports import skip_unused
            skip_unused()
        with _collections_kept_short(own):
            data, text = _answer(args, progress, own)
    except (RuntimeError, TypeError) as exc:   # torch refusing a size (an overflowing shape): the input's doing
        if "overflow" in str(exc).lower() or "negative dimension" in str(exc):
            raise ValueError(f"a tensor of this size cannot be made ({_one_line(exc)}): use smaller "
                             "--batch, --image-size or --seq-len values") from exc
        raise
    finally:
        if progress is not None:
            progress.close()
    return _emit(json.dumps(data) if args.json else text(data))


@contextlib.contextmanager
def _collections_kept_short(own: bool):
    """While a process that only answers (``own``: ``python -m gpulab``) works, what the cycle collector
    has seen survive a full collection is not walked again (``gc.freeze`` after each): the objects the
    imports made (torch's, transformers'), then the timelines kept so far. A full collection, which
    ``measure.engines`` makes after each fake run that left a storage alive (some 0.2-0.3 s with torch
    loaded, more than a small run), then walks what was made since the last one, where a run's
    reference cycles are. When the answer is made, everything is handed back to the collector
    (``gc.unfreeze``), so a process that then ends the usual way (an error, a closed pipe: ``_ended``) ends
    as it would have. A library call (a notebook, a test) is left alone."""
    if not own:
        yield
        return

    def after(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()
    gc.callbacks.append(after)
    try:
        yield
    finally:
        gc.callbacks.remove(after)
        gc.unfreeze()


def _answer(args: argparse.Namespace, progress: StreamProgress | None,
            own: bool = False) -> tuple[dict[str, Any], Any]:
    """(the answer as data, its text view): the one place a command imports torch and transformers."""
    if args.command == "env":
        return env_info(), answers.env_text
    if args.command == "breakdown":
        from gpulab.predict.breakdown import breakdown
        return breakdown(args.model, args.batch or 1, args.image_size, args.dtype or "float32",
                         seq_len=args.seq_len).as_dict(), answers.breakdown_text
    if args.command == "step":
        from gpulab.predict.step import step   # gpulab.step
        return step(args.model, recipe=args.recipe, layout=args.layout, batch=args.batch, steps=args.steps,
                    engine=args.engine, seq_len=args.seq_len, image_size=args.image_size,
                    fake_target=args.fake_target, gpu=args.gpu,
                    time=args.time).as_dict(), answers.step_text
    if args.command == "serve":
        from gpulab.predict.serve import longest_context, serve
        kw = dict(dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype, block_size=args.block_size,
                  utilization=args.utilization, module_loading=args.cuda_module_loading, progress=progress,
                  predict_time=not args.no_time,
                  **({"context_bytes": checks.size(args.cuda_context, "--cuda-context")} if args.cuda_context else {}))
        if args.longest_context:   # each context tried is a serve answer: none of them timed
            kw["predict_time"] = False
            return longest_context(args.model, args.gpu, batch=args.batch, **kw).as_dict(), answers.longest_text
        if args.context is None:
            raise ValueError("serve needs --context TOKENS (tokens per sequence) or --longest-context")
        return serve(args.model, args.gpu, context_len=args.context, batch=args.batch, **kw).as_dict(), answers.serve_text
    if own:   # the imports' objects live as long as the process: out of the collector's walks now
        gc.freeze()
    context = {"context_bytes": checks.size(args.context)} if args.context else {}
    if args.fastest and args.gpus:   # recipes × layouts of N GPUs (predict.fastest_plans), or layouts only
        from gpulab.predict.fastest import fastest_layouts
        from gpulab.predict.fastest_plans import fastest_plans
        search = fastest_plans if args.fastest == "plan" else fastest_layouts
        return search(args.model, args.gpu, args.gpus, recipe=args.recipe, seq_len=args.seq_len,
                      image_size=args.image_size, module_loading=args.cuda_module_loading,
                      progress=progress, **context, **checks.fastest_pins(args)).as_dict(), \
            answers.fastest_layouts_text
    from gpulab.predict.fit import fit
    data = fit(args.model, args.gpu, recipe=args.recipe, layout=args.layout, seq_len=args.seq_len,
               image_size=args.image_size, module_loading=args.cuda_module_loading, progress=progress,
               predict_time=not args.no_time, **context).as_dict()
    if args.fastest and args.no_time:
        raise ValueError("--fastest ranks plans by their predicted time: leave out --no-time")
    if args.what_fits or args.fastest:
        from gpulab.predict.what_fits import what_fits
        data["what_fits"] = what_fits(args.model, args.gpu, batch=args.what_fits or 1, optimizer=args.optimizer,
                                      dtype=args.dtype, amp=args.amp, seq_len=args.seq_len,
                                      image_size=args.image_size, module_loading=args.cuda_module_loading,
                                      progress=progress, predict_time=not args.no_time, **context,
                                      **checks.recipe_keywords(args)).as_dict()
    return data, answers.fit_text


def _emit(text: str) -> int:
    """Print the answer; a reader that closed the pipe early (``gpulab ... | head``) is not an
    error worth a traceback. As the Python docs advise, stdout is pointed at devnull so the
    interpreter's final flush does not fail again."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
