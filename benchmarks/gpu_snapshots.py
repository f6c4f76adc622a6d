"""Record real CUDA memory snapshots on a GPU (issue 16's findings, issue 25's fixtures).

    PYTHONPATH=. python benchmarks/gpu_snapshots.py --out DIR [--part steps|allocator] [--stacks all|python]

``steps``: one sgd training step of each CLI conv model (cnn at batch 32; resnet18, alexnet,
vgg16 at batch 1, 224x224) after a warm-up step, with ``torch.cuda.memory._record_memory_history``
on (C++ and Python frames with ``--stacks all``). Beside each snapshot: every storage an op
returned during the step (address, bytes, op, in dispatch order), from a TorchDispatchMode, so
that allocations that are no tensor's (cuDNN / cuBLAS workspaces) can be told apart from the
tensors the tracker sees.

``allocator``: small scenarios whose snapshots hold what issue 25 replays: an ``empty_cache()``
burst, two streams, an out-of-memory entry (a request larger than the card), and, in a child
process with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, the same allocations with
expandable segments.

Writes DIR/<name>.pickle (the snapshot as ``torch.cuda.memory._snapshot()`` returns it),
DIR/<name>.storages.json and DIR/summary.json. A benchmark script: it prints progress lines.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

STEP_MODELS = (("cnn", 32), ("resnet18", 1), ("alexnet", 1), ("vgg16", 1))
MIB = 1 << 20


class StorageLog(TorchDispatchMode):
    """Every CUDA storage an op returns: (address, bytes, op), in dispatch order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                s = t.untyped_storage()
                self.rows.append((s.data_ptr(), s.nbytes(), str(func)))
        return out


def _dump(out: pathlib.Path, name: str, snapshot: dict, extra: dict) -> dict:
    with open(out / f"{name}.pickle", "wb") as fh:
        pickle.dump(snapshot, fh)
    return {"name": name, "trace_entries": sum(len(t) for t in snapshot.get("device_traces", [])),
            "segments": len(snapshot.get("segments", [])), **extra}


def step_snapshot(out: pathlib.Path, model_name: str, batch: int, stacks: str) -> dict:
    from gpulab.models.registry import MODELS
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build(num_classes=spec.num_classes, image_size=spec.default_image_size).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, spec.default_image_size, spec.default_image_size, device="cuda")
    y = torch.randint(0, spec.num_classes, (batch,), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                  # warm-up: cuBLAS / cuDNN handles and workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=stacks)
    log = StorageLog()
    t0 = time.perf_counter()
    with log:
        step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    name = f"step_{model_name}_b{batch}_sgd"
    (out / f"{name}.storages.json").write_text(json.dumps(log.rows))
    res = _dump(out, name, snap, {"model": model_name, "batch": batch, "peak_allocated_minus_base": peak,
                                  "base": base, "storages": len(log.rows),
                                  "seconds": round(time.perf_counter() - t0, 2),
                                  "cudnn": torch.backends.cudnn.version(),
                                  "cudnn_benchmark": torch.backends.cudnn.benchmark})
    torch.cuda.empty_cache()
    return res


def allocator_snapshot(out: pathlib.Path, stacks: str, tag: str) -> dict:
    """empty_cache burst, a second stream, an OOM entry: one trace."""
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=stacks)
    keep = [torch.empty(6 * MIB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del keep[::2]
    big = [torch.empty(12 * MIB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    small = [torch.empty(1000 * (i + 1), dtype=torch.uint8, device="cuda") for i in range(20)]
    del small[::3]
    torch.cuda.empty_cache()                 # a release burst: the free segments go
    s2 = torch.cuda.Stream()
    with torch.cuda.stream(s2):
        other = [torch.empty(3 * MIB, dtype=torch.uint8, device="cuda") for _ in range(3)]
        other.append(torch.empty(700, dtype=torch.uint8, device="cuda"))
    s2.synchronize()
    del other[1]
    oom = None
    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(total + (64 << 30), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    after = [torch.empty(2 * MIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    res = _dump(out, f"allocator_{tag}", snap, {"oom_message": oom, "mem_get_info": [free, total],
                                                "settings": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")})
    del keep, big, small, other, after
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=("steps", "allocator", "all"), default="all")
    p.add_argument("--stacks", choices=("all", "python"), default="all")
    p.add_argument("--tag", default="default")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_snapshots: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if a.part in ("steps", "all"):
        for model, batch in STEP_MODELS:
            try:
                rows.append(step_snapshot(out, model, batch, a.stacks))
            except Exception as exc:  # noqa: BLE001 - reported, the next one runs
                rows.append({"name": f"step_{model}", "error": repr(exc)[:500]})
            print("[gpu_snapshots]", rows[-1], flush=True)
    if a.part in ("allocator", "all"):
        try:
            rows.append(allocator_snapshot(out, a.stacks, a.tag))
        except Exception as exc:  # noqa: BLE001
            rows.append({"name": f"allocator_{a.tag}", "error": repr(exc)[:500]})
        print("[gpu_snapshots]", rows[-1], flush=True)
        if a.tag == "default":
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
            r = subprocess.run([sys.executable, __file__, "--out", str(out), "--part", "allocator",
                                "--stacks", a.stacks, "--tag", "expandable"], env=env, timeout=300)
            rows.append({"name": "allocator_expandable", "returncode": r.returncode})
    summary = out / f"summary_{a.tag}.json"
    summary.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                   "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
