"""Runs vLLM (CPU build) on one job for bench/peers.py, inside vLLM's own virtual environment
(it pins its own torch and transformers, so it never shares a process with specmesh).

    <vllm-venv>/bin/python bench/peers_vllm_driver.py job.json result.json

job: {"model", "dtype", "prompts": [[token ids]], "max_tokens", "batches": [1, 8],
      "max_model_len", "speculative": null | vLLM's speculative_config}
result: {"vllm": version, "runs": [{"batch", "tokens": [[ids]], "seconds": [per request],
         "wall": s, "drafted", "accepted": draft tokens (speculative modes)}]}; greedy, the
prompts given as ids. Batch 1 sends one prompt per `generate` call; batch c gives all prompts
to one call with at most c sequences running.
Prefix caching is off: no engine here reuses an earlier request's prefill.
"""
import json
import sys
import time


def spec_counts(llm) -> dict:
    """Draft tokens proposed and accepted so far (vLLM's counters; empty without them)."""
    try:
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    except Exception:  # noqa: BLE001 - the counters are a nicety
        return {}
    names = {"drafted": "vllm:spec_decode_num_draft_tokens",
             "accepted": "vllm:spec_decode_num_accepted_tokens"}
    return {k: metrics[n] for k, n in names.items() if metrics.get(n) is not None}


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=max(job["batches"]), speculative_config=job["speculative"],
              enable_prefix_caching=False, disable_log_stats=False, seed=0)  # every prefill computed, as elsewhere
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    # warm-up: the first batch once, untimed (its first steps compile kernels for new shapes)
    llm.generate(prompts[:max(job["batches"])], params, use_tqdm=False)
    runs = []
    for c in job["batches"]:
        tokens, seconds, before = [], [], spec_counts(llm)
        start = time.perf_counter()
        if c == 1:
            for p in prompts:
                t = time.perf_counter()
                tokens.append(list(llm.generate([p], params, use_tqdm=False)[0]
                                   .outputs[0].token_ids))
                seconds.append(time.perf_counter() - t)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        after = spec_counts(llm)
        runs.append({"batch": c, "tokens": tokens, "seconds": seconds,
                     "wall": time.perf_counter() - start,
                     **{k: after[k] - before[k] for k in after if k in before}})
        print(f"vllm batch {c}: {sum(map(len, tokens))} tokens in {runs[-1]['wall']:.1f} s",
              file=sys.stderr, flush=True)
    json.dump({"vllm": vllm.__version__, "runs": runs}, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
