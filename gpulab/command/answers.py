"""The commands' answers as text: each a view of the answer's data (its ``as_dict()``), the
table ``gpulab`` prints when ``--json`` is not given. Pure functions of dicts; no torch."""
from __future__ import annotations

from typing import Any

from gpulab.units import format_bytes
from gpulab.views import not_tensor_rows

__all__ = ["breakdown_text", "env_text", "fit_text", "longest_text", "serve_text", "step_text"]


def env_text(info: dict[str, Any]) -> str:
    lines = [f"python {info['python']}, torch {info['torch']}, torchvision {info['torchvision']}",
             f"CUDA available: {info['cuda_available']}"]
    for g in info["device"]["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, {format_bytes(g['total_bytes'])} total, "
                     f"{format_bytes(g['used_bytes'])} used, driver {g['driver']}, cc {g['compute_capability']}")
    if info["device"]["reason"]:
        lines.append(info["device"]["reason"])
    lines.append(f"lessons will use the {info['engine']} engine: {info['engine_reason']}")
    return "\n".join(lines)


def breakdown_text(d: dict[str, Any]) -> str:
    nw = max([22, *(len(r["name"]) + 2 for r in d["layers"])])
    tw = max([18, *(len(r["type"]) + 2 for r in d["layers"])])
    lines = [f"{d['model']} input {d['input_shape']} {d['dtype']}",
             f"{'layer':<{nw}}{'type':<{tw}}{'output shape':<22}{'params':>12}{'output':>12}{'GFLOP':>9}"]
    for r in d["layers"]:
        lines.append(f"{r['name']:<{nw}}{r['type']:<{tw}}{str(r['output_shape']):<22}{r['params']:>12,}"
                     f"{format_bytes(r['output_bytes']):>12}{r['flops'] / 1e9:>9.2f}")
    lines.append(f"total params {d['total_params']:,} ({format_bytes(d['param_bytes'])}), "
                 f"outputs {format_bytes(d['total_output_bytes'])}, forward {d['forward_flops'] / 1e9:.2f} GFLOP "
                 f"(formula; 1 multiply-add = 2 FLOPs)")
    return "\n".join(lines)


def step_text(d: dict[str, Any]) -> str:
    lines = [f"{d['model']} batch {d['batch']} {d['dtype']} {d['optimizer']}"
             + (f" autocast {d['amp']}" if d.get("amp") else "") + _recipe_text(d)
             + f": engine {d['engine']} ({d['engine_reason']})",
             f"input: {d['input']}",
             f"{'category':<17}{'peak (' + d['label'] + ')':>44}{'formula':>14}"]
    if d["oom"]:
        lines.append(f"out of memory: {d['error']}")
    for k, v in d.get("peak_tensor_bytes_by_category", d["peak_by_category"]).items():  # vs formulas: unrounded
        pred = d["predicted"].get(k)
        lines.append(f"{k:<17}{format_bytes(v):>44}{format_bytes(pred) if pred is not None else '—':>14}")
    lines.append(f"{'total':<17}{format_bytes(d['peak_bytes']):>44}   peak during {d['peak_phase']}")
    if len(d.get("step_peaks", [])) > 1:
        lines.append(f"{'steps':<17}" + ", ".join(f"step {i + 1}: {format_bytes(p)}" for i, p in enumerate(d["step_peaks"]))
                     + f"  (from step 2 on the optimizer state is held: the steady state is "
                       f"{format_bytes(d['steady_peak_bytes'])})")
    if d.get("compiled"):
        c = d["compiled"]
        lines.append(f"{'compiled':<17}" + ", ".join(f"step {i + 1}: {format_bytes(p)}" for i, p in
                                                   enumerate(c["inductor_step_peaks"]))
                     + f"  by {c['label']}; total {format_bytes(c['bound_bytes'])} above is {c['bound_label']}")
    if "allocator" in d:
        a = d["allocator"]
        if "allocator_blocks" in d:
            lines.append(f"{'peak':<17}{format_bytes(d['allocator_blocks']['peak_bytes']):>44}   "
                         f"{d['allocator_blocks']['label']}")
        lines.append(f"allocator, this run (from a baseline of {format_bytes(a['baseline_allocated'])} allocated): "
                     f"peak allocated +{format_bytes(a['peak_allocated_delta'])}, "
                     f"peak reserved +{format_bytes(a['peak_reserved_delta'])}; nvml used (whole device) "
                     f"{format_bytes(a['nvml_used']) if a['nvml_used'] is not None else 'n/a'}")
        b = d["beyond_tensors"]
        lines.append(f"{b['label']}: {format_bytes(b['bytes'])}")
        lines.append(f"{b['kept_label']}: {format_bytes(b['kept_after_run'])}")
        lines += [f"{k}: {v}" for k, v in not_tensor_rows(b.get("not_tensors"))]
    if d.get("kernels_note"):
        lines.append(f"kernels: {d['kernels_note']}")
    if d.get("mesh"):   # one rank of a layout: its mesh, torchtitan's ParallelDims names (Layout.mesh)
        lines.append(f"layout: {d['mesh']}")
    lines += [f"layout: {note['text']}" for note in d.get("recipe", {}).values() if isinstance(note, dict)]
    if d.get("cudnn_workspace_label"):
        found = d.get("cudnn_workspace_bytes")
        lines.append(f"{d['cudnn_workspace_label']}" + (f": {format_bytes(found)}, peak with them "
                                                         f"{format_bytes(d['peak_with_workspaces_bytes'])}" if found else ""))
    if d.get("time"):
        lines += d["time"]["lines"]
    return "\n".join(lines)


def _recipe_text(d: dict[str, Any]) -> str:
    """", accumulate=4, clip_grad_norm=1.0": the recipe options a result was measured with."""
    return "".join(f", {k}={v}" for k, v in d.get("recipe", {}).items() if not isinstance(v, dict))   # a layout's notes: in the label


def fit_text(d: dict[str, Any]) -> str:
    lines = [f"{d['model']} on {d['card']} ({format_bytes(d['capacity_bytes'])}), {d['optimizer']}, {d['dtype']}"
             + (f", autocast {d['amp']}" if d["amp"] else "") + _recipe_text(d) + f": {d['input_text']}"]
    if d.get("capacity_note"):
        lines.append(f"card total: {d['capacity_note']}")
    if d.get("sharding"):
        lines.append(f"on {d['sharding']}: the figures below are one GPU's, the batch is per GPU "
                     f"[{d['sharding_label']}]")
    if d["largest_batch"]:
        lines.append(f"largest batch that fits: {d.get('largest_batch_text', d['largest_batch'])}"
                     + (f" (live tensors alone would allow {d['largest_batch_live']})"
                        if d.get("largest_batch_live") and d["largest_batch_live"] != d["largest_batch"] else ""))
    else:
        lines.append(f"batch 1 does not fit: short by {format_bytes(-d['margin_bytes'])}")
    lines.append(f"{'at batch ' + str(max(1, d['largest_batch'])):<26}{'bytes':>12}")
    for k, v in d["peak_by_category"].items():
        if v:
            lines.append(f"  {k:<24}{format_bytes(v):>12}")
    lines += [f"  {'live tensors (peak)':<24}{format_bytes(d['peak_bytes']):>12}   {d['label'].split(' + ')[0]}",
              f"  {'allocator overhead':<24}{format_bytes(d['allocator_overhead_bytes']):>12}   {d['allocator_label']}",
              f"  {'CUDA context':<24}{format_bytes(d['context_bytes']):>12}   {d['context_label']}",
              f"  {'cuBLAS workspaces':<24}{format_bytes(d.get('workspace_bytes', 0)):>12}   "
              f"{d.get('workspace_label', '')}",
              f"  {'needed':<24}{format_bytes(d['needed_bytes']):>12}",
              f"  {'margin':<24}{format_bytes(d['margin_bytes']):>12}   of {format_bytes(d['capacity_bytes'])}"]
    for lever in d["levers"]:
        lines.append(f"  if {lever['name']}: {format_bytes(lever['peak_bytes'])} at batch 1 "
                     f"({'fits' if lever['fits'] else 'still too big'}) [{lever['label']}: {lever['formula']}]")
    lines.append(f"how: {d['method']}; {d['runs']} fake runs, {d['seconds']:.1f} s")
    if d.get("mesh"):   # a layout's mesh, torchtitan's ParallelDims names (Layout.mesh)
        lines.append(f"layout: {d['mesh']}")
    lines += [f"layout: {note['text']}" for note in d.get("recipe", {}).values() if isinstance(note, dict)]
    lines += [part for part in d["label"].split("; ") if part.startswith("MoE ")]   # how the experts ran
    if d.get("ranks"):   # pipeline stages: each that differs, at the pipeline's micro-batch
        lines.append(f"pipeline: {d['pipeline']}")
        lines += _stage_lines(d["ranks"], d["largest_batch"])
    if d.get("kernels"):
        lines.append(f"kernels: {d['kernels']}")
    if d.get("context_warning"):
        lines.append(f"warning: {d['context_warning']}")
    lines += _time_lines(d, f"at batch {max(1, d['largest_batch'])}")
    if d.get("what_fits"):
        lines += _what_fits_lines(d["what_fits"])
    return "\n".join(lines)


def _time_lines(d: dict[str, Any], where: str) -> list[str]:
    """An answer's predicted time (``predict.plan_time`` / ``serve_time``), or why there is none."""
    if d.get("time"):
        head, *rest = d["time"]["lines"]
        return [f"{head} ({where})" if head.startswith("step time") else head, *rest]
    return [f"time: not predicted ({d['time_note']})"] if d.get("time_note") else []


def _stage_lines(rows: list[dict[str, Any]], batch: int) -> list[str]:
    """One line per pipeline stage shape of a fit answer (predict.pipeline_fit.StageFit)."""
    out = []
    for r in rows:
        head = (f"  stage {', '.join(map(str, r['stages']))} ({r['role']}{', binds' if r['binds'] else ''}): "
                f"{r['ranks']}; {r['holds']}; {r['in_flight']} micro-batch{'es' if r['in_flight'] != 1 else ''} "
                f"in flight")
        if r["peak_bytes"] is None:
            out.append(f"{head}: {r['note']}")
        else:
            out.append(f"{head}: at micro-batch {max(1, batch)} live {format_bytes(r['peak_bytes'])}, reserved "
                       f"{format_bytes(r['reserved_bytes'])}" + (f" ({r['note']})" if r["note"] else ""))
    return out


def longest_text(d: dict[str, Any]) -> str:
    head = (f"{d['model']} on {d['card']}: the longest context for {d['batch']} sequences is "
            f"{d['context_len']:,} tokens, limited by {d['limit']} ({d['runs']} serving answers)")
    if d["at"] is None:
        return head + "\n" + serve_text(d["beyond"])
    return head + "\n" + serve_text(d["at"])


def serve_text(d: dict[str, Any]) -> str:
    row = "  {:<44}{:>12}   {}"
    lines = [f"{d['model']} on {d['card']} ({format_bytes(d['capacity_bytes'])}), weights {d['weights']}, KV cache "
             f"{d['kv_dtype']}: {d['batch']} × {d['context_len']:,} tokens "
             + ("fits" if d["fits"] else "does not fit"),
             row.format("weights", format_bytes(d["weights_bytes"]), d["label"]),
             row.format(f"KV cache ({format_bytes(d['kv_per_token_bytes'])} per token)",
                        format_bytes(d["kv_cache_bytes"]), d["kv_label"]),
             f"  KV cache assumption: {d.get('kv_assumption', '')}",
             *([f"  positions: {d['positions_note']}"] if d.get("positions_note") else []),
             *([f"  experts: {d['experts_note']}"] if d.get("experts_note") else []),
             row.format("prefill, one sequence (peak)", format_bytes(d["prefill_one_bytes"]), d["label"]),
             row.format(f"prefill, all {d['batch']} at once (peak)", format_bytes(d["prefill_all_bytes"]), d["label"]),
             row.format("last decode step, all (peak)", format_bytes(d["decode_bytes"]), d["kv_label"]),
             row.format("needed, prefilling one at a time", format_bytes(d["needed_one_at_a_time_bytes"]), ""),
             row.format("needed, prefilling all at once", format_bytes(d["needed_all_at_once_bytes"]), ""),
             row.format("CUDA context", format_bytes(d["context_bytes"]), d["context_label"]),
             row.format("cuBLAS workspace", format_bytes(d.get("workspace_bytes", 0)), "formula (CublasHandlePool.cpp)"),
             row.format("usable (card - CUDA context - cuBLAS workspace)", format_bytes(d["usable_bytes"]), ""),
             f"vLLM-style at {d['utilization']:.0%}: {d['paged_blocks']:,} blocks of {d['block_size']} tokens, "
             f"{d['max_sequences']} sequences of {d['context_len']:,} tokens at once [{d['paged_label']}]",
             f"how: fake runs of the model's forward at full size, {d['seconds']:.1f} s"]
    if d.get("kernels"):
        lines.append(f"kernels: {d['kernels']}")
    if d.get("capacity_note"):
        lines.insert(1, f"card total: {d['capacity_note']}")
    if d.get("context_warning"):
        lines.append(f"warning: {d['context_warning']}")
    lines += _time_lines(d, "")
    return "\n".join(lines)


def _what_fits_lines(d: dict[str, Any]) -> list[str]:
    lines = [f"what fits at batch {d['batch']} ({d['label']}): the asked recipe needs "
             f"{format_bytes(d['asked_reserved_bytes'])} ({'fits' if d['asked_fits'] else 'does not fit'})"]
    timed = [t for t in d["tried"] if t.get("time")]
    if d.get("asked_time"):
        lines.append(f"  the asked recipe: {_speed_text(d['asked_time'])}")
    if timed:
        label = timed[0]["time"]["label"]
        lines.append(f"  ranked by step time, {label}, fastest first:")
    order = sorted(d["tried"], key=lambda t: (not t["fits"], t["time"]["seconds"] if t.get("time") else 0.0))
    for t in order:
        lines.append(f"  {'fits' if t['fits'] else 'no  '}  {format_bytes(t['reserved_bytes']):>10}  "
                     f"saves {format_bytes(t['saved_bytes']):>10}  "
                     + (f"{_speed_text(t['time'])}  " if t.get("time") else "")
                     + f"{t['name']}  [{t['cost']}]")
    lines += [f"  left out, the layout cannot take it: {why}" for why in d.get("left_out", [])]
    if not d["fitting"]:
        lines.append("  nothing tried fits: a larger card, or several GPUs")
    if d.get("fastest"):
        f = d["fastest"]
        lines.append(f"  fastest plan that fits: {f['name']} ({_speed_text(f['time'])})")
    if timed or d.get("asked_time"):
        a = (timed[0] if timed else {"time": d["asked_time"]})["time"]["assumptions"]
        lines.append(f"  time assumptions: compute efficiency {a['compute_efficiency']:g}, memory efficiency "
                     f"{a['memory_efficiency']:g}, launch overhead {a['launch_overhead_s'] * 1e6:g} µs per kernel "
                     f"({a['source']}); each timed at its full depth from two small timed fake runs")
    elif d.get("time_note"):
        lines.append(f"  time: not predicted ({d['time_note']})")
    return lines


def _speed_text(t: dict[str, Any]) -> str:
    """"412.3 ms, 9,934 tokens/s, MFU 51.6%": a predicted step in brief."""
    return f"{t['seconds'] * 1e3:,.1f} ms, {t['items_per_s']:,.0f} {t['unit']}/s, MFU {t['mfu']:.1%}"


def fastest_layouts_text(d: dict[str, Any]) -> str:
    """``gpulab fit --fastest --gpus N``: every plan run, fastest first, then those left out and why
    (with the recipes searched: the pairs not run, counted and named)."""
    recipe = ", ".join(f"{k} {v}" for k, v in d["recipe"].items() if v is not None)
    plans = "recipes × layouts" if "recipes" in d else "layout"
    head = (f"{d['pairs']} layout × recipe pairs, {d['tried']} run, {len(d['ranked'])} fit, {d['pruned_memory']} "
            f"pruned by memory, {d['pruned_time']} by time, {d['refused']} refused, {d['cost_bound']} past the cost "
            f"bound" if "recipes" in d else f"{d['tried']} layouts tried, {len(d['ranked'])} fit")
    width = max([52] + [len(p["name"]) + 2 for p in d["plans"]])
    lines = [f"{d['model']} on {d['gpus']} × {d['card']} ({recipe}): the fastest {plans} that fits, {head}, "
             f"{len(d['skipped'])} layouts left out; {d['seconds']:.1f} s",
             f"  each: {d['label']}",
             f"  {'plan' if 'recipes' in d else 'layout':<{width}}{'batch':>7}{'reserved':>12}{'step ms':>10}"
             f"{'tokens/s':>13}{'MFU':>7}   compute (TP comm inside it) | TP comm | DP comm exposed | bubble (ms)"]
    by_name = {p["name"]: p for p in d["plans"]}
    for name in d["ranked"]:
        p, t = by_name[name], by_name[name]["time"]
        batch = f"{p['largest_batch']}" + (f"×{p['microbatches']}" if p["microbatches"] else "")
        tp_comm = t["rank"].get("comm_seconds", 0.0) * (p["microbatches"] or 1)
        lines.append(f"  {name:<{width}}{batch:>7}{format_bytes(p['reserved_bytes']):>12}{t['seconds'] * 1e3:>10,.1f}"
                     f"{t['items_per_s']:>13,.0f}{t['mfu']:>7.1%}   {t['compute_seconds'] * 1e3:,.1f} | "
                     f"{tp_comm * 1e3:,.1f} | {t['exposed_comm_seconds'] * 1e3:,.1f} | {t['bubble_seconds'] * 1e3:,.1f}")
    for p in d["plans"]:
        if not p["fits"]:
            lines.append(f"  does not fit: {p['name']}, needs {format_bytes(p['needed_bytes'])} of "
                         f"{format_bytes(p['capacity_bytes'])} at batch 1")
        elif not p["timed"]:
            lines.append(f"  fits at batch {p['largest_batch']}, not timed: {p['name']} ({p['note']})")
    if d["fastest"]:
        f = d["fastest"]
        lines.append(f"fastest: {f['name']} ({f['mesh']}), batch {f['largest_batch']} a GPU"
                     + (f" × {f['microbatches']} micro-batches" if f["microbatches"] else ""))
        lines += [f"  {line}" for line in f["time"]["lines"]]
    else:
        lines.append("no layout tried fits: a larger card, more GPUs, or a recipe that saves memory (--what-fits)")
    lines += _pruned_lines(d) if "recipes" in d else []
    lines.append("layouts left out:" if "recipes" in d else "left out:")
    lines += [f"  {s['what']}: {s['why']}" for s in d["skipped"]]
    lines.append("assumptions:")
    lines += [f"  {k}: {v}" for k, v in d["assumptions"].items()]
    return "\n".join(lines)


def _pruned_lines(d: dict[str, Any]) -> list[str]:
    """The recipes searched and the layout × recipe pairs not run, by why (``predict.fastest_plans``)."""
    lines = [f"recipes searched: {', '.join(d['recipes'])}"]
    lines += [f"  recipe left out: {why}" for why in d["recipes_left_out"]]
    for bound, what in (("time", "pruned by time: tokens/s at any batch bounded (plan_bounds) at or below the "
                                 "fastest found"),
                        ("memory", "pruned by memory: weights, gradients and optimizer state alone pass the card "
                                   "(a formula floor)"),
                        ("refused", "refused: the layout cannot take the change"),
                        ("cost", "not tried, the cost bound")):
        rows = [p for p in d["pruned"] if p["bound"] == bound]
        if rows and bound == "time":
            lines.append(f"{what}:")
            lines += [f"  {p['recipe']} on {p['layout']}: at most {p['rate']:,.0f}" for p in rows]
        elif rows:   # one line per recipe and reason, its layouts named
            lines.append(f"{what}:")
            groups: dict[tuple[str, str], list[str]] = {}
            for p in rows:
                groups.setdefault((p["recipe"], p["why"]), []).append(p["layout"])
            lines += [f"  {rec} on {'; '.join(lays)}: {why}" for (rec, why), lays in groups.items()]
    return lines
