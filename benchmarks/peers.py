"""The same settings through gpulab and its peers: accelerate's ``estimate-memory``, DeepSpeed's ZeRO
estimators and ``llm-analysis``; each one's figure, what it counts, and its time.

    pip install accelerate deepspeed llm-analysis fire     # the peers (not gpulab's dependencies)
    python benchmarks/peers.py

A peer that is not installed is reported as such. The peers are called through their Python
functions (the ones their commands print from), on models built from gpulab's built-in configs on
the meta device where a peer takes a model: nothing is downloaded. A benchmark, not a test:
it prints, it asserts nothing.
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
        return None, f"not installed ({exc.name}): pip install accelerate deepspeed llm-analysis fire", 0.0
    return value, counts, time.perf_counter() - t0


def _meta_model(name: str):
    import torch

    from gpulab.models import hf_configs
    with torch.device("meta"):
        return hf_configs.build_causal_lm(hf_configs.make_config(name))


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

    return (f"GPT-2 124M, full training, bf16 autocast, AdamW, batch {batch} x {seq}, one GPU",
            [("gpulab", gpulab_), ("accelerate estimate-memory", accelerate_), ("DeepSpeed estimator", deepspeed_),
             ("llm-analysis", llm_analysis_)])


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

    return (f"Llama 2 7B, full fine-tuning, bf16 AdamW, {seq} tokens, {gpus} GPUs with DeepSpeed ZeRO-3, one GPU's",
            [("gpulab", gpulab_), ("DeepSpeed estimator", deepspeed_), ("llm-analysis", llm_analysis_)])


def main() -> int:
    for title, tools in (gpt2_training(), llama_inference(), llama_zero3()):
        print(f"\n== {title}")
        for name, fn in tools:
            value, counts, seconds = _timed(fn)
            shown = "—" if value is None else f"{value / GiB:8.2f} GiB"
            print(f"   {name:<28} {shown:>12}  {seconds:6.1f} s   {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
