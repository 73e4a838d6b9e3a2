"""Training grounded draft heads on cached hidden states (extract.py), as Hydra 4.1 trains them:
the target frozen, one pass, Adam (0.9, 0.99), a cosine-decayed learning rate with warmup.

Each position t with K tokens after t + 1 is one example: f_t, the tokens x_{t+1} .. x_{t+K}
(head k reads the first k) and the targets x_{t+2} .. x_{t+1+K}; every 20th window is held out
for top-1 / top-5 per head. Out: heads.safetensors and heads.json in `out`; checkpoint.pt
every `checkpoint_every` steps resumes an interrupted run (docs/heads.md, The heads).
Deviations from Hydra, each measured (docs/decisions/heads-training.md):
- learning rate 1e-3, not 1e-4; batches of positions, not of sequences;
- soft targets (the target's own distribution at x_{t+1+k}) by default, not the data's token;
- the LM head over the 16,384 most frequent tokens of the training data (FR-Spec).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.drafter.vocab import frequent_tokens
from specmesh_services.heads import extract
from specmesh_services.heads.model import GroundedHeads

HOLD_OUT_EVERY = 20  # every 20th window is held out
CHECKPOINT = "checkpoint.pt"

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


@dataclass(frozen=True)
class Examples:
    """Training examples over the cached hidden states: example i is position `at[i]` of
    `hidden` (f_t), its `inputs` x_{t+1} .. x_{t+K} (head k reads the first k) and `targets`
    x_{t+2} .. x_{t+1+K}. The target's own distribution of x_{t+1+k} is read from
    hidden[at + k] (its state at x_{t+k}): the soft targets."""

    hidden: torch.Tensor  # [M, H] bf16, every cached position of the windows used
    at: torch.Tensor  # [N] long
    inputs: torch.Tensor  # [N, K] long
    targets: torch.Tensor  # [N, K] long

    def __len__(self) -> int:
        return int(self.at.shape[0])

    def take(self, pick: torch.Tensor) -> "Examples":
        return Examples(self.hidden, self.at[pick], self.inputs[pick], self.targets[pick])


def examples(hidden_dir: Path, num_heads: int, held_out: bool) -> Examples:
    """The examples of the training windows (`held_out`: of the held-out ones), in data
    order."""
    meta = extract.require_meta(hidden_dir)
    states, at, inputs, targets = [], [], [], []
    offset = 0
    for shard, a, b in extract.split_windows(hidden_dir, held_out, HOLD_OUT_EVERY):
        n = b - a - 1 - num_heads  # positions with all K targets in the window
        if n < 1:
            continue
        tokens = shard["tokens"][a:b].long()
        states.append(shard["hidden"][a:b])
        at.append(torch.arange(offset, offset + n))
        offset += b - a
        inputs.append(torch.stack([tokens[1 + j:1 + j + n] for j in range(num_heads)], 1))
        targets.append(torch.stack([tokens[2 + j:2 + j + n] for j in range(num_heads)], 1))
    if not states:
        return Examples(torch.zeros(0, meta["hidden_size"], dtype=torch.bfloat16),
                        torch.zeros(0, dtype=torch.long),
                        torch.zeros(0, num_heads, dtype=torch.long),
                        torch.zeros(0, num_heads, dtype=torch.long))
    return Examples(torch.cat(states), torch.cat(at), torch.cat(inputs), torch.cat(targets))


def draft_vocab(data: Examples, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent target tokens of the training examples (ties: lower id),
    plus `always` (end-of-turn and the other special tokens), sorted."""
    counts = torch.bincount(data.targets[:, 0], minlength=vocab_size)
    return frequent_tokens(counts.numpy(), size, always)  # FR-Spec's rule, as the drafts


def target_matrices(settings: Settings) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The target's input embeddings (in the serving dtype) and LM head [V, H] (in the dtype
    its products train fastest in here: `models.training_dtype`), and its tokenizer's special
    token ids."""
    path = models.resolve(settings.model, settings.cache_dir)
    dtype = models.resolve_dtype(settings.dtype)
    model = models.load_model(path, dtype, linear="torch")
    embed = model.get_input_embeddings().weight.detach().to(dtype)
    head = model.get_output_embeddings().weight.detach().to(models.training_dtype())
    return embed, head, list(models.load_tokenizer(path).all_special_ids)


@torch.no_grad()
def accuracy(heads: GroundedHeads, data: Examples, full_head: torch.Tensor, batch: int = 1024
             ) -> list[dict]:
    """Per head, top-1 and top-5 accuracy over `data`: against the data's token (`top1`,
    `top5`: the paper's figure 2) and against the target's own greedy token there (`agree1`,
    `agree5`: what a greedy verification accepts). A token outside the draft vocabulary is a
    miss."""
    hits = [[0, 0, 0, 0] for _ in range(heads.num_heads)]
    for at in range(0, len(data), batch):
        part = data.take(torch.arange(at, min(at + batch, len(data))))
        f = part.hidden[part.at]
        for k in range(1, heads.num_heads + 1):
            top = heads.vocab[heads.logits(k, f, part.inputs[:, :k]).topk(5, dim=-1).indices]
            greedy = (part.hidden[part.at + k].to(full_head.dtype) @ full_head.T).argmax(-1)
            for j, want in enumerate((part.targets[:, k - 1], greedy)):
                want = want.unsqueeze(1)
                hits[k - 1][2 * j] += int((top[:, :1] == want).sum())
                hits[k - 1][2 * j + 1] += int((top == want).any(-1).sum())
    n = max(len(data), 1)
    return [{"head": k + 1, "top1": h[0] / n, "top5": h[1] / n, "agree1": h[2] / n,
             "agree5": h[3] / n} for k, h in enumerate(hits)]


def loss_of(heads: GroundedHeads, batch: Examples, soft: bool) -> torch.Tensor:
    """Mean over heads of the cross entropy against the data's token (`soft=False`; tokens
    outside the draft vocabulary are skipped) or against the target's own distribution there
    (`soft=True`: distillation from the frozen target)."""
    f = batch.hidden[batch.at]
    total = 0.0
    for k in range(1, heads.num_heads + 1):
        logits = heads.logits(k, f, batch.inputs[:, :k])
        if soft:
            with torch.no_grad():
                teacher = (batch.hidden[batch.at + k].to(heads.lm_head.dtype)
                           @ heads.lm_head.T).float().softmax(-1)
            total = total + F.cross_entropy(logits, teacher)
        else:
            want = heads.columns[batch.targets[:, k - 1]]
            if bool((want >= 0).any()):
                total = total + F.cross_entropy(logits, want, ignore_index=-1)
    return total / heads.num_heads


def train(settings: Settings, hidden_dir: Path, out: Path, num_heads: int = 3,
          batch: int = 256, lr: float = 1e-3, warmup: int = 50, max_tokens: int | None = None,
          max_seconds: float | None = None, checkpoint_every: int = 200, seed: int = 0,
          grounded: bool = True, vocab: int = 0, soft: bool = True,
          progress: bool = True) -> dict:
    """Trains `num_heads` grounded heads for one pass over the cached hidden states (at most
    `max_tokens` examples, `max_seconds`); writes and returns heads.json's content. `vocab`:
    the draft vocabulary's size (0: the whole vocabulary); `soft`: distil the target's
    distribution instead of the data's token."""
    meta = extract.require_meta(hidden_dir)
    if meta["model"] != settings.model:
        raise extract.HiddenStatesMismatch(
            f"{hidden_dir} holds hidden states of {meta['model']}, not {settings.model}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    embed, head, special = target_matrices(settings)
    data = examples(hidden_dir, num_heads, held_out=False)
    held = examples(hidden_dir, num_heads, held_out=True)
    keep = (draft_vocab(data, vocab, head.shape[0], special)
            if 0 < vocab < head.shape[0] else None)
    torch.manual_seed(seed)
    heads = GroundedHeads(meta["hidden_size"], num_heads, embed, head, grounded, keep)
    total = len(data) if max_tokens is None else min(max_tokens, len(data))
    steps = max(math.ceil(total / batch), 1)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:total]
    optimizer = torch.optim.Adam(heads.parameters(), lr=lr, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    run = {"steps": steps, "num_heads": num_heads, "grounded": grounded,
           "vocab": int(heads.vocab.numel()), "soft": soft}  # what a checkpoint must match
    step = 0
    if (out / CHECKPOINT).is_file():
        saved = torch.load(out / CHECKPOINT, weights_only=False)
        if saved.get("run") == run:
            heads.load_state_dict(saved["heads"])
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            step = saved["step"]
    started = time.monotonic()
    bar = (tqdm(total=steps, initial=step, unit=" step", desc="heads", disable=not progress)
           if tqdm is not None else None)
    try:
        while step < steps:
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                break
            loss = loss_of(heads, data.take(order[step * batch:(step + 1) * batch]), soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{loss.detach().item():.3f}")
            if step % checkpoint_every == 0 and step < steps:
                _save_checkpoint(out, heads, optimizer, schedule, step, run)
    finally:
        if bar is not None:
            bar.close()
    if step < steps:  # the time budget ran out: resumable from here
        _save_checkpoint(out, heads, optimizer, schedule, step, run)
    result = {"model": settings.model, "tokenizer": meta["tokenizer"],
              "hidden_size": meta["hidden_size"], "num_heads": num_heads, "grounded": grounded,
              "vocab": run["vocab"], "targets": "soft" if soft else "data",
              "tokens_seen": min(step * batch, total), "steps": step, "of_steps": steps,
              "complete": step >= steps, "held_out_examples": len(held),
              "accuracy": accuracy(heads, held, head), "hidden_states": str(hidden_dir),
              "seconds": round(time.monotonic() - started, 1), "lr": lr, "batch": batch}
    _save_heads(out, heads, result)
    if result["complete"] and (out / CHECKPOINT).is_file():
        (out / CHECKPOINT).unlink()
    return result


def _save_checkpoint(out, heads, optimizer, schedule, step, run) -> None:
    tmp = out / f".{CHECKPOINT}.tmp"
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "step": step, "run": run}, tmp)
    os.replace(tmp, out / CHECKPOINT)


def _save_heads(out: Path, heads: GroundedHeads, result: dict) -> None:
    from safetensors.torch import save_file

    tmp = out / ".heads.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp))
    os.replace(tmp, out / "heads.safetensors")
    tmp = out / ".heads.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "heads.json")


def export(folder: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Copies trained heads (`folder`: heads.json + heads.safetensors) to `out` with their
    weights in `dtype` (bfloat16: half the size; they are served in the target's fast dtype
    anyway); returns the metadata written."""
    from safetensors.torch import load_file, save_file

    meta = json.loads((Path(folder) / "heads.json").read_text())
    weights = load_file(str(Path(folder) / "heads.safetensors"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()},
              str(out / "heads.safetensors"))
    meta = {**meta, "weights_dtype": str(dtype).removeprefix("torch.")}
    (out / "heads.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
