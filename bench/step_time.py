"""Where a served step's time goes: the target's forward (attention and the rest), the tree walk,
drafting, the router, the pool and hops, the batch-forming wait and the rest, at batch 1 and 8,
speculation on and off; every instant of the run goes to one part (docs/benchmarks/scripts.md).

    python -m bench.step_time                                  # SmolLM2-135M, batch 1 and 8
    python -m bench.step_time --model qwen2.5-coder-1.5b --dtype bfloat16
    python -m bench.step_time --quick                          # smoke run: 4 prompts x 32 tokens
Writes bench/results/step-time-<model>[-<runner>][-quick].json and .md. Run it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field, replace

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.router import ablation, base_settings, drafts_of, run_mesh, served_config
from bench.run import RESULTS, Config, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.serving import compute_executor

MODES = {"default": "speculation (serving defaults)",
         "mesh-plain": "speculation off (depth 0, no lookup)"}
# the compute thread's labels (its jobs never overlap); they win over the event loop's
COMPUTE = ("verifier-step", "verifier-other", "drafting", "compute-other")
ROWS = [("forward", "target forward"), ("attention", "  attention (backend kernel)"),
        ("forward-rest", "  rest of the forward"), ("walk", "sampling / tree walk + KV commit"),
        ("verifier-other", "verifier other (planning, load, release)"),
        ("drafting", "drafting"), ("router", "router"), ("hops", "pool and hops"),
        ("batch-wait", "verifier batch-forming wait"), ("other", "other")]
TOP = [key for key, _ in ROWS if key not in ("attention", "forward-rest")]

Interval = tuple[int, int]  # [start, end) in time.time_ns(), the clock of the spans


# ---------------------------------------------------------------------------------------------
# instruments


def span_recorder() -> InMemorySpanExporter:
    """Keeps this process's finished spans in memory (on the global tracer provider, installed
    here if there is none yet)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def job_kind(fn) -> str:
    """Which part a compute-thread job belongs to, from the function the service submitted."""
    module, name = getattr(fn, "__module__", "") or "", getattr(fn, "__name__", "")
    if module.startswith("specmesh_services.verifier"):
        return "verifier-step" if name == "step_entries" else "verifier-other"
    if module.startswith(("specmesh_services.drafter", "specmesh_services.datastore")):
        return "drafting"
    return "compute-other"


class TimedExecutor(Executor):
    """The compute executor, every job's interval recorded: one thread runs all model work, so
    the jobs never overlap and each is the compute thread's time for its part."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.jobs: list[tuple[str, int, int]] = []  # (kind, start, end)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        kind = job_kind(fn)

        def timed():
            start = time.time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.jobs.append((kind, start, time.time_ns()))
        return self.inner.submit(timed)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait, cancel_futures=cancel_futures)


class TimedAttention:
    """An attention backend with the seconds of its `attend` calls summed (both target runners
    call the backend through `PackedTarget.backend`). On CUDA each call is synchronized, which
    slows the forward it measures."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.seconds = 0.0
        self.calls = 0

    def attend(self, query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if query.is_cuda:
            torch.cuda.synchronize(query.device)
        start = time.perf_counter()
        out = self.backend.attend(query, *args, **kwargs)
        if query.is_cuda:
            torch.cuda.synchronize(query.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


@dataclass
class Probe:
    """What one timed run leaves: spans, compute jobs, attention time, the runner served."""

    spans: InMemorySpanExporter
    compute: TimedExecutor
    attention: TimedAttention | None = None
    start_ns: int = 0
    runner: str = ""

    def on_start(self, mesh) -> None:
        """Called by run_mesh after the warm-up: forget it, time the attention from here on."""
        target = mesh.worker.engine.target
        if hasattr(target, "backend"):  # the torch target; llama.cpp's attention is in its decode
            self.attention = TimedAttention(target.backend)
            target.backend = self.attention
            self.runner = "lean" if getattr(target, "lean", None) is not None else "transformers"
        else:
            self.runner = "ggml"
        self.spans.clear()
        self.compute.jobs.clear()
        self.start_ns = time.time_ns()


# ---------------------------------------------------------------------------------------------
# the timeline


def subtract(outer: Interval, holes: list[Interval]) -> list[Interval]:
    """The parts of `outer` outside every hole."""
    out, at = [], outer[0]
    for start, end in sorted(holes):
        if start > at:
            out.append((at, min(start, outer[1])))
        at = max(at, end)
    if at < outer[1]:
        out.append((at, outer[1]))
    return [(s, e) for s, e in out if e > s]


def timeline(window: Interval, layers: dict[str, list[Interval]]) -> dict[str, float]:
    """Seconds of `window` per label: each instant goes to the first label (in `layers`' order)
    with an interval covering it, to "other" where none does. Sums to the window."""
    order = list(layers)
    events = []
    for rank, label in enumerate(order):
        for start, end in layers[label]:
            start, end = max(start, window[0]), min(end, window[1])
            if end > start:
                events += [(start, 1, rank), (end, -1, rank)]
    events.sort()
    active = [0] * len(order)
    out = dict.fromkeys([*order, "other"], 0)
    at = window[0]
    for t, delta, rank in events:
        if t > at:
            top = next((i for i, n in enumerate(active) if n), None)
            out["other" if top is None else order[top]] += t - at
            at = t
        active[rank] += delta
    out["other"] += window[1] - at
    return {label: ns / 1e9 for label, ns in out.items()}


def _interval(span: ReadableSpan) -> Interval:
    return span.start_time, span.end_time


def timed_spans(probe: Probe) -> tuple[list[ReadableSpan], Interval]:
    """The timed run's finished spans and its window: the first timed prompt to the last
    answer."""
    spans = [s for s in probe.spans.get_finished_spans() if s.start_time >= probe.start_ns]
    return spans, (probe.start_ns, max(s.end_time for s in spans if s.name == "router.generate"))


def split(probe: Probe) -> dict:
    """The timed run's parts in seconds, the steps and the checks."""
    spans, window = timed_spans(probe)
    requests = [s for s in spans if s.name == "router.generate"]
    waits: dict[int, list[Interval]] = {}  # router.generate span id -> its draft / verify waits
    for s in spans:
        if s.name in ("router.draft", "router.verify") and s.parent is not None:
            waits.setdefault(s.parent.span_id, []).append(_interval(s))
    steps: dict[int, ReadableSpan] = {}  # one verifier.verify span per engine step
    for s in spans:
        if s.name == "verifier.verify" and "specmesh.verifier_step" in s.attributes:
            steps.setdefault(s.attributes["specmesh.verifier_step"], s)
    layers = {kind: [(a, b) for k, a, b in probe.compute.jobs if k == kind] for kind in COMPUTE}
    layers["router"] = [piece for r in requests
                        for piece in subtract(_interval(r), waits.get(r.context.span_id, []))]
    layers["batch-wait"] = [(s.start_time - int(s.attributes["specmesh.batch_wait_seconds"] * 1e9),
                             s.start_time) for s in steps.values()]
    layers["hops"] = [w for ws in waits.values() for w in ws]
    seconds = timeline(window, layers)
    forward = sum(s.attributes["specmesh.forward_seconds"] for s in steps.values())
    walk = sum(s.attributes["specmesh.walk_seconds"] for s in steps.values())
    attention = probe.attention.seconds if probe.attention and probe.attention.calls else None
    parts = {"forward": forward, "attention": attention,
             "forward-rest": forward - attention if attention is not None else None,
             "walk": walk,
             "verifier-other": seconds["verifier-step"] - forward - walk
             + seconds["verifier-other"],
             "drafting": seconds["drafting"], "router": seconds["router"],
             "hops": seconds["hops"], "batch-wait": seconds["batch-wait"],
             "other": seconds["other"] + seconds["compute-other"]}
    wall = (window[1] - window[0]) / 1e9
    assert abs(sum(parts[k] for k in TOP) - wall) <= 1e-6 * wall, "the parts partition the run"
    return {"wall_s": wall, "steps": len(steps),
            "rows": sum(s.attributes["specmesh.step_rows"] for s in steps.values()),
            "parts_s": parts,
            "checks": {
                "measured_parts_over_step": 1 - parts["other"] / wall,
                "engine_timers_over_its_compute_jobs": (forward + walk) / seconds["verifier-step"]
                if seconds["verifier-step"] else None,
                "router_s_incl_overlapped": _covered(layers["router"], window)}}


def _covered(intervals: list[Interval], window: Interval) -> float:
    """Seconds of `window` covered by any of the intervals."""
    return timeline(window, {"x": intervals})["x"]


# ---------------------------------------------------------------------------------------------
# runs


@dataclass
class Run:
    batch: int
    mode: str  # an ablation method of bench.router: default / mesh-plain
    wall_s: float
    steps: int
    rows: int
    tokens: int
    request_steps: int  # router steps (target forwards as the requests count them)
    draft_tokens: int  # tree nodes verified
    plain_steps: int  # request steps that verified no tree (adaptive sizing chose 0)
    timed_s: float  # the run's time as run_mesh measured it (the window's cross-check)
    parts_s: dict
    checks: dict
    load: float  # the machine's 1-minute load average at the end (others' work slows it)
    ms_per_step: dict = field(default_factory=dict)
    share: dict = field(default_factory=dict)
    not_forward_share: float = 0.0

    def __post_init__(self) -> None:
        per = 1000 / self.steps if self.steps else 0.0
        self.ms_per_step = {k: v * per if v is not None else None for k, v in self.parts_s.items()}
        self.ms_per_step["step"] = self.wall_s * per
        self.share = {k: v / self.wall_s if v is not None else None
                      for k, v in self.parts_s.items()}
        self.not_forward_share = 1 - self.share["forward"]
        self.checks["wall_over_timed"] = self.wall_s / self.timed_s if self.timed_s else None


def run_one(config: Config, prompts, settings: Settings, batch: int, mode: str,
            probe: Probe) -> Run:
    """The prompts through a mesh of `settings` at `batch` in flight, split into parts."""
    result = run_mesh(config, prompts, settings, batch, probe.compute, mode, probe.on_start)
    found = split(probe)
    return Run(batch, mode, found["wall_s"], found["steps"], found["rows"], result.tokens,
               result.target_forwards, result.draft_tokens, result.plain_steps, result.seconds,
               found["parts_s"], found["checks"], os.getloadavg()[0])


def host() -> str:
    """The CPU's model name and core count (lscpu), else the platform's processor string."""
    try:
        info = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
            if ":" in line)
        return f"{info['Model name'].strip()}, {info['CPU(s)'].strip()} CPUs"
    except (OSError, subprocess.CalledProcessError, KeyError):
        import platform
        return platform.processor() or platform.machine()


def markdown(report: dict) -> str:
    c = report["config"]
    runner = report["runner_served"] + (" (asked)" if report["target_runner"] else " (default)")
    lines = [f"### Step time: {c['model']} target, {c['dtype']}, {c['target_weights']} weights, "
             f"{runner} target runner, draft {report['drafts'][0]}; {len(report['prompts'])} "
             f"prompts x {c['max_tokens']} tokens; {report['host']}, {report['date']}"]
    for batch in sorted({r["batch"] for r in report["runs"]}):
        runs = [r for r in report["runs"] if r["batch"] == batch]
        head = " | ".join(f"{MODES[r['mode']]}: ms/step | share" for r in runs)
        lines += ["", f"Batch {batch}:", "", f"| part | {head} |",
                  "|---|" + "---:|---:|" * len(runs)]
        for key, label in [*ROWS, ("step", "**step**")]:
            cells = []
            for r in runs:
                ms = r["ms_per_step"].get(key)
                share = r["share"].get(key, 1.0 if key == "step" else None)
                cells += ["-" if ms is None else f"{ms:.2f}",
                          "-" if share is None else f"{100 * share:.1f}%"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("| not the forward | " + " | ".join(
            f"| {100 * r['not_forward_share']:.1f}%" for r in runs) + " |")
        for r in runs:
            ch = r["checks"]
            lines.append(
                f"\n{MODES[r['mode']]}: {r['steps']} steps, {r['rows'] / r['steps']:.1f} rows and "
                f"{r['tokens'] / r['steps']:.2f} tokens per step, {r['tokens'] / r['wall_s']:.1f} "
                f"tok/s, accepted length {r['tokens'] / r['request_steps']:.2f} "
                f"({r['draft_tokens']} drafted nodes, {r['plain_steps']} of "
                f"{r['request_steps']} request steps plain), load average "
                f"{r.get('load', float('nan')):.1f}. Checks: the measured parts "
                f"(all but other) sum to {100 * ch['measured_parts_over_step']:.1f}% of the "
                f"step, the run is "
                f"{100 * ch['wall_over_timed']:.1f}% of run_mesh's own timing of it, the "
                f"engine's forward + walk timers are "
                f"{100 * (ch['engine_timers_over_its_compute_jobs'] or 0):.1f}% of its "
                f"compute-thread jobs; the router ran {ch['router_s_incl_overlapped']:.2f} s, "
                f"{r['parts_s']['router']:.2f} s of it while the compute thread was idle.")
    lines += ["", "A step is one verifier forward pass. Each instant of the run is counted once, "
              "for the first part active then: compute (forward, walk, verifier other, "
              "drafting), router, batch wait, pool and hops; other = none of them (gateway, "
              "event-loop scheduling). The embedded mesh's hops are in-process calls and an "
              "in-memory pool, not gRPC and Redis."]
    return "\n".join(lines) + "\n"


def save_quietly(name: str, report: dict, text: str | None = None) -> None:
    """The report so far (its table `text`, by default this module's), nothing printed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown(report) if text is None else text)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of the timed runs of the embedded mesh (the target, its draft, the prompts,
    the batch sizes and modes)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--draft", help="the draft model [the model's serving default: "
                        "smollm2 layers:8, qwen 1.5b the 0.5b@auto]")
    parser.add_argument("--target-weights", default="auto", choices=["auto", "float", "native"])
    parser.add_argument("--mtbench", type=int, default=6, help="MT-Bench questions [6]")
    parser.add_argument("--humaneval", type=int, default=2, help="HumanEval problems [2]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                        help="requests in flight = verifier.batch_size [1 8]")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens")


@dataclass
class Runs:
    """What the timed runs share: the config, base settings, prompts, each mode's overrides
    (bench.router's ablation) and the timed compute executor."""

    config: Config
    settings: Settings
    prompts: list
    methods: dict[str, tuple[dict, dict]]
    compute: TimedExecutor


def prepare(args: argparse.Namespace) -> Runs:
    """The runs `add_run_options`' options ask for, the prompts tokenized."""
    defaults = Settings().speculation
    drafts = drafts_of(args.model)
    source = models.REGISTRY.get(args.model)
    draft = args.draft or (source.default_draft if source else drafts[0])  # what `up` serves
    drafts = (draft, drafts[1])
    compute = TimedExecutor(compute_executor())
    config = served_config(args.model, args.dtype, args.target_weights, drafts[0], compute,
                           depth=defaults.depth, width=defaults.width, mtbench=args.mtbench,
                           humaneval=args.humaneval, max_tokens=args.max_tokens)
    if args.quick:
        config = replace(config, mtbench=3, humaneval=1, max_tokens=32)
    settings = base_settings(config, defaults.min_probability)
    prompts = load_prompts(config, models.load_tokenizer(models.resolve(config.model,
                                                                        settings.cache_dir)))
    methods = {name: (top, dotted) for name, top, dotted in ablation(drafts, defaults.max_nodes,
                                                                    args.model)}
    return Runs(config, settings, prompts, methods, compute)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser)
    parser.add_argument("--target-runner", choices=["lean", "transformers", "ggml"],
                        help="the target's forward (Settings.target_runner, where this version "
                             "has it) [the serving default]")
    args = parser.parse_args(argv)
    runs = prepare(args)
    config, settings, prompts, methods, compute = (runs.config, runs.settings, runs.prompts,
                                                   runs.methods, runs.compute)
    if args.target_runner and "target_runner" in Settings.model_fields:
        settings = settings.with_overrides(target_runner=args.target_runner)
    elif args.target_runner:
        print(f"this version has no Settings.target_runner: --target-runner "
              f"{args.target_runner} ignored")
    probe = Probe(span_recorder(), compute)
    name = (f"step-time-{args.model}" + (f"-{args.target_runner}" if args.target_runner else "")
            + ("-quick" if args.quick else ""))
    report = {"host": host(), "date": time.strftime("%Y-%m-%d"), "config": asdict(config),
              "drafts": [config.draft], "target_runner": args.target_runner,
              "prompts": [p.name for p in prompts], "runs": []}
    for batch in args.concurrency:
        for mode in args.modes:
            top, dotted = methods[mode]
            run = run_one(config, prompts, settings.with_overrides(**top, **dotted), batch, mode,
                          probe)
            report["runner_served"] = probe.runner
            report["runs"].append(asdict(run))
            if len(report["runs"]) < len(args.concurrency) * len(args.modes):
                save_quietly(name, report)  # an interrupted run keeps what it did
    save_report(name, report, markdown(report))
    compute.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
