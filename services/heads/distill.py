"""Self-distillation data for draft heads: the target's own greedy answers to a corpus'
questions, written as a corpus of conversations the extraction reads like ShareGPT.

Why: the heads must guess what the target will say, not a corpus' answers written by someone
else (docs/decisions/heads-training.md). Each record's first human turn goes through the chat
template; the target answers greedily in batches up to `answer_tokens` tokens, into
`<cache_dir>/heads/<model>/answers-<corpus>.jsonl`, appended a batch at a time so that an
interrupted run resumes (docs/heads.md, The data).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.datastore import corpus as corpora

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


def answers_path(settings: Settings, corpus: str) -> Path:
    name = corpus if corpus == "sharegpt" else Path(corpus).stem
    return Path(settings.cache_dir) / "heads" / settings.model / f"answers-{name}.jsonl"


def _done(out: Path) -> tuple[int, int]:
    """(records read so far, answer tokens written) of an answers file; a truncated last
    line (an interrupted write) is cut off."""
    if not out.is_file():
        return 0, 0
    good, read, tokens = 0, 0, 0
    with open(out, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            record = json.loads(line)
            read, tokens = record["record"] + 1, tokens + record["answer_tokens"]
            good += len(line)
    if good != out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good)
    return read, tokens


def questions(corpus: str, tokenizer, prompt_limit: int, start: int
              ) -> Iterator[tuple[int, str, list[int]]]:
    """(record index, first human turn, its chat prompt ids) from record `start` on."""
    for index, record in enumerate(corpora.iter_records(corpora.resolve(corpus))):
        if index < start:
            continue
        messages = corpora.record_messages(record)
        if not messages or messages[0]["role"] != "user":
            continue
        turn = messages[0]
        text = tokenizer.apply_chat_template([turn], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= prompt_limit:
            yield index, turn["content"], ids


def generate(settings: Settings, max_tokens: int, corpus: str = "sharegpt",
             out: Path | None = None, answer_tokens: int = 256, batch_size: int = 32,
             prompt_limit: int = 512, progress: bool = True) -> dict:
    """At least `max_tokens` answer tokens (fewer if the corpus runs out) in `out`; returns
    {"path", "records", "tokens", "complete"}. Resumes what is there."""
    out = Path(out) if out is not None else answers_path(settings, corpus)
    read, written = _done(out)
    if written >= max_tokens:
        return {"path": str(out), "records": read, "tokens": written, "complete": False}
    path = models.resolve(settings.model, settings.cache_dir)
    tokenizer = models.load_tokenizer(path)
    model = models.load_model(path, models.resolve_dtype(settings.dtype))
    stops = models.eos_token_ids(path, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = (tqdm(total=max_tokens, initial=written, unit=" tok", desc="target answers",
                disable=not progress) if tqdm is not None else None)
    batch: list[tuple[int, str, list[int]]] = []
    complete = True
    try:
        with open(out, "a", encoding="utf-8") as f:
            for item in questions(corpus, tokenizer, prompt_limit, read):
                batch.append(item)
                if len(batch) < batch_size:
                    continue
                written += _answer(model, tokenizer, batch, answer_tokens, pad, stops, f, bar)
                batch = []
                if written >= max_tokens:
                    complete = False
                    break
            else:
                if batch:
                    written += _answer(model, tokenizer, batch, answer_tokens, pad, stops, f,
                                       bar)
    finally:
        if bar is not None:
            bar.close()
    read, written = _done(out)
    return {"path": str(out), "records": read, "tokens": written, "complete": complete}


@torch.inference_mode()
def _answer(model, tokenizer, batch, answer_tokens: int, pad: int, stops: list[int], f,
            bar) -> int:
    """Greedy answers of a batch (left-padded), appended to `f`; returns their tokens."""
    width = max(len(ids) for _, _, ids in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for _, _, p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, _, p in batch])
    generated = model.generate(ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=answer_tokens, eos_token_id=stops,
                               pad_token_id=pad)[:, width:]
    total = 0
    for (index, question, _), row in zip(batch, generated.tolist()):
        end = next((i for i, t in enumerate(row) if t in stops), len(row))
        answer = tokenizer.decode(row[:end], skip_special_tokens=True)
        total += end
        f.write(json.dumps({"record": index, "answer_tokens": end, "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": answer}]}) + "\n")
    f.flush()
    if bar is not None:
        bar.update(total)
    return total
