"""specmesh beside the best CPU engines: transformers, llama.cpp and vLLM's CPU build, on the same
model files, prompts (token ids) and thread count, plain and speculative, batch 1 and 8
(engines and modes: docs/benchmarks/scripts.md).

    python -m bench.peers                                 # SmolLM2-135M, 24 prompts x 128
    python -m bench.peers --model qwen2.5-coder-1.5b      # draft qwen2.5-coder-0.5b
    python -m bench.peers --quick                         # smoke run: 2 prompts x 16 tokens
    python -m bench.peers --rounds 3                      # engines alternating over 3 groups
Writes bench/results/peers-<model>[-quick][-<tag>].json, .md and .png. Run it alone.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from dataclasses import replace

from bench import peers_llama, peers_report, peers_vllm
from bench.run import RESULTS, Config, MethodResult, Prompt, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import PLAIN_DECODING, Settings
from specmesh_services.common.serving import compute_executor

ENGINES = ("transformers", "specmesh", "specmesh-ggml", "llama.cpp", "vllm")
DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # peers' draft models (same tokenizer)
# n-gram lookup as vLLM's docs example (match 2-4 tokens, draft 5); llama.cpp's lookup sizes are
# for long repeats (12 -> 48), here matched to short ones; draft models: llama-server's defaults
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
               "--spec-ngram-simple-size-m", "5"]
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}
VLLM_DRAFT_TOKENS = 5


def say(text: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {text}", flush=True)


class Bench:
    """The run's prompts, reference outputs and rows; one method per engine."""

    def __init__(self, args, config: Config, prompts: list[Prompt], eos: set[int]):
        self.args, self.config, self.prompts, self.eos = args, config, prompts, eos
        self.cache = Settings().cache_dir / "peers"
        self.logs = self.cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.reference: list[list[int]] | None = None  # transformers plain, batch 1
        self.plain: dict[str, list[list[int]]] = {}  # each engine's plain outputs, batch 1
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.ctx = max(len(p.ids) for p in prompts) + config.max_tokens + 64

    def add(self, engine: str, mode: str, batch: int, weights: str, tokens=None,
            seconds: float = 0.0, error: str | None = None, **extra) -> None:
        row = {"engine": engine, "mode": mode, "batch": batch, "weights": weights, **extra}
        if error:
            row["error"] = error
            say(f"{engine} {mode} batch {batch}: FAILED {error}")
        else:
            count = sum(map(len, tokens))
            row.update(tokens=count, seconds=seconds, tok_s=count / seconds if seconds else 0.0)
            if mode == "plain" and batch == 1:
                self.plain[engine] = tokens
            row["identical"] = self._same(tokens, self.reference)
            row["identical_to_own_plain"] = self._same(tokens, self.plain.get(engine))
            say(f"{engine} {mode} batch {batch}: {row['tok_s']:.2f} tok/s "
                f"({count} tokens in {seconds:.1f} s), same as transformers "
                f"{row['identical']}, as its plain {row['identical_to_own_plain']}")
        self.rows.append(row)

    def _same(self, tokens: list[list[int]], reference: list[list[int]] | None) -> str:
        """'k/n' outputs equal to the reference's (a final EOS aside: engines differ there)."""
        if reference is None:
            return "-"
        def strip(t: list[int]) -> list[int]:
            return t[:-1] if t and t[-1] in self.eos else t
        return f"{sum(strip(a) == strip(b) for a, b in zip(tokens, reference))}/{len(tokens)}"

    # --- transformers and specmesh, in this process ----------
    def transformers(self, compute) -> None:
        from bench.batch import run_plain
        from bench.run import run_hf_methods

        dtype = self.config.dtype
        for c in self.args.batches:
            say(f"transformers plain batch {c}")
            if c == 1:
                result = compute.submit(run_hf_methods, self.config, self.prompts,
                                        ("plain",)).result()[0]
                self.reference = result.outputs
                self.add("transformers", "plain", 1, dtype, result.outputs, result.seconds)
            else:
                result = compute.submit(run_plain, self.config, self.prompts, [c]).result()[c]
                self.add("transformers", "plain", c, dtype, result.outputs, result.seconds)

    def specmesh(self, compute, runner: str = "auto") -> None:
        """specmesh plain and with its serving defaults (auto: the target runner they pick);
        `runner` ggml: the target on llama.cpp's kernels and its GGUF file (specmesh-ggml)."""
        from bench.router import run_mesh
        from specmesh_services.verifier.server import served_runner, served_weights

        engine = "specmesh-ggml" if runner == "ggml" else "specmesh"
        settings = Settings(model=self.config.model, dtype=self.args.dtype, target_runner=runner)
        path = models.resolve(self.config.model, settings.cache_dir)
        plain = settings.with_overrides(**PLAIN_DECODING)
        for mode, mesh in (("plain", plain), ("default", settings)):
            if served_runner(mesh) == "ggml":
                weights = f"GGUF {peers_llama.quant(models.gguf_file(mesh.model, mesh.cache_dir))}"
            else:
                weights = compute.submit(served_weights, mesh, path).result()
                weights = self.config.dtype + (" + int4 (GGUF codes)" if weights == "native"
                                               else "")
            for c in self.args.batches:
                say(f"{engine} {mode} batch {c}")
                try:
                    r: MethodResult = run_mesh(self.config, self.prompts, mesh, c, compute, mode)
                    self.add(engine, mode, c, weights, r.outputs, r.seconds,
                             accepted_length=r.mean_accepted_length)
                except Exception as e:  # noqa: BLE001 - reported, the other engines still run
                    self.add(engine, mode, c, weights, error=f"{type(e).__name__}: {e}")

    # --- llama.cpp, a server per mode ----------
    def llama(self) -> None:
        try:
            start = time.perf_counter()
            bin_dir = peers_llama.build(self.cache, self.args.rebuild, log=say)
            target = models.gguf_file(self.config.model, self.cache)
            draft = DRAFTS.get(self.config.model)
            draft_gguf = models.gguf_file(draft, self.cache) if draft else None
        except Exception as e:  # noqa: BLE001
            for mode in ("plain", "draft", "ngram"):
                for c in self.args.batches:
                    self.add("llama.cpp", mode, c, "GGUF", error=f"build: {e}")
            return
        built = peers_llama.stamp(bin_dir)
        self.notes.append(f"llama.cpp from llama-cpp-python {built['version']} ({bin_dir}, built "
                          f"in {built['build_s']} s once; ready in "
                          f"{time.perf_counter() - start:.0f} s this run), GGUF {target.name}")
        modes = {"plain": [], "ngram": LLAMA_NGRAM}
        if draft_gguf:
            modes["draft"] = ["-md", draft_gguf, "--spec-type", "draft-simple",
                              "-td", self.args.threads, "-tbd", self.args.threads]
        ids = [p.ids for p in self.prompts]
        weights = f"GGUF {peers_llama.quant(target)}"
        for mode, extra in modes.items():
            for c in self.args.batches:
                say(f"llama.cpp {mode} batch {c}")
                log = self.logs / f"llama-{self.config.model}-{mode}-{c}.log"
                try:
                    with peers_llama.LlamaServer(bin_dir, target, self.args.threads, c,
                                                 self.ctx, extra, log) as server:
                        tokens, per, wall, timings = server.run(ids, self.config.max_tokens, c)
                    drafted = sum(t.get("draft_n", 0) for t in timings)
                    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
                    self.add("llama.cpp", mode, c, weights, tokens, sum(per) if c == 1 else wall,
                             draft_acceptance=accepted / drafted if drafted else None,
                             server_decode_tok_s=_decode_rate(timings), args=list(map(str, extra)))
                except Exception as e:  # noqa: BLE001
                    self.add("llama.cpp", mode, c, weights, error=f"{type(e).__name__}: {e}")

    # --- vLLM, a driver subprocess per mode ----------
    def vllm(self) -> None:
        modes = {"plain": None, "ngram": VLLM_NGRAM}
        draft = DRAFTS.get(self.config.model)
        if draft:
            modes["draft"] = {"method": "draft_model", "num_speculative_tokens": VLLM_DRAFT_TOKENS,
                              "model": str(models.resolve(draft, Settings().cache_dir))}
        try:
            python = peers_vllm.venv(self.cache, log=say)
        except Exception as e:  # noqa: BLE001
            reason = getattr(e, "stderr", "") or str(e)
            for mode in modes:
                for c in self.args.batches:
                    self.add("vllm", mode, c, self.config.dtype,
                             error=f"install: {reason.strip().splitlines()[-1][:300]}")
            return
        model_dir = str(models.resolve(self.config.model, Settings().cache_dir))
        for mode, spec in modes.items():
            say(f"vllm {mode} batches {self.args.batches}")
            job = {"model": model_dir, "dtype": self.config.dtype, "max_tokens":
                   self.config.max_tokens, "prompts": [p.ids for p in self.prompts],
                   "batches": self.args.batches, "max_model_len": self.ctx, "speculative": spec}
            log = self.logs / f"vllm-{self.config.model}-{mode}.log"
            try:
                out = peers_vllm.run(python, job, self.args.threads, log)
            except Exception as e:  # noqa: BLE001
                for c in self.args.batches:
                    self.add("vllm", mode, c, self.config.dtype,
                             error=f"{type(e).__name__}: {e} (log {log})")
                continue
            for r in out["runs"]:
                seconds = sum(r["seconds"]) if r["batch"] == 1 else r["wall"]
                self.add("vllm", mode, r["batch"], self.config.dtype, r["tokens"], seconds,
                         vllm=out["vllm"], speculative=spec,
                         draft_acceptance=r["accepted"] / r["drafted"] if r.get("drafted")
                         else None)


def _decode_rate(timings: list[dict]) -> float | None:
    """llama-server's own decode tok/s over the requests (prefill and HTTP excluded)."""
    n = sum(t.get("predicted_n", 0) for t in timings)
    ms = sum(t.get("predicted_ms", 0) for t in timings)
    return n / ms * 1000 if ms else None


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        choices=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="transformers / specmesh / vLLM dtype [auto: bf16 on this CPU]")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--mtbench", type=int, default=16, help="MT-Bench questions [16]")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval problems [8]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                        help="requests in flight [1 8]")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="threads of every engine [2]")
    parser.add_argument("--rebuild", action="store_true", help="rebuild llama.cpp")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens")
    parser.add_argument("--tag", default="", help="suffix of the result files (runs of some "
                        "--engines do not overwrite each other)")
    parser.add_argument("--rounds", type=int, default=1, help="interleave: the prompts in this "
                        "many groups (every k-th prompt), every engine over one group before "
                        "the next, each row summed over the groups, so host drift hits every "
                        "engine alike [1]")
    args = parser.parse_args(argv)
    smallest = (args.mtbench + args.humaneval) // max(1, args.rounds)
    if not args.quick and max(args.batches) > smallest:
        parser.error(f"--rounds {args.rounds} leaves {smallest} prompts in a round, fewer than "
                     f"batch {max(args.batches)} needs in flight: fewer rounds or more prompts")
    return args


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Each (engine, mode, batch) row summed over the rounds: tokens, seconds, identical counts
    and the accepted length weighted by tokens; `round_tok_s` keeps each round's rate. A round
    that failed makes the row fail."""
    merged: dict[tuple, dict] = {}
    for rows in rounds:
        for row in rows:
            key = (row["engine"], row["mode"], row["batch"])
            into = merged.get(key)
            if into is None:
                merged[key] = {**row, "round_tok_s": [row.get("tok_s")]}
                continue
            into["round_tok_s"].append(row.get("tok_s"))
            if "error" in row or "error" in into:
                into.setdefault("error", row.get("error"))
                continue
            for name in ("identical", "identical_to_own_plain"):
                into[name] = _add_counts(into.get(name, "-"), row.get(name, "-"))
            if into.get("accepted_length") is not None and row.get("accepted_length") is not None:
                into["accepted_length"] = (into["accepted_length"] * into["tokens"]
                                           + row["accepted_length"] * row["tokens"]) / (
                    into["tokens"] + row["tokens"])
            into["tokens"] += row["tokens"]
            into["seconds"] += row["seconds"]
            into["tok_s"] = into["tokens"] / into["seconds"] if into["seconds"] else 0.0
    return list(merged.values())


def _add_counts(a: str, b: str) -> str:
    """'k/n' + 'k/n' ('-' where either has no reference)."""
    if "/" not in a or "/" not in b:
        return "-"
    (ka, na), (kb, nb) = (map(int, x.split("/")) for x in (a, b))
    return f"{ka + kb}/{na + nb}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    dtype = str(models.resolve_dtype(args.dtype)).removeprefix("torch.")
    config = Config(args.model, DRAFTS.get(args.model, "layers:8"), dtype, mtbench=args.mtbench,
                    humaneval=args.humaneval, max_tokens=args.max_tokens)
    if args.quick:
        config = replace(config, mtbench=1, humaneval=1, max_tokens=16)
    compute = compute_executor()
    compute.submit(torch.set_num_threads, args.threads).result()  # the compute thread's team
    path = models.resolve(args.model, Settings().cache_dir)
    tokenizer = models.load_tokenizer(path)
    prompts = load_prompts(config, tokenizer)
    say(f"{args.model}, {dtype}: {len(prompts)} prompts x {config.max_tokens} tokens, "
        f"{args.threads} threads, engines {' '.join(args.engines)}")
    eos = set(models.eos_token_ids(path, tokenizer))
    rounds, notes = [], []
    for k in range(max(1, args.rounds)):
        if args.rounds > 1:
            say(f"round {k + 1} of {args.rounds}")
        bench = Bench(args, config, prompts[k::max(1, args.rounds)], eos)
        steps = {"transformers": lambda: bench.transformers(compute),
                 "specmesh": lambda: bench.specmesh(compute),
                 "specmesh-ggml": lambda: bench.specmesh(compute, "ggml"),
                 "llama.cpp": bench.llama, "vllm": bench.vllm}
        for engine in ENGINES:  # transformers first: its batch-1 outputs are the reference
            if engine in args.engines:
                steps[engine]()
        rounds.append(bench.rows)
        notes = notes or bench.notes
    compute.shutdown()
    rows = rounds[0] if len(rounds) == 1 else merge_rounds(rounds)
    name = (f"peers-{args.model}" + ("-quick" if args.quick else "")
            + (f"-{args.tag}" if args.tag else ""))
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "host": peers_report.host(),
              "command": "python -m bench.peers " + shlex.join(sys.argv[1:] if argv is None
                                                                else argv),
              "config": {"model": args.model, "draft": DRAFTS.get(args.model), "dtype": dtype,
                         "max_tokens": config.max_tokens, "threads": args.threads,
                         "batches": args.batches},
              "prompts": [p.name for p in prompts], "rows": rows, "notes": notes,
              "rounds": max(1, args.rounds)}
    save_report(name, report, peers_report.markdown(report))
    png = RESULTS / f"{name}.png"
    say(f"wrote {RESULTS / name}.json, .md" + (", .png" if peers_report.plot(report, png)
                                              else " (no plot: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
