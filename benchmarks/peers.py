"""The same settings through gpulab and its peers: accelerate's ``estimate-memory``, DeepSpeed's ZeRO
estimators, ``llm-analysis``, megatron-core's theoretical memory and megatron-bridge's
``estimate_training_memory``; each one's figure, its ratio to gpulab's, what it counts, and its time.

    pip install accelerate deepspeed llm-analysis fire     # the peers (not gpulab's dependencies)
    pip install --no-deps megatron-core==0.19.2 megatron-bridge==0.6.2   # Python >= 3.12 (see below)
    python benchmarks/peers.py

A peer that is not installed is reported as such. The peers are called through their Python
functions (the ones their commands print from), on models built from gpulab's built-in configs on
the meta device where a peer takes a model: nothing is downloaded. A benchmark, not a test:
it prints, it asserts nothing.

Megatron's two estimators are pure formulas over a config's fields, but their packages do not
import on the CPU as a whole: ``megatron.training``'s ``__init__`` imports its trainer (and through
it ``typing.override``, Python 3.12; megatron-core 0.19.2 and megatron-bridge 0.6.2 require Python
3.12), and the bridge's ``ConfigContainer`` imports its datasets, models and trainer. So each
estimator's own source file is executed as it is installed (``megatron_module``), its package's
``__init__`` left out, with the few names it imports and its formulas never call (a config class
used as an annotation, ``print_rank_0``) stood in by objects that raise if called; the config is a
namespace holding the fields the formulas read. Where a Megatron figure and gpulab's differ, the
row names the terms (``megatron_terms``): bytes per parameter, what is split by tensor
parallelism, and what PyTorch's tensor parallelism saves whole that Megatron's formula counts
split.
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
from typing import Callable

GiB = 2 ** 30


def _timed(fn: Callable[[], tuple[float | None, str]]) -> tuple[float | None, str, float]:
    """(bytes, what they count, seconds); a peer's own printing and logging are kept out of the table."""
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logging.disable(logging.INFO)
            try:
                value, counts = fn()
            finally:
                logging.disable(logging.NOTSET)
    except ImportError as exc:
        return None, f"not installed ({exc.name}): see this file's docstring for the peers' installs", 0.0
    return value, counts, time.perf_counter() - t0


def _meta_model(name: str):
    import torch

    from gpulab.models import hf_configs
    with torch.device("meta"):
        return hf_configs.build_causal_lm(hf_configs.make_config(name))


# --- Megatron's estimators: their own source files, their packages' __init__ left out ----------------

def _never_called(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{name} stands in for a name the estimator imports; its formulas do not call it")
    return stand_in


def megatron_module(which: str):
    """The installed source file of Megatron's estimator ``which`` ("core": megatron-core's
    ``megatron/training/theoretical_memory_usage.py``; "bridge": megatron-bridge's
    ``megatron/bridge/training/utils/theoretical_memory_utils.py``), executed as a module. Raises
    ImportError (name: the distribution) where it is not installed."""
    import importlib.util
    import sys
    import types
    from importlib import metadata
    from unittest import mock

    dist, rel, name = {
        "core": ("megatron-core", "megatron/training/theoretical_memory_usage.py",
                 "megatron.training.theoretical_memory_usage"),
        "bridge": ("megatron-bridge", "megatron/bridge/training/utils/theoretical_memory_utils.py",
                   "megatron.bridge.training.utils.theoretical_memory_utils"),
    }[which]
    try:
        root = metadata.distribution(dist).locate_file("")
    except metadata.PackageNotFoundError as exc:
        raise ImportError(f"{dist} is not installed", name=dist) from exc
    path = root / rel
    # megatron.training without its __init__ (which imports the trainer): its directory as the package
    training = types.ModuleType("megatron.training")
    training.__path__ = [str(root / "megatron" / "training")]
    utils = types.ModuleType("megatron.training.utils")
    utils.print_rank_0 = _never_called("megatron.training.utils.print_rank_0")
    utils.is_hybrid_model = _never_called("megatron.training.utils.is_hybrid_model")
    config = types.ModuleType("megatron.bridge.training.config")
    config.ConfigContainer = types.SimpleNamespace   # only an annotation of estimate_training_memory
    shims = {"megatron.training": training, "megatron.training.utils": utils,
             "megatron.bridge.training.config": config}
    with mock.patch.dict(sys.modules, shims):
        if which == "bridge":   # megatron.bridge.utils.vocab_utils re-exports megatron.training.vocab_utils
            spec = importlib.util.spec_from_file_location("megatron.training.vocab_utils",
                                                          root / "megatron" / "training" / "vocab_utils.py")
            vocab = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(vocab)
            sys.modules["megatron.bridge.utils.vocab_utils"] = vocab
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def megatron_model(name: str) -> dict:
    """The fields Megatron's formulas read, from gpulab's built-in config ``name`` (GPT-2: LayerNorm, GELU
    MLP, tied embeddings; Llama: RMSNorm, SwiGLU)."""
    from gpulab.models import hf_configs
    c = hf_configs.make_config(name)
    heads = c.num_attention_heads
    groups = getattr(c, "num_key_value_heads", None) or heads
    swiglu = getattr(c, "hidden_act", None) == "silu"
    return dict(hidden_size=c.hidden_size, num_attention_heads=heads, num_query_groups=groups,
                kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
                num_layers=c.num_hidden_layers,
                ffn_hidden_size=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
                vocab_size=c.vocab_size, tied=bool(getattr(c, "tie_word_embeddings", False)), swiglu=swiglu,
                rmsnorm=c.model_type != "gpt2", bias=c.model_type == "gpt2")


def megatron_core_memory(name: str, *, seq: int, micro_batch: int, tp: int = 1, pp: int = 1, dp: int = 1,
                         microbatches: int | None = None, sequence_parallel: bool = False,
                         distributed_optimizer: bool = False) -> dict:
    """megatron-core's theoretical memory (bytes): ``compute_weight_and_optimizer_memory`` and the
    activation formula ``report_theoretical_memory`` picks (``compute_activation_memory`` with sequence
    parallelism and selective recompute, ``compute_activation_memory_without_sp`` otherwise)."""
    import types
    mod = megatron_module("core")
    m = megatron_model(name)
    padded = mod.math.ceil(m["vocab_size"] / (128 * tp)) * 128 * tp   # Megatron's make_vocab_size_divisible_by 128
    args = types.SimpleNamespace(
        hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"], kv_channels=m["kv_channels"],
        group_query_attention=m["num_query_groups"] != m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        num_layers=m["num_layers"], ffn_hidden_size=m["ffn_hidden_size"], padded_vocab_size=padded,
        untie_embeddings_and_output_weights=not m["tied"], swiglu=m["swiglu"],
        normalization="RMSNorm" if m["rmsnorm"] else "LayerNorm", add_bias_linear=m["bias"],
        num_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None, moe_router_topk=2, moe_latent_size=None,
        moe_shared_expert_intermediate_size=None, mtp_num_layers=None, multi_latent_attention=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
        expert_tensor_parallel_size=1, expert_model_parallel_size=1, world_size=tp * pp * dp,
        virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=distributed_optimizer,
        seq_length=seq, micro_batch_size=micro_batch, sequence_parallel=sequence_parallel,
        recompute_granularity="selective")
    weights = mod.compute_weight_and_optimizer_memory(args)
    if sequence_parallel:
        act = mod.compute_activation_memory(args, num_microbatches=microbatches)
    else:
        act = mod.compute_activation_memory_without_sp(args, num_microbatches=microbatches)
    return {"weights and optimizer": weights, "activations": act}


def megatron_bridge_memory(name: str, *, seq: int, micro_batch: int, tp: int = 1, pp: int = 1, dp: int = 1,
                           microbatches: int | None = None, distributed_optimizer: bool = False) -> dict:
    """megatron-bridge's ``estimate_training_memory`` (bytes): model state and activations (its formula
    assumes sequence parallelism and selective recompute, as its assumptions say)."""
    import types

    import torch.nn.functional as F
    mod = megatron_module("bridge")
    m = megatron_model(name)
    model = types.SimpleNamespace(
        hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"], kv_channels=m["kv_channels"],
        num_query_groups=m["num_query_groups"], num_layers=m["num_layers"], ffn_hidden_size=m["ffn_hidden_size"],
        vocab_size=m["vocab_size"], make_vocab_size_divisible_by=128, should_pad_vocab=True,
        share_embeddings_and_output_weights=m["tied"], gated_linear_unit=m["swiglu"],
        activation_func=F.silu if m["swiglu"] else F.gelu, seq_length=seq, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_moe_experts=None)
    config = types.SimpleNamespace(model=model, train=types.SimpleNamespace(micro_batch_size=micro_batch),
                                   optimizer=types.SimpleNamespace(use_distributed_optimizer=distributed_optimizer),
                                   data_parallel_size=dp)
    e = mod.estimate_training_memory(config, num_microbatches=microbatches)
    return {"weights and optimizer": e.weight_and_optimizer_bytes, "activations": e.activation.memory_bytes,
            "assumptions": e.assumptions}


def _parts(d: dict) -> str:
    return ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in d.items() if isinstance(v, (int, float)))


# --- setting 1: GPT-2, full training ----------------------------------------------------------------

def gpt2_training():
    batch, seq = 8, 1024

    def gpulab_():
        import gpulab
        from gpulab.predict.replay import replay_events, tracked_events
        r = gpulab.step("hf:gpt2", batch=batch, seq_len=seq, optimizer="adamw", amp="bf16", engine="fake",
                        use_cache=False)
        reserved = max(replay_events(tracked_events(r.measurement)).reserved)
        return reserved, (f"a fake run of two steps: weights, gradients, AdamW state, activations, temporaries "
                          f"(live peak {r.peak_bytes / GiB:.2f} GiB), replayed through the simulated allocator "
                          f"(reserved); the CUDA context apart")

    def accelerate_():
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
        total, _ = calculate_maximum_sizes(_meta_model("gpt2"))
        sizes = estimate_training_usage(total, "bfloat16")
        return max(sizes.values()), ("the largest of model / gradients / optimizer / step for mixed precision, "
                                     "from the parameters' bytes: no activations, no batch")

    def deepspeed_():
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        params = sum(p.numel() for p in _meta_model("gpt2").parameters())
        _, gpu = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=False)
        return gpu, "ZeRO-2 model states on 1 GPU (2 + 18 bytes per parameter at N = 1): no activations"

    def llm_analysis_():
        from llm_analysis.analysis import train
        s = train(model_name="gpt2", gpu_name="a100-sxm-80gb", dtype_name="w16a16e16", batch_size_per_gpu=batch,
                  seq_len=seq, total_num_gpus=1, flops_efficiency=0.5, hbm_memory_efficiency=0.9)
        return s["(weight+op_state+grad+act)_memory_per_gpu"], ("16-bit weights, gradients and fp32 optimizer "
                                                              "state, activations by Korthikanti's formulas "
                                                              "(no scores kept: flash attention)")

    def megatron_core_():
        est = megatron_core_memory("gpt2", seq=seq, micro_batch=batch)
        return sum(est.values()), (f"compute_weight_and_optimizer_memory + compute_activation_memory_without_sp: "
                                   f"{_parts(est)}; 18 B/parameter, activations by Korthikanti's formula "
                                   f"(selective recompute: no scores) + 5%")

    def megatron_bridge_():
        est = megatron_bridge_memory("gpt2", seq=seq, micro_batch=batch)
        return est["weights and optimizer"] + est["activations"], (
            f"estimate_training_memory: {_parts(est)}; 18 B/parameter, activations by Korthikanti's formula")

    return (f"GPT-2 124M, full training, bf16 autocast, AdamW, batch {batch} x {seq}, one GPU",
            [("gpulab", gpulab_), ("accelerate estimate-memory", accelerate_), ("DeepSpeed estimator", deepspeed_),
             ("llm-analysis", llm_analysis_), ("megatron-core theoretical", megatron_core_),
             ("megatron-bridge estimate", megatron_bridge_)])


# --- setting 2: Llama 2 7B, generation ---------------------------------------------------------------

def llama_inference():
    prompt, new = 4000, 96

    def gpulab_():
        from gpulab.predict.generation import generation_peak
        g = generation_peak("llama-2-7b", prompt_len=prompt, new_tokens=new)
        return g.peak_bytes, (f"a fake generate(): the peak of the prefill and of the last decode step "
                              f"(at the {g.peak_at}): weights, KV cache, the forward's tensors")

    def accelerate_():
        from accelerate.utils import calculate_maximum_sizes
        total, _ = calculate_maximum_sizes(_meta_model("llama-2-7b"))
        return total / 2, "the weights in bf16 (its inference figure): no KV cache, no activations"

    def llm_analysis_():
        from llm_analysis.analysis import infer
        s = infer(model_name="NousResearch_Llama-2-7b-hf", gpu_name="a100-sxm-80gb", dtype_name="w16a16e16",
                  batch_size_per_gpu=1, seq_len=prompt, num_tokens_to_generate=new, flops_efficiency=0.5,
                  hbm_memory_efficiency=0.9)
        value = s["weight_memory_per_gpu"] + s["kv_cache_memory_per_gpu"] + max(
            s["prefill_activation_memory_per_gpu"], s["decode_activation_memory_per_gpu"])
        return value, "weights + KV cache + the larger of the prefill's and a decode step's activations (formulas)"

    return (f"Llama 2 7B, generation, bf16, batch 1, a {prompt}-token prompt and {new} new tokens",
            [("gpulab", gpulab_), ("accelerate estimate-memory", accelerate_), ("llm-analysis", llm_analysis_)])


# --- setting 3: Llama 2 7B, full fine-tuning over 8 GPUs with ZeRO-3 ----------------------------------

def llama_zero3():
    gpus, seq = 8, 2048
    answer: dict[str, int] = {}

    def gpulab_():
        from gpulab.predict.fit import fit
        r = fit("hf:llama-2-7b", "H100", optimizer="adamw", dtype="bf16", seq_len=seq, gpus=gpus, strategy="zero3")
        answer["batch"] = max(1, r.largest_batch)
        return r.needed_bytes, (f"fit --gpus {gpus} --strategy zero3: largest batch per GPU {r.largest_batch}; one "
                                f"rank's timeline at it (DeepSpeed's bytes, gathered largest layer) through the "
                                f"simulated allocator, + {r.context_bytes / GiB:.1f} GiB assumed CUDA context")

    def deepspeed_():
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        model = _meta_model("llama-2-7b")
        # DeepSpeed's model_to_params, except that it tells shared parameters apart by data_ptr(),
        # which is 0 for every tensor on the meta device: by identity here
        total = sum({id(p): p.numel() for p in model.parameters()}.values())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus, 1, cpu_offload=False)
        return gpu, "ZeRO-3 model states on one of 8 GPUs (4·largest layer + 18Ψ/N): no activations"

    def llm_analysis_():
        from llm_analysis.analysis import train
        b = answer.get("batch", 1)
        s = train(model_name="NousResearch_Llama-2-7b-hf", gpu_name="a100-sxm-80gb", dtype_name="w16a16e16",
                  batch_size_per_gpu=b, seq_len=seq, total_num_gpus=gpus, ds_zero=3, flops_efficiency=0.5,
                  hbm_memory_efficiency=0.9)
        return s["(weight+op_state+grad+act)_memory_per_gpu"], (f"ZeRO-3 per GPU at batch {b} (gpulab's answer): "
                                                              "weights, gradients, optimizer state, activations "
                                                              "(formulas)")

    zero_term = ("Megatron's nearest layout, data parallel 8 with its distributed optimizer, shards only the fp32 "
                 "main weights and Adam moments (12 B/parameter over 8) and keeps the bf16 weights and fp32 main "
                 "gradients whole (6 B/parameter): the term by which it exceeds ZeRO-3, which shards all four")

    def megatron_core_():
        b = answer.get("batch", 1)
        est = megatron_core_memory("llama-2-7b", seq=seq, micro_batch=b, dp=gpus, distributed_optimizer=True)
        return sum(est.values()), f"at batch {b}: {_parts(est)}; {zero_term}"

    def megatron_bridge_():
        b = answer.get("batch", 1)
        est = megatron_bridge_memory("llama-2-7b", seq=seq, micro_batch=b, dp=gpus, distributed_optimizer=True)
        return est["weights and optimizer"] + est["activations"], f"at batch {b}: {_parts(est)}; {zero_term}"

    return (f"Llama 2 7B, full fine-tuning, bf16 AdamW, {seq} tokens, {gpus} GPUs with DeepSpeed ZeRO-3, one GPU's",
            [("gpulab", gpulab_), ("DeepSpeed estimator", deepspeed_), ("llm-analysis", llm_analysis_),
             ("megatron-core theoretical", megatron_core_), ("megatron-bridge estimate", megatron_bridge_)])


# --- setting 4: Llama 2 7B, one rank of a Megatron layout: TP 2 x PP 2 with sequence parallelism -------

def megatron_terms(name: str, *, seq: int, micro_batch: int, tp: int, pp: int,
                   microbatches: int) -> list[tuple[str, float]]:
    """The terms by which the activations of one rank of stage 0 differ between gpulab's run (PyTorch's tensor
    parallelism on transformers' model) and Megatron's formula, each with its size in bytes (gpulab's minus
    Megatron's), from the model's shape: what remains of the difference is printed as the rest."""
    m = megatron_model(name)
    h, ffn, v = m["hidden_size"], m["ffn_hidden_size"], m["vocab_size"]
    inflight = m["num_layers"] // pp * min(microbatches, pp)   # stage 0's layers x micro-batches in flight (1F1B)
    tokens = seq * micro_batch
    terms = []
    if tp > 1:
        terms.append(("each block's gathered input saved whole: PyTorch's PrepareModuleInput all-gathers the "
                      "attention's and the MLP's input (Shard(1) to Replicate()) and the colwise linears save "
                      "that output; Megatron's LinearWithGradAccumulationAndAsyncCommunication saves the "
                      "sequence shard and gathers again in backward: 2 x tokens x hidden x 2 B x (1 - 1/tp) a layer",
                      inflight * 2 * tokens * h * 2 * (1 - 1 / tp)))
    if m["swiglu"]:
        terms.append(("SwiGLU keeps four ffn-wide bf16 tensors (gate, silu(gate), up, their product: transformers' "
                      "LlamaMLP), the formula's 4 x ffn/h counts two (GELU's fc1 output and its activation)",
                      inflight * tokens * ffn * 2 * 2 / tp))
    return terms


def llama_megatron_layout():
    name, tp, pp, microbatches, seq, micro = "llama-2-7b", 2, 2, 4, 4096, 1
    answer: dict[str, float] = {}

    def gpulab_():
        import gpulab
        r = gpulab.step(f"hf:{name}", batch=micro, seq_len=seq, optimizer="adamw", dtype="bf16", engine="fake",
                        use_cache=False, tp=tp, sequence_parallel=True, pp=pp, microbatches=microbatches)
        c = r.peak_by_category
        answer["weights and optimizer"] = sum(c.get(k, 0) for k in ("parameters", "buffers", "gradients",
                                                                   "optimizer_state"))
        answer["activations"] = sum(c.get(k, 0) for k in ("activations", "temporaries", "inputs"))
        answer["params"] = c.get("parameters", 0) / 2   # bf16 weights: 2 bytes each
        return r.peak_bytes, (f"a fake run of stage 0, rank 0 (PyTorch's TP+SP on transformers' model, the 1F1B "
                              f"schedule): {_parts({k: answer[k] for k in ('weights and optimizer', 'activations')})}; "
                              f"bf16 weights and AdamW moments, gradients freed at the peak (set_to_none)")

    def _megatron(fn, label):
        def run():
            est = fn(name, seq=seq, micro_batch=micro, tp=tp, pp=pp, microbatches=microbatches,
                     **({"sequence_parallel": True} if fn is megatron_core_memory else {}))
            total = est["weights and optimizer"] + est["activations"]
            params = est["weights and optimizer"] / 18
            text = (f"{label}: {_parts(est)}; 18 B/parameter (bf16 weight, fp32 main gradient, fp32 main weight, "
                    f"fp32 Adam moments), activations by Korthikanti's table 2 (SP, selective recompute)")
            if answer:
                p_g = answer["params"]
                b_g = answer["weights and optimizer"] / p_g
                terms = [(f"bytes per parameter: Megatron 18, gpulab's run {b_g:.1f} (bf16 weights and AdamW "
                          f"moments, gradients freed at the peak by set_to_none), on Megatron's {params / 1e9:.3f} G "
                          f"parameters", params * (b_g - 18)),
                         (f"parameters on the rank: gpulab's stage 0 as measured {p_g / 1e9:.3f} G, Megatron's "
                          f"most-loaded shard {params / 1e9:.3f} G, at gpulab's {b_g:.1f} B", (p_g - params) * b_g)]
                terms += megatron_terms(name, seq=seq, micro_batch=micro, tp=tp, pp=pp, microbatches=microbatches)
                dw = answer["weights and optimizer"] - est["weights and optimizer"]
                da = answer["activations"] - est["activations"]
                weight_terms = ("bytes per", "parameters on")
                named_w = sum(b for t, b in terms if t.startswith(weight_terms))
                named_a = sum(b for t, b in terms if not t.startswith(weight_terms))
                text += (f"\n{'':49}gpulab - Megatron: weights and optimizer {dw / GiB:+.2f} GiB, activations "
                         f"{da / GiB:+.2f} GiB; the terms:")
                for t, b in terms:
                    text += f"\n{'':51}{b / GiB:+6.2f} GiB  {t}"
                text += (f"\n{'':51}{(da - named_a) / GiB:+6.2f} GiB  the rest of the activations' (RMSNorm's fp32 "
                         f"internals, RoPE, attention's saved outputs; Megatron's formula counts dropout masks that "
                         f"Llama has not)")
            return total, text
        return run

    return (f"Llama 2 7B, Megatron layout TP {tp} x PP {pp} with sequence parallelism, 1F1B over {microbatches} "
            f"micro-batches of {micro} x {seq}, bf16, AdamW: stage 0's rank, no data parallelism",
            [("gpulab", gpulab_),
             ("megatron-core theoretical", _megatron(megatron_core_memory, "compute_weight_and_optimizer_memory + "
                                                                          "compute_activation_memory")),
             ("megatron-bridge estimate", _megatron(megatron_bridge_memory, "estimate_training_memory"))])


SETTINGS = {"gpt2": gpt2_training, "llama-inference": llama_inference, "llama-zero3": llama_zero3,
            "llama-megatron": llama_megatron_layout}


def results(settings=None) -> list[dict]:
    """Every peer's figure for each setting (all of SETTINGS, or the keys given) as data: the setting, the
    peer, its bytes (None where it is not installed), the ratio to gpulab's figure, what it counts, its seconds."""
    out = []
    for key in settings or SETTINGS:
        title, tools = SETTINGS[key]()
        ours = None
        for name, fn in tools:
            value, counts, seconds = _timed(fn)
            if name == "gpulab":
                ours = value
            ratio = None if value is None or not ours else value / ours
            out.append({"setting": key, "title": title, "peer": name, "bytes": value, "ratio_to_gpulab": ratio,
                        "counts": counts, "seconds": seconds})
    return out


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setting", nargs="+", choices=list(SETTINGS), help="only these settings")
    args = p.parse_args(argv)
    title = None
    for r in results(args.setting):
        if r["title"] != title:
            title = r["title"]
            print(f"\n== {title}\n   {'':<28} {'per GPU':>12} {'/ gpulab':>9}")
        shown = "—" if r["bytes"] is None else f"{r['bytes'] / GiB:8.2f} GiB"
        ratio = "" if r["ratio_to_gpulab"] is None else f"{r['ratio_to_gpulab']:.2f}"
        print(f"   {r['peer']:<28} {shown:>12} {ratio:>9}  {r['seconds']:6.1f} s   {r['counts']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
