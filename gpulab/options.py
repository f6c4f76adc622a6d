"""The values a training recipe's options take, checked without importing torch.

The ``gpulab`` command refuses a bad value before torch and transformers load (half a second
instead of several); the library checks the same values with the same functions, re-exported
where they were first written (``models.adapt.check_checkpointing``,
``training.chunked_loss.check_chunks``).
"""
from __future__ import annotations

from gpulab.formulas import OPTIMIZER_STATES, RECIPE_OPTIMIZERS

__all__ = ["ALL_OPTIMIZERS", "AMP_NAMES", "CHECKPOINTING_POLICIES", "FP8_RECIPES", "MAX_STEPS", "POLICY_TEXT",
           "SCHEDULES", "check_checkpointing", "check_chunks", "check_fp8"]

# what gpulab.step / gpulab.fit / the CLI take: the lessons' optimizers, then the recipe optimizers
# (training.optimizers.ALL_OPTIMIZERS is the same tuple)
ALL_OPTIMIZERS = (*OPTIMIZER_STATES, *RECIPE_OPTIMIZERS)
AMP_NAMES = ("fp16", "bf16")       # the keys of training.loop.AMP_DTYPES
MAX_STEPS = 10   # tracked steps of one call: each repeats the steady state of step 2
SCHEDULES = ("1f1b", "gpipe", "interleaved")   # training.pipeline.SCHEDULES: the pipeline schedules gpulab measures

CHECKPOINTING_POLICIES = ("full", "selective", "every-K")
POLICY_TEXT = ("full (every block), selective (op-level selective activation checkpointing, SAC: matmul and "
               "attention outputs kept, the rest recomputed) or every-K (every K-th block, e.g. every-2)")


def check_checkpointing(value) -> str | bool:
    """A checkpointing choice as the recipe keeps it: False (none), "full", "selective" or
    "every-K" with K ≥ 2 ("every-1" is "full"). True means "full". ``ValueError`` naming the
    choices otherwise."""
    if value is False or value is None:
        return False
    if value is True:
        return "full"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("full", "selective"):
            return v
        if v.startswith("every-") and v[6:].isdigit() and int(v[6:]) >= 1:
            return "full" if int(v[6:]) == 1 else f"every-{int(v[6:])}"
    raise ValueError(f"checkpointing must be True or False, or a policy: {POLICY_TEXT}; got {value!r}")


def check_chunks(chunks) -> int:
    """0 (the model's own loss) or a number of chunks from 2 to 64; anything else is refused."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not (chunks == 0 or 2 <= chunks <= 64):
        raise ValueError(f"chunked_loss must be a number of chunks from 2 to 64 (torchtune uses 8), or 0 for the "
                         f"model's own loss; got {chunks!r}")
    return chunks


FP8_RECIPES = ("tensorwise", "rowwise")   # torchao.float8's Float8LinearRecipeName values gpulab runs


def check_fp8(fp8) -> str | None:
    """None (off) or one of torchao's float8 training recipes; anything else is refused in one line."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 must be one of {', '.join(FP8_RECIPES)} (torchao's float8 training recipes), "
                         f"got {fp8!r}")
    return fp8
