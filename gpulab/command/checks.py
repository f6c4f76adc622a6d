"""The command line's values checked together, before torch is imported: the ``Recipe`` and
``Layout`` the flags ask for (``options.settings_from``), the card, and the CUDA context's size on
it (``predict.context``'s assumption, which imports no torch). ``gpulab.cli`` parses, this module
refuses; a bad value costs a fraction of a second, not torch's import."""
from __future__ import annotations

import argparse
from typing import Any

from gpulab.options import Layout, Recipe, settings_from
from gpulab.predict.cards import card_with_room, check_fp8_card, parse_gpu
from gpulab.predict.context import context_assumption
from gpulab.units import format_bytes

__all__ = ["check_values", "fastest_pins", "recipe_keywords", "settings", "size"]


def recipe_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe flags as ``gpulab.fit``'s keywords (``what_fits`` takes them flat)."""
    return {"accumulate": args.accumulate, "clip_grad_norm": args.clip_grad_norm, "grad_scaler": args.grad_scaler,
            "set_to_none": not args.keep_grads, "optimizer_in_backward": args.optimizer_in_backward,
            "offload_activations": args.offload_activations, "chunked_loss": args.chunked_loss,
            "use_cache": False if args.no_kv_cache_in_training else None, "compile": args.compile,
            "implementation": args.optimizer_impl, "checkpointing": args.checkpointing, "lora": args.lora or (8 if args.qlora else 0),
            "lora_targets": args.lora_targets, "lora_dropout": args.lora_dropout,
            "quantize": "nf4" if args.qlora else args.quantize, "lora_dtype": args.lora_dtype,
            "double_quant": not args.no_double_quant, "quant_compute_dtype": args.quant_compute_dtype,
            "tp": args.tp, "sequence_parallel": args.sequence_parallel,
            "loss_parallel": args.loss_parallel, "routing": args.routing,
            "pp": args.pp, "microbatches": args.microbatches, "schedule": args.schedule,
            "virtual_stages": args.virtual_stages, "fp8": args.fp8, "cp": args.cp, "ep": args.ep}


def settings(args: argparse.Namespace) -> tuple[Recipe, Layout]:
    """The ``Recipe`` and ``Layout`` the flags ask for, built once and checked without torch
    (``options.settings_from``): ``step`` and ``fit`` get them whole."""
    flat = {**recipe_keywords(args), "optimizer": args.optimizer, "dtype": args.dtype, "amp": args.amp,
            "pp_stage": args.pp_stage, "gpus": getattr(args, "gpus", None), "strategy": getattr(args, "strategy", None),
            "offload_optimizer": getattr(args, "offload_optimizer", False),
            "dp_replicate": getattr(args, "dp_replicate", None), "dp_shard": getattr(args, "dp_shard", None),
            **{k: getattr(args, k, None) or d for k, d in (("param_dtype", None), ("reduce_dtype", None),
                                                           ("fp8_all_gather", False))}}
    return settings_from(None, None, flat)


def check_values(args: argparse.Namespace) -> None:
    """The values argparse's types cannot see together, checked before torch is imported: the
    card, and the CUDA context's size on it."""
    if args.command == "step" and args.gpu is not None:
        parse_gpu(args.gpu)
    if args.command == "fit" and args.pp_stage:
        raise ValueError("--pp-stage picks the stage gpulab step measures; gpulab fit answers every stage: leave it out")
    if args.command == "fit" and args.fastest and args.gpus:
        check_fastest_layouts(args)
    if args.command == "fit" and args.fastest == "layout" and not args.gpus:
        raise ValueError("--fastest layout ranks the layouts of N GPUs: give --gpus N (N >= 2), or --fastest alone "
                         "for the fastest recipe on one GPU")
    if args.command in ("step", "fit"):
        args.recipe, args.layout = settings(args)   # every option's value and combination, before torch loads
    if args.command in ("step", "fit") and args.gpu is not None:
        check_fp8_card(args.gpu, args.fp8)   # a T4 or an A100 has no float8 matmul
    if args.command not in ("fit", "serve"):
        return
    card = parse_gpu(args.gpu)
    flag, given = ("--context", args.context) if args.command == "fit" else ("--cuda-context", args.cuda_context)
    if given:
        nbytes = size(given, flag)
        if nbytes >= card.reported_total_bytes:
            raise ValueError(f"{flag} {given} is the whole of {card.name}'s {format_bytes(card.reported_total_bytes)} "
                             f"or more: the CUDA context takes part of the card, give a smaller size")
    elif args.command == "fit":   # a card smaller than the assumed context: said so, with --context to replace it
        card_with_room(card, context_assumption(args.cuda_module_loading).nbytes, assumed=True)
    if args.command == "serve" and args.longest_context and args.context is not None:
        raise ValueError(f"--longest-context finds the context itself; --context {args.context} would be ignored: "
                         f"give one of them (--context N for an answer at N tokens)")


def size(text: str, flag: str = "--context") -> int:
    """A size such as 512MiB (the same forms as --gpu's sizes), for ``flag``."""
    try:
        return parse_gpu(text).memory_bytes
    except ValueError as exc:
        raise ValueError(str(exc).replace("--gpu", flag, 1)) from None


def fastest_pins(args: argparse.Namespace) -> dict[str, Any]:
    """``--fastest --gpus N``: the degrees the flags fix (set away from their defaults); the rest are tried."""
    pins = {k: getattr(args, k) for k in ("tp", "pp", "ep", "cp") if getattr(args, k) != 1}
    return {**pins, **({"strategy": args.strategy} if args.strategy else {})}


def check_fastest_layouts(args: argparse.Namespace) -> None:
    """``--fastest --gpus N`` tries the mesh itself: what would fix it another way is refused in one line."""
    if args.gpus < 2:
        raise ValueError("--fastest with --gpus ranks layouts of 2 or more GPUs: give --gpus N with N >= 2, or leave "
                         "--gpus out for the fastest recipe on one GPU")
    if args.what_fits:
        raise ValueError("--fastest --gpus N ranks the layouts of N GPUs times the recipes, --what-fits ranks "
                         "recipes on the asked layout at one batch: give one of them")
    if args.no_time:
        raise ValueError("--fastest ranks plans by their predicted time: leave out --no-time")
    if args.cp != 1:
        raise ValueError("--fastest does not rank context-parallel layouts: the rank's run has ring attention's "
                         "sequence shard without its K/V exchange, so its time would be too small; leave out --cp")
    given = [f for f, on in (("--dp-replicate", args.dp_replicate), ("--dp-shard", args.dp_shard),
                             ("--offload-optimizer", args.offload_optimizer), ("--microbatches", args.microbatches),
                             ("--virtual-stages", args.virtual_stages != 1),
                             ("--schedule", args.schedule != "1f1b")) if on]
    if given:
        raise ValueError(f"--fastest --gpus N lays out the mesh itself (1F1B, 4 micro-batches a stage): leave out "
                         f"{', '.join(given)}")
    for flag, n in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep)):
        if args.gpus % n:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of {flag} {n}: the layouts of N GPUs keep "
                             f"N = dp × tp × pp (× cp); give --gpus as a multiple of {n}")
