"""Published real-GPU memory figures next to gpulab's prediction of the same quantity.

    python benchmarks/published.py [--source KEY ...] [--json FILE]

Each row quotes a figure somebody measured on a GPU and published (the source, the exact text,
the GPU, what was measured and how), and sets beside it gpulab's prediction of that quantity for
the same setting: a fake-engine run following CUDA's kernels (training through ``gpulab.step``
with the recipe's options, generation through ``gpulab.predict.generation``), replayed through the
caching-allocator simulator where the published figure includes the allocator's cache. Then the
ratio (gpulab / published) and a tolerance that follows from what the published figure holds
that gpulab does not compute (the CUDA context, library workspaces, another torch version's saved
tensors, a kernel's workspace), written out for each source.

A benchmark, not a test: nothing is asserted. A row outside its tolerance prints MISS; the
closing notes of issue 23 explain each. Sources are independent of each other and of gpulab:
Hugging Face's documentation, Lightning AI's LitGPT, Alibaba's Qwen team, and PyTorch (torchao
and PyTorch's tutorials). Every figure was measured by them, on their GPUs; nothing here ran on a
GPU. A run takes about 2 minutes on a 2-core CPU. The figures, their sources and the recipes that
predict them live in ``gpulab.record.published`` (a lesson shows one with ``published_check``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.record.published import ROWS, SOURCES, Row, Source  # noqa: E402

__all__ = ["ROWS", "SOURCES", "Row", "Source", "main"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", nargs="+", choices=sorted(SOURCES), help="only these sources' rows")
    p.add_argument("--json", metavar="FILE", help="also write every row (and its source) as JSON")
    args = p.parse_args(argv)
    rows = [r for r in ROWS if not args.source or r.source in args.source]
    out, misses, t_all = [], 0, time.perf_counter()
    for key in dict.fromkeys(r.source for r in rows):
        s = SOURCES[key]
        print(f"\n== {s.title}\n   {s.where}\n   GPU: {s.gpu}\n   measured: {s.metric}\n"
              f"   tolerance {s.tolerance[0]:.2f}-{s.tolerance[1]:.2f}: {s.why}")
        print(f"   {'row':<48} {'published':>12} {'gpulab':>12} {'ratio':>6}  {'':4} seconds")
        for r in (r for r in rows if r.source == key):
            t0 = time.perf_counter()
            predicted, how = r.predict()
            seconds = time.perf_counter() - t0
            published = r.published * s.unit
            ratio = predicted / published
            ok = s.tolerance[0] <= ratio <= s.tolerance[1]
            misses += not ok
            print(f"   {r.name:<48} {r.published:>8.2f} {s.unit_name:<3} {predicted / s.unit:>8.2f} {s.unit_name:<3} "
                  f"{ratio:>6.3f}  {'ok' if ok else 'MISS':4} {seconds:5.1f}", flush=True)
            print(f"      quoted: {r.quote}\n      setting: {r.setting}\n      gpulab: {how}")
            out.append({**{k: v for k, v in asdict(r).items() if k not in ("predict", "source")}, "source": asdict(s),
                        "published_bytes": published, "predicted_bytes": predicted, "ratio": ratio,
                        "within_tolerance": ok, "how": how, "seconds": seconds})
    orgs = {r["source"]["org"] for r in out}
    print(f"\n{len(out)} rows from {len({r['source']['key'] for r in out})} sources ({len(orgs)} independent "
          f"publishers: {', '.join(sorted(orgs))}): {len(out) - misses} within "
          f"tolerance, {misses} outside; {time.perf_counter() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
