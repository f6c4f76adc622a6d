"""Lesson 14 (optional section): host RAM while loading a checkpoint, and its predict-first checker.

The measurement is ``gpulab.measure.host_ram.loading_peaks`` (one child process per loading method);
the checker reads its numbers: each method's peak above the child's own baseline, in units of the
checkpoint's weights, rounded to the nearest whole copy.
"""
from __future__ import annotations

from gpulab.course.exercises import ChoiceExercise
from gpulab.measure.host_ram import LOAD_METHODS, HostRamResult, loading_peaks

__all__ = ["copies", "exercise_loading_copies", "measured_loading"]

_MEASURED: dict[tuple[int, int], HostRamResult] = {}

# (naive, meta + assign=True, mmap right after loading, mmap after a forward pass), in copies of the weights
_OPTIONS = {
    "a": (1, 1, 1, 1),
    "b": (2, 1, 1, 1),
    "c": (2, 1, 0, 1),
    "d": (2, 2, 0, 1),
}


def copies(result: HostRamResult) -> tuple[int, int, int, int]:
    """The measured rises, each rounded to whole copies of the weights: naive, meta_assign, mmap right
    after loading, mmap after use."""
    for m in ("naive", "meta_assign", "mmap"):
        if result.row(m).error:
            raise ValueError(f"the {m} child gave no numbers ({result.row(m).error}); run loading_peaks again")
    return (round(result.ratio("naive")), round(result.ratio("meta_assign")),
            round(result.ratio("mmap", after_use=False)), round(result.ratio("mmap")))


def measured_loading(layers: int = 2, width: int = 4096, fresh: bool = False) -> HostRamResult:
    """``loading_peaks(layers, width)`` for every method, measured once per Python session (each child
    process imports torch, which takes seconds); ``fresh=True`` measures again. The default, 2 x 4096²,
    is 128 MiB of weights: a clear difference, and a naive child under 1 GiB, which Binder's 2 GB holds."""
    key = (layers, width)
    if fresh or key not in _MEASURED or any(r.error for r in _MEASURED[key].rows):
        _MEASURED[key] = loading_peaks(layers, width, methods=LOAD_METHODS)
    return _MEASURED[key]


def _describe(c: tuple[int, int, int, int]) -> str:
    return (f"naive {c[0]}x, meta + assign=True {c[1]}x, mmap {c[2]}x right after loading and "
            f"{c[3]}x once a forward pass has read every weight")


def exercise_loading_copies(result: HostRamResult) -> ChoiceExercise:
    """Predict-first (qualitative): how many copies of the weights each way of loading holds at its peak.
    The right key is the option equal to the measured ``copies(result)``."""

    def expected() -> str:
        measured = copies(result)
        return next((k for k, v in _OPTIONS.items() if v == measured), "none of these")

    def explain() -> str:
        r = result
        return (f"{r.label[0].upper()}{r.label[1:]}, peak above the child's own baseline over the checkpoint's "
                f"{r.weights_bytes / 2**20:.0f} MiB: naive {r.ratio('naive'):.2f}, meta + assign=True "
                f"{r.ratio('meta_assign'):.2f}, mmap {r.ratio('mmap', after_use=False):.2f} right after loading "
                f"and {r.ratio('mmap'):.2f} after a forward pass, safetensors {r.ratio('safetensors', False):.2f} "
                f"and {r.ratio('safetensors'):.2f}. The naive way holds the random init and the loaded state "
                f"dict at once; assign=True makes the loaded tensors the parameters; a mapped file's pages "
                f"become resident only when something reads them.")

    return ChoiceExercise(
        question=(f"A model with {result.weights_bytes / 2**20:.0f} MiB of float32 weights is loaded from its "
                  f"checkpoint in a fresh process, three ways. At its peak, how many copies of the weights does "
                  f"each hold in host RAM, above what the process held before (torch imported)? In order: naive; "
                  f"meta device + assign=True; torch.load(mmap=True) + meta + assign=True, right after loading; "
                  f"the same after one forward pass."),
        options={k: _describe(v) for k, v in _OPTIONS.items()},
        expected=expected, explain=explain)
