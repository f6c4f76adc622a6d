"""Data loading's time (issue 46, item 6; lesson 04, an optional section): ``num_workers``,
``pin_memory`` and ``non_blocking`` measured with a small ``torch.utils.data.DataLoader`` on this
CPU, with what changes on a GPU said by the symbols it rests on.

The dataset is synthetic: each item waits ``wait_s`` (standing in for reading a file: time the
process spends waiting, not computing) and then builds a small image tensor. An epoch is timed
from the loader's creation to its last batch moved to the device, so the workers' start is in
it (a persistent loader's first epoch, which starts its workers, is a warm-up); each configuration
is timed ``repeats`` times by the wall clock
(``time.perf_counter``: the workers are other processes), the fastest the figure and
[fastest, slowest] the spread.

What a CPU cannot show, from the installed torch's source:

* ``pin_memory=True`` without an accelerator is ignored with a warning
  (``torch.utils.data.dataloader._BaseDataLoaderIter``: ``loader.pin_memory and
  torch.accelerator.is_available()``); with one, a thread copies each batch into page-locked
  memory (``torch.utils.data._utils.pin_memory.pin_memory`` calls ``pin_memory()`` on it).
* ``non_blocking=True`` matters only for a copy between CPU and GPU (``Tensor.copy_``'s docstring:
  "For other cases, this argument has no effect"); here the batch stays on the CPU.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpulab.course.exercises import ChoiceExercise
from gpulab.course.timing_spread import Ratio, ratio, spread
from gpulab.record.runs.checkpoint import Timing
from gpulab.tables import html_table

__all__ = ["LoaderTimes", "SlowItems", "exercise_workers", "loader_times"]


class SlowItems(Dataset):
    """``n`` items, each a (3, size, size) float tensor and a label, made after waiting ``wait_s``."""

    def __init__(self, n: int = 48, wait_s: float = 0.002, size: int = 32) -> None:
        self.n, self.wait_s, self.size = n, wait_s, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.wait_s)
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, self.size, self.size, generator=g) * 2 - 1, i % 10


@dataclass(frozen=True)
class Setting:
    name: str
    num_workers: int
    pin_memory: bool = False
    non_blocking: bool = False
    persistent_workers: bool = False


SETTINGS = (Setting("num_workers=0", 0),
            Setting("num_workers=0, pin_memory=True, non_blocking=True", 0, True, True),
            Setting("num_workers=2", 2),
            Setting("num_workers=2, persistent_workers=True", 2, persistent_workers=True))


@dataclass
class LoaderTimes:
    """Per setting, the epoch's measured wall time (``loader_times``)."""
    items: int
    batch: int
    wait_s: float
    device: str
    accelerator: bool
    times: dict[str, Timing] = field(default_factory=dict)

    def speedup(self, name: str, base: str = "num_workers=0") -> float:
        """The fastest epoch of ``base`` over the fastest of ``name``."""
        return self.speed(name, base).value

    def speed(self, name: str, base: str = "num_workers=0") -> Ratio:
        """``base``'s epoch over ``name``'s: the fastest epochs' ratio and the span their
        [fastest, slowest] intervals allow (``timing_spread.ratio``)."""
        return ratio(self.times[base], self.times[name], "range")

    def overlaps(self, name: str, base: str = "num_workers=0") -> bool:
        return self.speed(name, base).within_noise

    def rows(self) -> list[list[Any]]:
        return [[name, spread(t, "range", digits=0),
                 "—" if name == "num_workers=0" else self.speed(name).text(),
                 "—" if name == "num_workers=0" else ("overlap" if self.overlaps(name) else "apart")]
                for name, t in self.times.items()]

    def _repr_html_(self) -> str:
        waited = self.items * self.wait_s
        note = (f"{self.items} items in batches of {self.batch}, each item waiting {self.wait_s * 1e3:g} ms (a file "
                f"read's stand-in: {waited * 1e3:,.0f} ms an epoch in one process), then a (3, 32, 32) tensor. Measured "
                f"on this CPU by the wall clock, {len(next(iter(self.times.values())).samples)} epochs each (the "
                f"persistent loader's after the first, which starts its workers), batches moved to {self.device}. "
                + ("" if self.accelerator else "No accelerator here: pin_memory=True was ignored (PyTorch warns so) and "
                   "non_blocking had no copy to make asynchronous."))
        return html_table(["loader", "epoch: fastest [fastest–slowest]",
                           "speed vs num_workers=0: fastest epochs [span the intervals allow]", "intervals"],
                          self.rows(), note)

    def __repr__(self) -> str:
        return "LoaderTimes(" + "; ".join(f"{n}: {t.min * 1e3:,.0f} ms" for n, t in self.times.items()) + ")"


def _epoch(data: Dataset, batch: int, s: Setting, device: torch.device, loader: DataLoader | None) -> tuple[float, DataLoader]:
    t0 = time.perf_counter()
    if loader is None:
        loader = DataLoader(data, batch_size=batch, num_workers=s.num_workers, pin_memory=s.pin_memory,
                            persistent_workers=s.persistent_workers)
    for x, y in loader:
        x = x.to(device, non_blocking=s.non_blocking)
        y = y.to(device, non_blocking=s.non_blocking)
    return time.perf_counter() - t0, loader


def loader_times(items: int = 32, batch: int = 8, wait_s: float = 0.003, *, repeats: int = 3,
                 settings: tuple[Setting, ...] = SETTINGS) -> LoaderTimes:
    """An epoch of ``SlowItems(items, wait_s)`` through a DataLoader for each of ``settings``
    (module docstring): ``repeats`` timed epochs each. A persistent loader is made once and reused, as its
    workers are: its first epoch (which starts them) is a warm-up, not timed."""
    if repeats < 1 or items < 1 or batch < 1:
        raise ValueError("items, batch and repeats must be whole numbers of 1 or more")
    accelerator = torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if accelerator else torch.device("cpu")
    data = SlowItems(items, wait_s)
    out = LoaderTimes(items, batch, wait_s, str(device), accelerator)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")   # said in the table's note instead
        for s in settings:
            keep = None
            samples = []
            warmup = 1 if s.persistent_workers else 0
            for j in range(warmup + repeats):
                seconds, loader = _epoch(data, batch, s, device, keep)
                keep = loader if s.persistent_workers else None
                if j >= warmup:
                    samples.append(seconds)
            if keep is not None:
                del keep   # its workers exit with it
            out.times[s.name] = Timing(samples, warmup, "this CPU")
    return out


def exercise_workers(result: LoaderTimes) -> ChoiceExercise:
    """Predict first: with two workers, how long does an epoch take? Read off the measurement."""
    options = {"a": "about as long as with num_workers=0: the waits still add up one after another",
               "b": "clearly shorter: two processes wait for their items at the same time",
               "c": "longer: starting the workers costs more than they save"}
    name = "num_workers=2"

    def expected() -> str:
        if result.overlaps(name):
            return "a"
        return "b" if result.speedup(name) > 1 else "c"

    def explain() -> str:
        if result.overlaps(name):
            return (f"The measured intervals overlap ({result.speed(name).text()}): on this machine, now, the two "
                    f"are not told apart.")
        return (f"Measured: {result.speed(name).text()} the speed of one process, comparing the fastest epochs (in "
                f"brackets, the span the slowest allow); the waits overlap in "
                f"the workers, and each epoch pays for starting them (persistent_workers keeps them).")
    return ChoiceExercise(f"{result.items} items, each waiting {result.wait_s * 1e3:g} ms: an epoch with "
                          f"num_workers=2, against num_workers=0, takes:", options, expected, explain)
