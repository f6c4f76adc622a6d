"""What the cycle collector walks while a panel measures.

A notebook's kernel holds a million objects or more once a lesson has run (torch's, transformers',
every figure and table so far), and each full collection walks them all: some 0.3 s on 2 cores. The
fake engine makes one after a run that left a tracked storage alive (``measure.engines._run_host``),
and Python makes its own when enough objects have piled up: a panel change of half a second can pay
one or two. ``old_objects_frozen`` moves every object that exists when a measurement starts out of the
collector's walks (``gc.freeze``) and hands them back when it ends (``gc.unfreeze``, into the oldest
generation, as they were), so the collections in between walk only what the measurement made, where its
reference cycles are. The ``gpulab`` command does the same for a whole answer (``cli._collections_kept_short``).

Nothing is lost: a frozen object that became garbage is collected by the first full collection after the
measurement. Where something froze objects already (the ``gpulab`` command, a user's own ``gc.freeze``),
nothing is changed; nor where a GPU is present: the cuda engine collects before it measures what earlier
code left (``measure.engines.release_cuda_memory``: reference cycles holding GPU tensors, old objects
among them). The panels call it holding ``base.MEASURE_LOCK``, so two measurements never overlap.
"""
from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

__all__ = ["old_objects_frozen"]


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """While inside, the cycle collector walks only the objects made since entering (module docstring)."""
    torch = sys.modules.get("torch")
    if gc.get_freeze_count() or (torch is not None and torch.cuda.is_available()):   # someone's freeze; a GPU
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
