"""Snapshot of gpulab's fake-engine predictions, to prove a speed-up changes no number.

``python benchmarks/fake_predictions.py save DIR [--set torchvision|others|all] [--shard i/n]``
runs every case and writes one JSON per case into DIR; ``compare REF NEW`` reads two such
directories and prints every difference (exit 1 if any). A case's record holds the step's
``as_dict()`` without its timings (peak, per-category peaks, step peaks, final and after-step
bytes, the prediction), the tracker's event and storage counts, and fingerprints of its whole
timeline (each event's kind, bytes, device, phase, module) and of every storage's record, so
that "identical" means identical event for event, not only at the peak.

The cases: every torchvision classification model at batch 64 (``gpulab.step``, fake engine,
CUDA target); the lesson models with sgd / momentum / adam on both fake targets, through
``step`` (and, under the name "ts", as the retired ``training_step`` ran them: one sgd step, no
guard), and on the cpu engine for the small ones; ``hf:`` configs;
mixed precision; ``gpulab.fit``. A benchmark helper, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

TIMING_KEYS = {"seconds"}


def _cases(which: str) -> list[tuple[str, dict]]:
    from gpulab.models.registry import torchvision_names
    out: list[tuple[str, dict]] = []
    if which in ("torchvision", "all"):
        out += [(f"tv-{n}", {"fn": "step", "model": n, "batch": 64, "engine": "fake"}) for n in torchvision_names()]
    if which in ("others", "all"):
        for m in ("vgg16", "alexnet", "resnet18", "mlp", "cnn"):
            for opt in ("sgd", "momentum", "adam"):
                out.append((f"lesson-{m}-{opt}-fakecuda", {"fn": "step", "model": m, "optimizer": opt, "engine": "fake"}))
                out.append((f"lesson-{m}-{opt}-fakecpu", {"fn": "step", "model": m, "optimizer": opt, "engine": "fake",
                                                          "fake_target": "cpu"}))
                out.append((f"lesson-{m}-{opt}-ts", {"fn": "training_step", "model": m, "optimizer": opt,
                                                     "engine": "fake"}))
                if m in ("mlp", "cnn"):
                    out.append((f"lesson-{m}-{opt}-cpu", {"fn": "step", "model": m, "optimizer": opt, "engine": "cpu"}))
        for m in ("vgg16", "resnet18"):
            out.append((f"lesson-{m}-b64", {"fn": "step", "model": m, "batch": 64, "engine": "fake"}))
        for h in ("hf:tiny-gpt2", "hf:tiny-llama", "hf:gpt2"):
            out.append((f"hf-{h[3:]}", {"fn": "step", "model": h, "batch": 4, "seq_len": 128, "engine": "fake"}))
        out.append(("hf-tiny-llama-bf16", {"fn": "step", "model": "hf:tiny-llama", "batch": 4, "seq_len": 128,
                                           "engine": "fake", "dtype": "bf16"}))
        out.append(("hf-tiny-gpt2-amp", {"fn": "step", "model": "hf:tiny-gpt2", "batch": 4, "seq_len": 128,
                                         "engine": "fake", "amp": "bf16"}))
        out.append(("resnet18-amp-fp16", {"fn": "step", "model": "resnet18", "batch": 8, "engine": "fake", "amp": "fp16"}))
        out.append(("cnn-bf16", {"fn": "step", "model": "cnn", "engine": "fake", "dtype": "bf16"}))
        out.append(("mobilenet_v2-dropout-b32-adamw", {"fn": "step", "model": "mobilenet_v2", "batch": 32,
                                                       "engine": "fake", "optimizer": "adamw"}))
        out.append(("fit-resnet18-24GiB", {"fn": "fit", "model": "resnet18", "gpu": "24GiB"}))
        out.append(("fit-tiny-gpt2-16GiB", {"fn": "fit", "model": "hf:tiny-gpt2", "gpu": "16GiB", "seq_len": 128}))
    return out


def _digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tracking_facts(t) -> dict:
    events = [(e.kind, e.nbytes, e.delta, e.device, e.phase, e.module) for e in t.events]
    records = sorted((r.sid, r.category.value, r.nbytes, r.device, r.dtype, list(r.shape), r.module, r.phase, r.op,
                      r.preexisting, r.state_key, r.freed is None) for r in t.records.values())
    return {"events": len(t.events), "storages": len(t.records), "events_digest": _digest(events),
            "records_digest": _digest(records), "peak_phase": t.peak_phase, "peak_module": t.peak_module}


def run_case(spec: dict) -> dict:
    import gpulab
    kw = dict(spec)
    fn = kw.pop("fn")
    if fn == "fit":
        r = gpulab.fit(kw.pop("model"), kw.pop("gpu"), **kw)
        d = {k: v for k, v in r.as_dict().items() if k not in TIMING_KEYS}
        return {"result": d}
    if fn == "training_step":   # the old second step API: one sgd step unless told, no guard
        kw = {"optimizer": "sgd", "steps": 1, **kw, "guard": False}
    r = gpulab.step(kw.pop("model"), **kw)
    d = {k: v for k, v in r.as_dict().items() if k not in TIMING_KEYS}
    return {"result": d, "tracking": _tracking_facts(r.measurement.tracking)}


def save(out_dir: str, which: str, shard: str, only: list[str]) -> int:
    i, n = (int(x) for x in shard.split("/"))
    os.makedirs(out_dir, exist_ok=True)
    cases = [c for c in _cases(which) if not only or any(o in c[0] for o in only)][i::n]
    for name, spec in cases:
        w0, c0 = time.perf_counter(), time.process_time()
        rec = {"case": name, "spec": spec}
        try:
            rec.update(run_case(spec))
        except Exception as exc:   # recorded: an error must stay the same error
            rec["error"] = f"{type(exc).__name__}: {exc}"
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        with open(os.path.join(out_dir, f"{name.replace(':', '_')}.json"), "w") as f:
            json.dump(rec, f, indent=1, sort_keys=True)
        print(f"{name:<40} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    return 0


def _diff(a, b, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'new' if k not in a else 'reference'}")
            else:
                _diff(a[k], b[k], f"{path}.{k}", out)
    elif a != b:
        out.append(f"{path}: {a!r} -> {b!r}")


def compare(ref_dir: str, new_dir: str, ignore: list[str], subset: bool = False) -> int:
    names = sorted(f for f in os.listdir(ref_dir) if f.endswith(".json")
                   and (not subset or os.path.exists(os.path.join(new_dir, f))))
    mismatched, compared, missing = 0, 0, []
    for f in names:
        p = os.path.join(new_dir, f)
        if not os.path.exists(p):
            missing.append(f)
            continue
        with open(os.path.join(ref_dir, f)) as fa, open(p) as fb:
            a, b = json.load(fa), json.load(fb)
        out: list[str] = []
        _diff(a, b, f[:-5], out)
        out = [line for line in out if not any(ig in line for ig in ignore)]
        compared += 1
        if out:
            mismatched += 1
            print("\n".join(out))
    print(f"compared {compared} cases: {mismatched} with differences"
          f"{'; ignored fields containing ' + ', '.join(ignore) if ignore else ''}"
          f"{'; missing in new: ' + ', '.join(missing) if missing else ''}")
    return 1 if mismatched or missing else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("dir")
    s.add_argument("--set", default="all", choices=("torchvision", "others", "all"))
    s.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th")
    s.add_argument("--only", action="append", default=[], help="only the cases whose name contains this")
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("new")
    c.add_argument("--ignore", action="append", default=[], help="skip differences whose line contains this")
    c.add_argument("--subset", action="store_true", help="compare only the cases NEW has")
    args = ap.parse_args()
    if args.cmd == "save":
        return save(args.dir, args.set, args.shard, args.only)
    return compare(args.ref, args.new, args.ignore, args.subset)


if __name__ == "__main__":
    sys.exit(main())
