"""Issue 46, item 5 (on every machine): the time model's *ratios* between recipes against real
timed CPU steps. This CPU is measured as a card on the spot (``measure.cpu_speed``: an fp32
matmul's rate, a copy's bandwidth, eager PyTorch's per-op cost), the fake step is costed on it
(``gpulab.step(..., engine="fake", fake_target="cpu", time=cpu_card)``), and the same step is
timed for real: a plain PyTorch loop (no tracker), warm-up steps first, then the fastest of the timed
ones. Everything runs on one torch thread and is timed by ``time.thread_time`` (the CPU time this
thread got): on a shared machine another process's work then delays a step without counting in it.

    PYTHONPATH=. python benchmarks/time_ratios.py [--steps 5]

It prints, per pair of recipes, the predicted ratio of step times, the measured one and their
quotient, with the load average (the machine is shared). A benchmark: it prints, it asserts nothing
(``tests/test_timing.py`` checks one pair with a wide tolerance).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import GPT2Config

import gpulab
from gpulab.measure.cpu_speed import measure_cpu_speed, one_thread
from gpulab.models.adapt import CHECKPOINTING_KWARGS
from gpulab.models.workload import resolve_workload
from gpulab.predict.card_speeds import CardSpeed, cpu_card_speed

# A GPT-2-shaped model small enough to time on two shared cores (not a published model).
SMALL_GPT2 = dict(vocab_size=4096, n_positions=256, n_embd=256, n_layer=4, n_head=4,
                  bos_token_id=4095, eos_token_id=4095)
SEQ_LEN = 128
# (name, recipe a, recipe b): each recipe is (batch, checkpointing, the optimizer's implementation)
PAIRS = (("batch 8 / batch 2", (8, False, "default"), (2, False, "default")),
         ("full checkpointing / none, batch 8", (8, True, "default"), (8, False, "default")),
         ("batch 8 / batch 1", (8, False, "default"), (1, False, "default")),
         ("for-loop Adam / foreach, batch 1", (1, False, "for-loop"), (1, False, "foreach")))


def model():
    return GPT2Config(**SMALL_GPT2)


def predicted_seconds(cfg, batch: int, checkpointing: bool, implementation: str, card: CardSpeed) -> float:
    """The fake step's predicted seconds on ``card`` (CPU kernels followed: the step the real loop runs)."""
    r = gpulab.step(cfg, batch=batch, seq_len=SEQ_LEN, optimizer="adam", engine="fake", fake_target="cpu",
                    checkpointing="full" if checkpointing else False, implementation=implementation, time=card)
    return r.time.seconds


def measured_seconds(cfg, batch: int, checkpointing: bool, implementation: str = "default", steps: int = 5,
                     warmup: int = 2) -> float:
    """The fastest of ``steps`` real CPU training steps (forward, backward, Adam step, zero_grad), after
    ``warmup`` untimed ones: the fastest is the step least slowed by the machine's other work."""
    w = resolve_workload(cfg, seq_len=SEQ_LEN)
    torch.manual_seed(0)
    net = w.build("cpu", torch.float32)
    if checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINTING_KWARGS))
    net.train()
    impl = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}}[implementation]
    opt = torch.optim.Adam(net.parameters(), **impl)
    data = w.inputs(batch, torch.float32)
    times = []
    for i in range(warmup + steps):
        t0 = time.thread_time()
        out = net(*data[0], **data[1])
        w.loss(out, data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.thread_time() - t0)
    return min(times)




def cpu_card() -> CardSpeed:
    """This CPU measured as a card, one thread, by its thread's CPU time."""
    with one_thread():
        return cpu_card_speed(measure_cpu_speed(clock=time.thread_time))


def ratios(card: CardSpeed, pairs=PAIRS, steps: int = 5) -> list[dict]:
    """Per pair: the predicted and measured ratio of step times (a over b), on one thread."""
    cfg, out = model(), []
    with one_thread():
        for name, a, b in pairs:
            p = predicted_seconds(cfg, *a, card) / predicted_seconds(cfg, *b, card)
            m = measured_seconds(cfg, *a, steps=steps) / measured_seconds(cfg, *b, steps=steps)
            out.append({"pair": name, "predicted": p, "measured": m, "quotient": p / m})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    load = os.getloadavg()
    card = cpu_card()
    print(f"this CPU: {card.source}")
    for row in ratios(card, steps=args.steps):
        print(f"{row['pair']:40s} predicted {row['predicted']:.2f}  measured {row['measured']:.2f}  "
              f"predicted/measured {row['quotient']:.2f}")
    print(f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
