"""The speculative pipeline on one timeline: each request step's drafting, its tree's wait in the
pool and its verification beside the verifier's engine steps; the verifier's idle share, drafting
on the critical path, pre-speculation hits (definitions: docs/benchmarks/scripts.md).

    python -m bench.timeline                                     # SmolLM2-135M, batch 1 and 8
    python -m bench.timeline --model qwen2.5-coder-1.5b --dtype bfloat16 --concurrency 1 8
    python -m bench.timeline --set router.max_pending_trees=0 --tag no-backpressure
Writes bench/results/timeline-<model>-<dtype>[-<tag>].json, .md and a .png per run. Run it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan

from bench.run import RESULTS, save_report
from bench.step_time import (Interval, MODES, Probe, add_run_options, host, prepare, run_one,
                             save_quietly, span_recorder, subtract, timed_spans)
from specmesh_services.common.config import Settings

PRESPECULATED = "specmesh.prespeculated"
COLOURS = {"draft": "tab:blue", "queue": "tab:orange", "verify": "tab:green",
           "hit": "tab:red", "miss": "black"}


def parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE items -> {key: value}, each value JSON where it parses (8, 0.5, true, ["a"]),
    else the string itself; a clear error for an item without '='."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value.strip())
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


# ---------------------------------------------------------------------------------------------
# interval arithmetic (any unit: the spans' nanoseconds or a record's seconds)


def union(intervals) -> list[Interval]:
    """The intervals merged, sorted, the empty ones dropped."""
    out: list = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def clip(intervals, window) -> list:
    """The parts of the intervals inside `window`."""
    return [(max(s, window[0]), min(e, window[1])) for s, e in intervals
            if min(e, window[1]) > max(s, window[0])]


def total(intervals) -> float:
    """The time covered by any of the intervals."""
    return sum(e - s for s, e in union(intervals))


def outside(intervals, holes) -> float:
    """The time covered by the intervals and by none of the holes."""
    return sum(e - s for piece in union(intervals) for s, e in subtract(piece, holes))


def idle_share(window, busy) -> float:
    """The share of `window` in which none of the `busy` intervals runs."""
    return 1 - total(clip(busy, window)) / (window[1] - window[0])


def drafting_shares(drafts: dict, in_flight: dict, busy, window) -> dict:
    """Drafting time (per request the union of its draft intervals, in `window`) and its shares
    on the critical path (outside the request's own `in_flight` intervals) and hidden (inside a
    `busy` verifier step); the shares None without drafting."""
    pieces = {r: union(clip(d, window)) for r, d in drafts.items()}
    drafting = sum(total(p) for p in pieces.values())
    waited = sum(outside(p, in_flight.get(r, [])) for r, p in pieces.items())
    hidden = drafting - sum(outside(p, busy) for p in pieces.values())
    return {"drafting_s": drafting,
            "critical_share": waited / drafting if drafting else None,
            "hidden_share": hidden / drafting if drafting else None}


# ---------------------------------------------------------------------------------------------
# the records of a run


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def engine_steps(spans: list[ReadableSpan], jobs) -> dict[int, Interval]:
    """Each engine step's interval by `specmesh.verifier_step`: the verifier-step job inside its
    `verifier.verify` spans, their hull where no job was timed."""
    hulls: dict[int, Interval] = {}
    for s in spans:
        k = s.attributes.get("specmesh.verifier_step") if s.name == "verifier.verify" else None
        if k is not None:
            a, b = hulls.get(k, (s.start_time, s.end_time))
            hulls[k] = (min(a, s.start_time), max(b, s.end_time))
    runs = sorted((a, b) for kind, a, b in jobs if kind == "verifier-step")
    out = {}
    for k, (a, b) in hulls.items():
        out[k] = next(((s, e) for s, e in runs if a <= s and e <= b), (a, b))
    return out


def step_records(spans: list[ReadableSpan], jobs, window: Interval
                 ) -> tuple[list[dict], list[Interval]]:
    """The window's request steps (module docstring; times in seconds from the window's start)
    and the verifier's busy intervals (its verifier-step jobs, else its engine steps)."""
    def at(ns: int) -> float:
        return round((ns - window[0]) / 1e9, 6)

    requests = sorted((s for s in spans if s.name == "router.generate"),
                      key=lambda s: s.start_time)
    ordinal = {s.context.span_id: i for i, s in enumerate(requests)}
    rid = {s.context.span_id: s.attributes.get("specmesh.request_id") for s in requests}
    drafts = {(_parent(s), s.attributes.get("specmesh.step")): s for s in spans
              if s.name == "router.draft"}
    submits = {_parent(s): s for s in spans if s.name == "router.submit"}
    # pre-speculation: the next tree drafted while this step's is verified
    aheads = {_parent(s): s for s in spans if s.name == "router.draft_ahead"}
    verified = [s for s in spans if s.name == "verifier.verify"
                and "specmesh.verifier_step" in s.attributes
                and not s.attributes.get("specmesh.deferred")]
    by_parent = {_parent(s): s for s in verified}
    by_step = {(s.attributes.get("specmesh.request_id"), s.attributes.get("specmesh.step")): s
               for s in verified}
    steps = engine_steps(spans, jobs)
    records = []
    for v in sorted((s for s in spans if s.name == "router.verify" and _parent(s) in ordinal),
                    key=lambda s: s.start_time):
        request, step = _parent(v), v.attributes.get("specmesh.step")
        draft, submit = drafts.get((request, step)), submits.get(v.context.span_id)
        check = (by_parent.get(submit.context.span_id) if submit is not None else None) \
            or by_step.get((rid[request], step))
        interval = steps.get(check.attributes["specmesh.verifier_step"]) if check else None
        entered = submit.start_time if submit is not None else v.start_time
        flag = next((str(s.attributes[PRESPECULATED]) for s in (draft, v)
                     if s is not None and PRESPECULATED in s.attributes), "none")
        ahead = aheads.get(v.context.span_id)
        records.append({
            "request": ordinal[request], "request_id": rid[request], "step": step,
            "draft": [at(draft.start_time), at(draft.end_time)] if draft else None,
            "ahead": [at(ahead.start_time), at(ahead.end_time)] if ahead else None,
            "submit": at(entered),
            "queue_s": round((interval[0] - entered) / 1e9, 6) if interval else None,
            "verify": [at(interval[0]), at(interval[1])] if interval else None,
            "returned": at(v.end_time),
            "verifier_step": check.attributes["specmesh.verifier_step"] if check else None,
            "forward_s": check.attributes.get("specmesh.forward_seconds") if check else None,
            "batch_wait_s": check.attributes.get("specmesh.batch_wait_seconds") if check else None,
            "tree_size": check.attributes.get("specmesh.tree_size") if check else None,
            "accepted": check.attributes.get("specmesh.accepted") if check else None,
            "prespeculated": flag})
    busy = [(a, b) for kind, a, b in jobs if kind == "verifier-step"] or list(steps.values())
    return records, [(at(a), at(b)) for a, b in union(clip(busy, window))]


def summarize(records: list[dict], busy: list, wall_s: float) -> dict:
    """A run's verifier idle share, drafting shares, pre-speculation counts and mean draft,
    queue and verify milliseconds, from its records (seconds from the window's start)."""
    window = (0.0, wall_s)
    drafts: dict = {}
    in_flight: dict = {}
    for r in records:
        for key in ("draft", "ahead"):  # drafting ahead is drafting too (hidden when it works)
            if r.get(key):
                drafts.setdefault(r["request"], []).append(tuple(r[key]))
        in_flight.setdefault(r["request"], []).append((r["submit"], r["returned"]))
    flags = [r["prespeculated"] for r in records]

    def mean_ms(values) -> float | None:
        values = [v for v in values if v is not None]
        return 1000 * sum(values) / len(values) if values else None
    return {"verifier_idle_share": idle_share(window, busy),
            **drafting_shares(drafts, in_flight, busy, window),
            "prespeculated": {k: flags.count(k) for k in ("hit", "miss")},
            "draft_ms": mean_ms(r["draft"][1] - r["draft"][0] for r in records if r["draft"]),
            "queue_ms": mean_ms(r["queue_s"] for r in records),
            "verify_ms": mean_ms(r["verify"][1] - r["verify"][0] for r in records
                                 if r["verify"])}


# ---------------------------------------------------------------------------------------------
# the chart


def plot(records: list[dict], busy: list, window_s: float, title: str, path: Path) -> bool:
    """A Gantt chart of the first `window_s` seconds: the verifier's steps on the top lane, each
    request's draft (upper half), queue and verify (lower half) intervals on its own; False
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return False
    shown = [r for r in records if r["submit"] < window_s
             or (r["draft"] and r["draft"][0] < window_s)]
    lanes = sorted({r["request"] for r in shown})
    height = 1.9 + 0.42 * (len(lanes) + 1)  # inches: lanes, axis, title and legend
    fig, ax = plt.subplots(figsize=(14, height))
    steps = [(a, b - a) for a, b in busy if a < window_s]
    ax.broken_barh(steps, (-0.4, 0.8), facecolors=["0.3", "0.6"] * len(steps))
    for y, request in enumerate(lanes, 1):
        mine = [r for r in shown if r["request"] == request]
        bars = {"draft": [(r[k][0], r[k][1] - r[k][0]) for r in mine for k in ("draft", "ahead")
                          if r.get(k)],
                "queue": [(r["submit"], r["verify"][0] - r["submit"]) for r in mine
                          if r["verify"]],
                "verify": [(r["verify"][0], r["verify"][1] - r["verify"][0]) for r in mine
                           if r["verify"]]}
        for kind, spans in bars.items():  # drafts above the trees: a draft ahead overlaps
            ax.broken_barh(spans, (y - 0.36, 0.34) if kind == "draft" else (y + 0.02, 0.34),
                           facecolors=COLOURS[kind])
        for flag, marker in (("hit", "*"), ("miss", "x")):
            xs = [r["draft"][0] if r["draft"] else r["submit"] for r in mine
                  if r["prespeculated"] == flag]
            ax.plot(xs, [y - 0.36] * len(xs), linestyle="none", marker=marker,
                    color=COLOURS[flag], markersize=8)
    ax.set_yticks(range(len(lanes) + 1), ["verifier steps", *(f"request {r}" for r in lanes)])
    ax.set_ylim(len(lanes) + 0.6, -0.6)
    ax.set_xlim(0, window_s)
    ax.set_xlabel("seconds from the first timed prompt")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(handles=[Patch(color="0.45", label="verifier step"),
                        Patch(color=COLOURS["draft"], label="draft"),
                        Patch(color=COLOURS["queue"], label="queue (tree in the pool)"),
                        Patch(color=COLOURS["verify"], label="verify (its engine step)"),
                        Line2D([], [], linestyle="none", marker="*", color=COLOURS["hit"],
                               label="pre-speculation hit"),
                        Line2D([], [], linestyle="none", marker="x", color=COLOURS["miss"],
                               label="pre-speculation miss")],
               loc="lower center", ncol=6, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # the legend below
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# runs and the report


def run_settings(settings: Settings, mode: str, top: dict, dotted: dict,
                 overrides: dict) -> Settings:
    """A mode's settings with the `--set` overrides on top (mesh-plain keeps its own)."""
    merged = {**overrides, **dotted} if mode == "mesh-plain" else {**dotted, **overrides}
    return settings.with_overrides(**top, **merged)


def timed_run(runs, settings: Settings, batch: int, mode: str, probe: Probe) -> dict:
    """One run through the mesh: its totals, records and summary."""
    run = run_one(runs.config, runs.prompts, settings, batch, mode, probe)
    spans, window = timed_spans(probe)
    records, busy = step_records(spans, probe.compute.jobs, window)
    return {"batch": batch, "mode": mode, "tokens": run.tokens, "steps": run.steps,
            "wall_s": run.wall_s, "ms_per_step": run.ms_per_step["step"],
            "tok_s": run.tokens / run.wall_s, "tokens_per_step": run.tokens / run.steps,
            "speedup": None, **summarize(records, busy, run.wall_s),
            "load": os.getloadavg()[0], "png": None, "step_time": asdict(run),
            "verifier_steps": busy, "records": records}


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"### Timeline: {c['model']} target, {c['dtype']}, {c['target_weights']} weights, "
             f"draft {c['draft']}; {len(report['prompts'])} prompts x {c['max_tokens']} tokens; "
             f"{report['host']}, {report['date']}", "",
             f"`{report['command']}`" + (f"; settings {report['settings']}"
                                         if report["settings"] else ""), "",
             "| batch | mode | steps | ms/step | tok/s | tokens/step | speedup | verifier idle "
             "| drafting on critical path | hidden drafting | draft ms | queue ms | verify ms "
             "| pre-spec hits / misses |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        pre = r["prespeculated"]
        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['steps']} | {r['ms_per_step']:.1f} | "
            f"{r['tok_s']:.1f} | {r['tokens_per_step']:.2f} | {speedup} | "
            f"{_pct(r['verifier_idle_share'])} | {_pct(r['critical_share'])} | "
            f"{_pct(r['hidden_share'])} | {_ms(r['draft_ms'])} | {_ms(r['queue_ms'])} | "
            f"{_ms(r['verify_ms'])} | {pre['hit']} / {pre['miss']} |")
    lines += ["", "Modes: " + "; ".join(f"{k} = {v}" for k, v in MODES.items()) + ". A step is "
              "one verifier forward pass; speedup is tok/s over mesh-plain's at the same batch. "
              "Verifier idle: share of the run with no verifier step running. Drafting on the "
              "critical path: share of drafting time while the request had no tree in the pool "
              "or in verification; hidden drafting: share overlapping a verifier step. Draft, "
              "queue (tree in the pool until its engine step starts) and verify (that step) "
              "are means per request step.", ""]
    lines += [f"- b{r['batch']} {r['mode']}: load average {r['load']:.1f}, "
              + (f"chart {r['png']}" if r["png"] else "no chart") for r in report["runs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="settings applied to every run (dotted for sections)")
    parser.add_argument("--window-s", type=float, default=2.5,
                        help="seconds of the run the charts show [2.5]")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    try:  # checked before any model loads
        overrides = parse_overrides(args.set)
        Settings().with_overrides(**overrides)
    except (argparse.ArgumentTypeError, ValueError, KeyError) as err:
        parser.error(f"invalid --set: {err}")
    tag = args.tag or ("quick" if args.quick else "")
    suffix = f"-{tag}" if tag else ""
    runs = prepare(args)
    probe = Probe(span_recorder(), runs.compute)
    name = f"timeline-{args.model}-{runs.config.dtype}{suffix}"
    command = "python -m bench.timeline " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = {"host": host(), "date": time.strftime("%Y-%m-%d"), "command": command.strip(),
              "config": asdict(runs.config), "settings": overrides,
              "window_s": args.window_s, "prompts": [p.name for p in runs.prompts], "runs": []}
    for batch in args.concurrency:
        for mode in args.modes:
            top, dotted = runs.methods[mode]
            run = timed_run(runs, run_settings(runs.settings, mode, top, dotted, overrides),
                            batch, mode, probe)
            png = RESULTS / f"timeline-{args.model}-b{batch}-{mode}{suffix}.png"
            RESULTS.mkdir(parents=True, exist_ok=True)
            if plot(run["records"], run["verifier_steps"], args.window_s,
                    f"{args.model} {runs.config.dtype}, batch {batch}, {MODES[mode]}: first "
                    f"{args.window_s:g} s", png):
                run["png"] = png.name
            else:
                print("no chart: matplotlib is not installed (the `bench` extra)")
            report["runs"].append(run)
            plain = next((r for r in report["runs"]
                          if r["batch"] == batch and r["mode"] == "mesh-plain"), None)
            for r in report["runs"]:
                if plain is not None and r["batch"] == batch:
                    r["speedup"] = r["tok_s"] / plain["tok_s"]
            if len(report["runs"]) < len(args.concurrency) * len(args.modes):
                save_quietly(name, report, markdown(report))  # an interrupted run keeps its own
    save_report(name, report, markdown(report))
    runs.compute.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
