"""Published real-GPU memory figures, quoted with their sources, and gpulab's prediction of each.

Each ``Row`` quotes a figure somebody measured on a GPU and published (``Source``: who, where, the
GPU, what was measured and how, and the tolerance that follows from what the figure holds that
gpulab does not compute), with the setting as the source states it and the recipe gpulab predicts
it with: a fake-engine run following CUDA's kernels (training through ``gpulab.step`` with the
recipe's options, generation through ``predict.generation``), replayed through the caching-allocator
simulator where the published figure includes the allocator's cache. The figures are quotes
(labelled *published by <source>, measured on <GPU>*); every prediction is computed when asked.

``published_check(name)`` runs one row's prediction and returns it beside the quote (a lesson shows
it); ``benchmarks/published.py`` prints the whole table. Sources are independent of each other and
of gpulab: Hugging Face's documentation, Lightning AI's LitGPT, Alibaba's Qwen team, and PyTorch
(torchao and PyTorch's tutorials). Nothing here ran on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gpulab.tables import html_table

__all__ = ["ROWS", "SOURCES", "PublishedCheck", "Row", "Source", "published_check", "published_label"]

MiB, GiB, GB = 2 ** 20, 2 ** 30, 10 ** 9


@dataclass(frozen=True)
class Source:
    key: str
    org: str            # who published it
    title: str
    where: str          # URL, and the file read (repository, path, commit)
    gpu: str
    metric: str         # what the figure is, as the source measures it
    unit: int           # bytes per unit of the published number
    unit_name: str
    tolerance: tuple[float, float]   # accepted gpulab / published
    why: str            # what the figure holds beyond gpulab's prediction, which sets the tolerance


@dataclass(frozen=True)
class Row:
    source: str
    name: str
    quote: str          # the source's own text holding the figure
    published: float    # in the source's unit
    setting: str        # the setting, as the source states it (and how gpulab runs it)
    predict: Callable[[], tuple[int, str]]   # (bytes, how they were computed)


SOURCES = {s.key: s for s in (
    Source("hf-trainer", "Hugging Face", "Hugging Face transformers documentation, 'Efficient Training on a Single GPU' (2022)",
           "https://huggingface.co/docs/transformers/v4.21.0/en/perf_train_gpu_one ; huggingface/transformers "
           "docs/source/en/perf_train_gpu_one.mdx @ 0016acf7ef421c7fe8eff7945de52c71896c3b01",
           "Tesla V100-SXM2 16 GB (the page's nvidia-smi: driver 460.91.03, CUDA 11.2)",
           "NVML's used memory after trainer.train(): print(f\"GPU memory occupied: {info.used//1024**2} MB.\") "
           "(so MiB), with nvmlDeviceGetMemoryInfo",
           MiB, "MiB", (0.95, 1.05),
           "NVML counts the whole process: the CUDA context and kernels (measured on the same page: 'GPU memory "
           "occupied: 1343 MB.' after torch.ones((1, 1)).to(\"cuda\"), added to gpulab's figure), the caching "
           "allocator's reserved memory (never released during training: gpulab's simulated peak reserved), and "
           "library modules loaded after that first tensor (cuBLAS at the first GEMM), which gpulab does not "
           "know. The 2022 run used torch ~1.10, whose softmax saved its input as well as its output for "
           "backward (fixed in 1.11 by pytorch#65242): one fp32 (heads, 512, 512) tensor per layer per sample "
           "that today's torch does not keep, added as a formula term and shown apart."),
    Source("litgpt", "Lightning AI", "Lightning AI, LitGPT tutorials/resource-tables.md (2023-10-20, LitGPT commit 8641822)",
           "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md ; finetune/lora.py and "
           "generate/base.py @ 8641822b3249bb94f068c254aa5d13decbc9f0a0",
           "NVIDIA A100-SXM4-40GB, PyTorch 2.1.0+cu121",
           "torch.cuda.max_memory_allocated() / 1e9, printed once at the end of the script: "
           "fabric.print(f\"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB\")",
           GB, "GB", (0.95, 1.05),
           "max_memory_allocated holds the tensors and the cuBLAS workspace (allocated through the caching "
           "allocator), not the context. LitGPT's own model differs from transformers' in details gpulab runs "
           "the transformers model for: one fused QKV layer with a single LoRA dropout for q and v (peft puts "
           "one on each adapted layer: gpulab's figure holds one (batch, seq, 4096) bf16 input and its mask "
           "per layer more), a float32 RoPE cache, and PyTorch 2.1's SDPA kernel choice on an A100."),
    Source("qwen", "Alibaba (Qwen)", "Qwen team (Alibaba), 'Qwen2.5 Speed Benchmark'",
           "https://qwen.readthedocs.io/en/latest/benchmark/speed_benchmark.html ; QwenLM/Qwen2.5 "
           "docs/source/benchmark/speed_benchmark.rst @ 0f0ecfba609c08a3cdbb3a589bf74e36255ebd75, script "
           "examples/speed-benchmark/speed_benchmark_transformers.py",
           "NVIDIA A100 80GB, CUDA 12.1, torch 2.3.1, flash_attn 2.5.8, transformers 4.46.0",
           "the sum of torch.cuda.max_memory_allocated(i) / 1024 / 1024 / 1024 over one generate() call "
           "(the table's 'GPU Memory(GB)': GiB)",
           GiB, "GiB", (0.95, 1.05),
           "max_memory_allocated: weights, KV cache and the forward's tensors, plus the cuBLAS workspace and "
           "FlashAttention-2's own buffers (gpulab's fake run takes PyTorch's SDPA path, not flash_attn)."),
    Source("torchao", "PyTorch", "PyTorch torchao, low-bit optimizers README (torchao/optim/README.md)",
           "https://github.com/pytorch/ao/blob/main/torchao/optim/README.md ; @ "
           "072500abcfbdec15a429eb53160c63fb92534b85, benchmarks/benchmark_low_bit_adam.py",
           "RTX 4070 Ti SUPER (16 GB), PyTorch 2.4",
           "torch.cuda.max_memory_allocated() / 1e9 over the run (training and validation)",
           GB, "GB", (0.93, 1.07),
           "max_memory_allocated over a compiled (inductor) run: gpulab compiles with AOTAutograd's partitioner "
           "and no code generation, so inductor's fused kernels' fewer temporaries, and its workspaces, are not "
           "in gpulab's figure; timm's ViT-H/14 (45 classes) is run as torchvision's vit_h_14 with 45 classes "
           "(the same layers: 32 blocks, 1280 wide, 16 heads, 224-pixel images, 257 tokens)."),
    Source("pt-tutorial", "PyTorch", "PyTorch tutorials, 'How to save memory by fusing the optimizer step into the backward "
           "pass' (Jane Xu)",
           "https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html ; pytorch/tutorials "
           "intermediate_source/optimizer_step_in_backward_tutorial.py @ 2a488705e00cc04c12e905e3d68d351c1834661e",
           "not stated",
           "allocated memory read off torch.cuda.memory._snapshot() plots, stated to the nearest GB ('~6GB')",
           GB, "GB", (0.9, 1.1),
           "the figures are read off a plot and rounded ('~'): half a GB either way; otherwise allocated memory "
           "of the same three steps of torchvision's vit_l_16 at batch 1, which gpulab runs as written."),
    Source("torchao-float8", "PyTorch", "PyTorch torchao, float8 training: e2e training benchmarks (NVIDIA H100)",
           "https://github.com/pytorch/ao/blob/main/docs/source/workflows/training.md#e2e-training-benchmarks ; "
           "pytorch/ao docs/source/workflows/training.md @ 36027d82d1ad9949597ea16002ff4940374b1b94 (first in "
           "torchao/float8/README.md @ 8c81863ba85cce742244c0151c6683c5696bbe04)",
           "8x NVIDIA H100 (torchtitan 0.0.2, torch 2.7.0a0+gitb98af95, torchao 0.10.0+git890e0ac8)",
           "torchtitan's logged peak memory of rank 0 (its DeviceMemoryMonitor's torch.cuda max_memory_reserved, "
           "logged as GiB; the table's header says GB)",
           GiB, "GiB", (0.9, 1.1),
           "what the figure holds beyond the tensors is the caching allocator's reserve, which gpulab simulates; "
           "the tolerance is what that replay carries. gpulab cannot run the setting as written, so both rows "
           "miss it, for reasons stated, not tuned away: torch.compile with Inductor (gpulab compiles without "
           "code generation, and not together with FSDP2 here, so these rows run eager), FSDP2's "
           "MixedPrecisionPolicy(param_dtype=bf16) that casts each unsharded layer and frees it after its "
           "forward (gpulab runs fp32 sharded weights under bf16 autocast, which casts each linear layer's weight to a "
           "bf16 copy that autograd saves for backward: 2 bytes per such parameter that torchtitan does not hold; "
           "torchao's Float8Linear casts only its input to the autocast dtype and saves the fp32 weight itself, "
           "so the FP8 row holds no such copies and misses by less), "
           "and per-op SAC as torchtitan's policy chooses (gpulab's op-level 'selective')."),
)}


# --- how gpulab predicts each kind of figure -------------------------------------------------------

def _train(model, *, batch: int, metric: str, extra: int = 0, extra_text: str = "", **kw) -> tuple[int, str]:
    """One fake training run (CUDA target) through gpulab.step, its timeline replayed through the
    allocator simulator: 'allocated' is the simulator's peak allocated (blocks rounded as PyTorch
    rounds them), 'reserved' its peak reserved."""
    from gpulab.predict.replay import replay_events, tracked_events
    from gpulab.predict.step import step
    r = step(model, batch=batch, engine="fake", **kw)
    sim = replay_events(tracked_events(r.measurement))
    value = max(sim.allocated) if metric == "allocated" else max(sim.reserved)
    how = f"simulated peak {metric} {value / GiB:.3f} GiB ({r.recipe or 'plain loop'})"
    if extra:
        how += f" + {extra_text} {extra / GiB:.3f} GiB"
    return value + extra, how


def _fsdp2_llama3_8b(fp8: str | None) -> tuple[int, str]:
    """torchao's float8 benchmark setting as gpulab runs it: Llama-3-8B, 8 H100s, FSDP2, batch 1, sequence
    8192, op-level selective checkpointing, AdamW, bf16 autocast on fp32 weights (see the source's ``why``)."""
    from gpulab.predict.fit import fit
    r = fit("hf:llama-3-8b", gpu="H100", gpus=8, strategy="fsdp2", dtype="fp32", amp="bf16", optimizer="adamw",
            seq_len=8192, checkpointing="selective", fp8=fp8)
    check = next(c for c in r.checks if c.batch == 1)
    return check.reserved_bytes, (f"simulated peak reserved of one of 8 FSDP2 ranks at batch 1, "
                                  f"{check.reserved_bytes / GiB:.2f} GiB ({fp8 or 'bf16'}; eager, not compiled)")


def _generate(name: str, prompt: int, new: int) -> tuple[int, str]:
    from gpulab.predict.generation import generation_peak
    g = generation_peak(name, prompt_len=prompt, new_tokens=new, dtype="bf16")
    return g.peak_bytes, (f"fake generation: peak at the {g.peak_at} {g.peak_bytes / GiB:.3f} GiB (weights "
                          f"{g.weights_bytes / GiB:.3f}, KV cache {g.cache_bytes / GiB:.3f})")


def _bert_large_classifier(checkpointing: bool):
    """BertForSequenceClassification(bert-large-uncased), attention as transformers 4.x ran it
    (eager: today's default, SDPA, saves no (heads, seq, seq) tensor), and the model's own
    gradient checkpointing when asked (the Trainer's gradient_checkpointing=True)."""
    def bert_large_seq_cls():
        from transformers import BertForSequenceClassification

        from gpulab.models import hf_configs
        from gpulab.models.adapt import enable_checkpointing
        config = hf_configs.make_config("bert-large-uncased")
        config._attn_implementation = "eager"
        model = BertForSequenceClassification(config)
        return enable_checkpointing(model) if checkpointing else model
    return bert_large_seq_cls


def _sentences(batch: int):
    """The page's data: 512 random token ids in [100, 30000) and a label 0 per sequence."""
    import torch
    return {"input_ids": torch.randint(100, 30000, (batch, 512)), "labels": torch.zeros(batch, dtype=torch.long)}


def _vit_h_45():
    """torchvision's ViT-H/14 with a 45-class head (resisc45's classes), as torchao fine-tunes timm's."""
    from torchvision.models import vit_h_14
    return vit_h_14(num_classes=45)


HF_CONTEXT = 1343 * MiB      # 'GPU memory occupied: 1343 MB.' after the first tensor, on the same page
BERT_LARGE = {"layers": 24, "heads": 16, "seq": 512}


def _softmax_input_torch_110(batch: int, layers: int) -> int:
    """What torch 1.10's softmax also kept for backward (its fp32 input) over ``layers`` layers."""
    return layers * batch * BERT_LARGE["heads"] * BERT_LARGE["seq"] ** 2 * 4


def _hf_row(name: str, text: str, published: int, *, batch: int, accumulate: int = 1, checkpointing: bool = False,
            optimizer: str = "adamw", fp16: bool = False) -> Row:
    # transformers' Trainer of 2022: its own AdamW (a loop over parameters: for-loop), clipping at
    # max_grad_norm=1.0, model.zero_grad() (set_to_none=False in torch 1.10), torch.cuda.amp for fp16
    def predict() -> tuple[int, str]:
        held = 1 if checkpointing else BERT_LARGE["layers"]   # checkpointed: only the layer being recomputed
        extra = _softmax_input_torch_110(batch, held)
        value, how = _train(_bert_large_classifier(checkpointing), inputs=_sentences, batch=batch, metric="reserved",
                            optimizer=optimizer, accumulate=accumulate, clip_grad_norm=1.0, set_to_none=False,
                            implementation="for-loop" if optimizer in ("adamw", "adafactor") else "default",
                            amp="fp16" if fp16 else None, grad_scaler=fp16,
                            extra=extra, extra_text="torch 1.10's saved softmax inputs")
        return value + HF_CONTEXT, how + f" + the page's context {HF_CONTEXT / MiB:.0f} MiB"
    setting = (f"bert-large-uncased for sequence classification, 512 tokens, per_device_train_batch_size={batch}"
               + (f", gradient_accumulation_steps={accumulate}" if accumulate > 1 else "")
               + (", gradient_checkpointing=True" if checkpointing else "") + (", fp16=True" if fp16 else "")
               + {"adamw": ", AdamW (the Trainer's default)", "adafactor": ", optim=\"adafactor\"",
                  "adamw8bit": ", bnb.optim.Adam8bit"}[optimizer])
    return Row("hf-trainer", name, text, published, setting, predict)


def _lora_7b(batch: int) -> Callable[[], tuple[int, str]]:
    # the first iteration's batch holds the longest training sample (1304 tokens for Llama 2), padded to it
    def predict():
        return _train("hf:llama-2-7b", batch=batch, metric="allocated", seq_len=1304, dtype="bf16", optimizer="adamw",
                      use_cache=False, lora=8, lora_targets=["q_proj", "v_proj"], lora_dropout=0.05,
                      chunked_loss=11)
    return predict


ROWS = [
    _hf_row("vanilla, batch 4", "GPU memory occupied: 14949 MB.", 14949, batch=4),
    _hf_row("batch 1 x 4 accumulated", "GPU memory occupied: 8681 MB.", 8681,
            batch=1, accumulate=4),
    _hf_row("+ gradient checkpointing", "GPU memory occupied: 6775 MB.", 6775,
            batch=1, accumulate=4, checkpointing=True),
    _hf_row("fp16, batch 4", "GPU memory occupied: 13939 MB.", 13939,
            batch=4, fp16=True),
    _hf_row("accumulate + checkpointing + fp16", "GPU memory occupied: 7275 MB.",
            7275, batch=1, accumulate=4, checkpointing=True, fp16=True),
    _hf_row("Adafactor, batch 4", "GPU memory occupied: 12295 MB.", 12295,
            batch=4, optimizer="adafactor"),
    _hf_row("Adafactor + accumulate + checkpointing + fp16",
            "GPU memory occupied: 4847 MB.", 4847,
            batch=1, accumulate=4, checkpointing=True, fp16=True, optimizer="adafactor"),
    _hf_row("8-bit Adam, batch 4", "GPU memory occupied: 13085 MB.", 13085,
            batch=4, optimizer="adamw8bit"),
    _hf_row("8-bit Adam + accumulate + checkpointing + fp16",
            "GPU memory occupied: 5363 MB.", 5363,
            batch=1, accumulate=4, checkpointing=True, fp16=True, optimizer="adamw8bit"),
    Row("litgpt", "Llama 2 7B LoRA, micro-batch 1",
        "| 7 B   | Llama 2        | None         | 1               | 4,194,304            | 21.30 GB    |", 21.30,
        "finetune/lora.py, --precision bf16-true: LoRA r=8, alpha 16, dropout 0.05 on query and value; AdamW over "
        "the adapters; the first micro-batch is the longest sample (1304 tokens); lm_head and loss in 128-position "
        "chunks (gpulab: 11 chunks of 119)", _lora_7b(1)),
    Row("litgpt", "Llama 2 7B LoRA, micro-batch 2",
        "| 7 B   | Llama 2        | None         | 2               | 4,194,304            | 29.07 GB    |", 29.07,
        "as above, micro-batch 2 (the longest sample and one more, padded to 1304 tokens)", _lora_7b(2)),
    Row("litgpt", "Llama 2 7B inference, bf16",
        "| 7 B   | Llama 2        | None         | 1 x A100 | 13.52 GB                                  | 30.97     |",
        13.52, "generate/base.py defaults: prompt \"Hello, my name is\" (6 tokens), max_new_tokens=50, bf16-true",
        lambda: _generate("llama-2-7b", 6, 50)),
    Row("litgpt", "Llama 2 13B inference, bf16",
        "| 13 B  | Llama 2        | None         | 1 x A100 | 26.21 GB                                  | 24.82     |",
        26.21, "as above, Llama 2 13B", lambda: _generate("llama-2-13b", 6, 50)),
    *[Row("qwen", f"Qwen2.5-0.5B-Instruct, input {n}", quote, gb,
          f"batch 1, input of {n} tokens, 2048 tokens generated (min_length = generate_length + context_length), bf16",
          (lambda n=n: _generate("qwen2.5-0.5b", n, 2048)))
      for n, quote, gb in (
          (1, "| Qwen2.5-0.5B-Instruct   | 1            | BF16         | 1       | 47.40           | 0.97           |", 0.97),
          (6144, "| 6144         | BF16         | 1       | 47.45           | 1.23           |", 1.23),
          (14336, "| 14336        | BF16         | 1       | 47.11           | 1.60           |", 1.60),
          (30720, "| 30720        | BF16         | 1       | 47.16           | 2.34           |", 2.34))],
    *[Row("qwen", f"Qwen2.5-7B-Instruct, input {n}", quote, gb,
          f"batch 1, input of {n} tokens, 2048 tokens generated, bf16", (lambda n=n: _generate("qwen2.5-7b", n, 2048)))
      for n, quote, gb in (
          (1, "| Qwen2.5-7B-Instruct         | 1            | BF16         | 1       | 40.38           | 14.38          |",
           14.38),
          (30720, "| 30720        | BF16         | 1       | 18.83           | 19.97          |", 19.97))],
    Row("torchao", "ViT-H/14 fine-tune, fused AdamW", "PyTorch (fused) | 12.23                      | 41.9   | 94.52", 12.23,
        "vit_huge_patch14_224 (630M params), 45 classes, BF16 AMP, compiled model, batch size 8, "
        "torch.optim.AdamW(fused=True)",
        lambda: _train(_vit_h_45, input_shape=(3, 224, 224), batch=8, metric="allocated", optimizer="adamw",
                       implementation="fused", amp="bf16", compile=True)),
    Row("torchao", "ViT-H/14 fine-tune, bitsandbytes 8-bit AdamW", "bnb 8-bit       |  8.32                      | 43.6   | 94.54", 8.32,
        "as above with bnb.optim.AdamW8bit",
        lambda: _train(_vit_h_45, input_shape=(3, 224, 224), batch=8, metric="allocated", optimizer="adamw8bit",
                       amp="bf16", compile=True)),
    Row("torchao-float8", "Llama3-8b, bf16, FSDP2 + compile",
        "| Llama3-8b     |  none (bfloat16)                   | 47.65             |  6150                | -", 47.65,
        "8xH100, batch size 1, sequence length 8192, torch.compile, FSDP2, per-op SAC (gpulab: eager, see why)",
        lambda: _fsdp2_llama3_8b(None)),
    Row("torchao-float8", "Llama3-8b, float8 rowwise, FSDP2 + compile",
        "| Llama3-8b     |  rowwise with bfloat16 all-gather  | 47.79             |  6768                | 10.05%", 47.79,
        "as above with torchao's rowwise recipe and bf16 all-gather (gpulab: --fp8 rowwise, eager)",
        lambda: _fsdp2_llama3_8b("rowwise")),
    Row("pt-tutorial", "ViT-L/16, Adam, batch 1",
        "The last ~1.2GB comes from Adam optimizer requiring memory for intermediates, totaling to ~6GB of peak memory.", 6.0, "models.vit_l_16, fp32, torch.optim.Adam (foreach), one "
        "(1, 3, 224, 224) image, three steps",
        lambda: _train("vit_l_16", batch=1, metric="allocated", optimizer="adam", steps=3)),
    Row("pt-tutorial", "ViT-L/16, Adam stepped in backward", "Most importantly! The peak memory is lower! It is now ~4GB", 4.0,
        "one Adam([p], foreach=False) per parameter, stepped by register_post_accumulate_grad_hook",
        lambda: _train("vit_l_16", batch=1, metric="allocated", optimizer="adam", steps=3,
                       optimizer_in_backward=True, implementation="for-loop")),
]


def published_label(source: Source) -> str:
    """The label of a quoted figure (DESIGN's honest labels)."""
    return f"published by {source.org}, measured on {source.gpu}"


@dataclass(frozen=True)
class PublishedCheck:
    """One published figure beside gpulab's prediction of the same quantity."""
    row: Row
    source: Source
    predicted_bytes: int
    how: str

    @property
    def published_bytes(self) -> float:
        return self.row.published * self.source.unit

    @property
    def ratio(self) -> float:
        return self.predicted_bytes / self.published_bytes

    @property
    def within_tolerance(self) -> bool:
        lo, hi = self.source.tolerance
        return lo <= self.ratio <= hi

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.row.name, "quote": self.row.quote, "setting": self.row.setting,
                "published_bytes": self.published_bytes, "predicted_bytes": self.predicted_bytes,
                "ratio": self.ratio, "tolerance": self.source.tolerance, "within_tolerance": self.within_tolerance,
                "published_label": published_label(self.source), "how": self.how, "source": self.source.title,
                "where": self.source.where, "metric": self.source.metric}

    def _repr_html_(self) -> str:
        s, u = self.source, self.source.unit_name
        lo, hi = s.tolerance
        rows = [["published", f"{self.row.published:,.2f} {u}", f"{published_label(s)}: \"{self.row.quote.strip()}\""],
                ["gpulab's prediction", f"{self.predicted_bytes / s.unit:,.2f} {u}", self.how],
                ["ratio", f"{self.ratio:.3f}", f"within {lo:.2f}-{hi:.2f}: " + ("yes" if self.within_tolerance else "no")
                 + f" ({s.why})"],
                ["what was measured", "", s.metric], ["setting", "", self.row.setting], ["source", "", s.where]]
        return html_table(["", "value", "where it comes from"], rows, f"{self.row.name}: a published GPU measurement")


def published_check(name: str) -> PublishedCheck:
    """The row called ``name`` (``ROWS``), its prediction computed now."""
    row = next((r for r in ROWS if r.name == name), None)
    if row is None:
        raise ValueError(f"no published figure called {name!r}; there are: {', '.join(r.name for r in ROWS)}")
    predicted, how = row.predict()
    return PublishedCheck(row, SOURCES[row.source], int(predicted), how)
