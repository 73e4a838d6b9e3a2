"""bench/peers.py's report: the host (lscpu), a markdown table of tok/s per engine x mode x batch
with ratios to llama.cpp plain and to transformers plain, and a bar plot of the same."""
from __future__ import annotations

import subprocess
from pathlib import Path


def host() -> dict:
    """CPU model, cores and the ISA flags that decide the kernels (lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
             if f in info.get("Flags", "").split()]
    return {"cpu": info.get("Model name", "?"), "cpus": info.get("CPU(s)", "?"),
            "hypervisor": info.get("Hypervisor vendor", ""), "flags": flags}


def _find(rows: list[dict], engine: str, mode: str, batch: int) -> float | None:
    return next((r["tok_s"] for r in rows if (r["engine"], r["mode"], r["batch"])
                 == (engine, mode, batch) and r.get("tok_s")), None)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def _speculation(row: dict) -> str:
    if row.get("accepted_length") and row["mode"] != "plain":  # specmesh
        return f"{row['accepted_length']:.2f} tokens/pass"
    if row.get("draft_acceptance") is not None:  # llama.cpp, vLLM
        return f"{row['draft_acceptance']:.0%} of drafts accepted"
    return ""


def markdown(report: dict) -> str:
    rows, h, c = report["rows"], report["host"], report["config"]
    lines = [f"### {c['model']}" + (f" (draft {c['draft']})" if c.get("draft") else "")
             + f": {len(report['prompts'])} prompts x {c['max_tokens']} new tokens, greedy, "
             f"{c['threads']} threads",
             "", f"Host: {h.get('cpu')}, {h.get('cpus')} CPUs {h.get('hypervisor', '')}, "
             f"{' '.join(h.get('flags', []))}; {report['date']}; `{report['command']}`", "",
             "| engine | mode | batch | weights | tok/s | vs llama.cpp plain | "
             "vs transformers plain | speculation | same as transformers | same as its plain |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['engine']} | {r['mode']} | {r['batch']} | {r.get('weights', '')} "
                         f"| failed | | | | | |")
            continue
        llama = _find(rows, "llama.cpp", "plain", r["batch"])
        hf = _find(rows, "transformers", "plain", r["batch"])
        lines.append(f"| {r['engine']} | {r['mode']} | {r['batch']} | {r.get('weights', '')} | "
                     f"{r['tok_s']:.2f} | {_ratio(r['tok_s'], llama)} | {_ratio(r['tok_s'], hf)} "
                     f"| {_speculation(r)} | {r.get('identical', '-')} "
                     f"| {r.get('identical_to_own_plain', '-')} |")
    lines += ["", "tok/s: new tokens over wall time, prefill included (batch 1: the sum of the "
              "requests' times; batch 8: 8 requests in flight, the whole run). Speculation: "
              "specmesh's tokens per target pass (bonus counted), the others' share of draft "
              "tokens accepted. "
              "Same as: outputs equal to transformers plain batch 1, or to the engine's own plain "
              "batch 1 (a final EOS aside), of the prompts; the engines' weights differ (llama.cpp "
              "runs the GGUF's quantized blocks, specmesh with dtype auto the GGUF's 4-bit layers as "
              "int4 codes), and so do their outputs."]
    lines += _rounds(report)
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Failed:", ""] + [f"- {r['engine']} {r['mode']} batch {r['batch']}: "
                                         f"{r['error']}" for r in errors]
    notes = report.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Bars of tok/s per engine x mode, one group per batch size; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["rows"] if r.get("tok_s")]
    batches = sorted({r["batch"] for r in rows})
    labels = list(dict.fromkeys(f"{r['engine']} {r['mode']}" for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 0.35 * len(labels) + 1.5),
                             squeeze=False)
    for ax, b in zip(axes[0], batches):
        values = [next((r["tok_s"] for r in rows if r["batch"] == b
                        and f"{r['engine']} {r['mode']}" == label), 0) for label in labels]
        colors = [f"C{['transformers', 'specmesh', 'llama.cpp', 'vllm', 'specmesh-ggml'].index(la.split()[0])}"
                  for la in labels]
        ax.barh(labels, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"batch {b}")
        ax.set_xlabel("tok/s")
    fig.suptitle(f"{report['config']['model']}, {report['config']['threads']} threads, "
                 f"{report['host'].get('cpu', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _rounds(report: dict) -> list[str]:
    """With --rounds: each row's ratio to llama.cpp plain round by round (the engines alternated
    over the prompt groups, so a ratio's spread is the noise left after the host's drift)."""
    if report.get("rounds", 1) <= 1:
        return []
    out = ["", f"Interleaved over {report['rounds']} prompt groups; ratio to llama.cpp plain "
           f"in each round:"]
    for r in report["rows"]:
        llama = next((x for x in report["rows"] if (x["engine"], x["mode"], x["batch"])
                      == ("llama.cpp", "plain", r["batch"])), None)
        if r.get("error") or llama is None or llama is r or llama.get("error"):
            continue
        ratios = [_ratio(a, b) for a, b in zip(r.get("round_tok_s", []),
                                                 llama.get("round_tok_s", []))]
        out.append(f"- {r['engine']} {r['mode']} batch {r['batch']}: {', '.join(ratios)}")
    return out
