"""The appendix's predict-first question (lessons/15_appendix_reference_claims.ipynb): which of
three rules of thumb from the reference articles breaks when measured. The checker answers from
the claims functions of lessons 03, 05 and 09 run on fresh evidence, never from a typed key."""
from __future__ import annotations

from functools import lru_cache

from gpulab.course.claims import BREAKS, ClaimCheck
from gpulab.course.exercises import ChoiceExercise

__all__ = ["exercise_which_breaks", "which_breaks_checks"]

OPTIONS = {
    "a": "SGD keeps parameters + gradients: twice the parameter memory (×2)",
    "b": "backward doubles the intermediates, so training needs every layer's output × 2",
    "c": "nvidia-smi shows more memory than your tensors take",
}


@lru_cache(maxsize=1)
def which_breaks_checks() -> dict[str, ClaimCheck]:
    """The claim card behind each option, computed as in the appendix's sections 05, 03 and 09
    (the small MLP at batch 8; every lesson model at batch 1; the small CNN at batch 32)."""
    from gpulab.course.modelsize import modelsize_claims, modelsize_vs_saved
    from gpulab.course.allocator_claims import allocator_claims
    from gpulab.course.optimizers import compare_optimizers, optimizer_claims
    from gpulab.predict import replay as R

    sgd = next(c for c in optimizer_claims(compare_optimizers("mlp", batch=8)) if c.claim.startswith("SGD:"))
    doubles = next(c for c in modelsize_claims(modelsize_vs_saved(batch=1, dtype="float32"))
                   if c.claim.startswith("backward doubles"))
    smi = allocator_claims(R.workload("training step", "cnn", 32, steps=2), R.empty_cache_cost("cnn", 32, steps=4),
                           R.beyond_allocator_bytes())[0]
    return {"a": sgd, "b": doubles, "c": smi}


def _breaking() -> str:
    broken = [k for k, c in which_breaks_checks().items() if c.verdict == BREAKS]
    if len(broken) != 1:
        raise RuntimeError(f"expected one breaking claim of three, got {broken or 'none'}")
    return broken[0]


def _explain() -> str:
    checks = which_breaks_checks()
    return " ".join(f"({k}) {c.verdict}: {c.why.rstrip('.')}." for k, c in checks.items())


def exercise_which_breaks() -> ChoiceExercise:
    """Which of three of the articles' rules breaks when measured? (The checker runs the three
    claims functions the first time it is asked: about half a minute on a laptop CPU.)"""
    return ChoiceExercise(
        "Three rules of thumb from the reference articles. Which one breaks when measured?",
        OPTIONS, expected=_breaking, explain=_explain)
