"""Training grounded draft heads on cached hidden states (services/heads/extract.py), as Hydra
trains them (section 4.1): the target frozen, one pass over the data (the paper's one epoch),
Adam with betas (0.9, 0.99), a cosine-decayed learning rate with warmup down to 0, cross
entropy of each head on the data's token.

Every window of the extraction gives, at each position t with K tokens after t + 1, one
example: f_t, the tokens x_{t+1} .. x_{t+K} (head k reads the first k) and the targets
x_{t+2} .. x_{t+1+K}. Every 20th window is held out: top-1 / top-5 accuracy per head is measured
there (the paper's figure 2). Deviation: the learning rate is 1e-3, not 1e-4 (heads of a 576-wide
model on ~1M tokens: measured in the closing figures of `specmesh heads train`), and batches are
of positions, not of sequences.

Output (`out`): heads.safetensors (the heads' weights) and heads.json (model, tokenizer family,
hidden size, heads, tokens seen, held-out accuracy per head, the hidden-states folder); while
training, checkpoint.pt every `checkpoint_every` steps, from which an interrupted run resumes.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.heads import extract
from specmesh_services.heads.model import GroundedHeads

HOLD_OUT_EVERY = 20  # every 20th window is held out
CHECKPOINT = "checkpoint.pt"

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


def examples(hidden_dir: Path, num_heads: int, held_out: bool) -> tuple[torch.Tensor, ...]:
    """(f [N, H] bf16, inputs [N, K] long, targets [N, K] long) of the training windows
    (`held_out`: of the held-out ones), in data order."""
    meta = extract.require_meta(hidden_dir)
    fs, inputs, targets = [], [], []
    window = 0
    for entry in meta["shards"]:
        shard = extract.load_shard(hidden_dir, entry)
        starts = shard["starts"].tolist()
        for a, b in zip(starts, starts[1:]):
            keep = (window % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1) == held_out
            window += 1
            n = b - a - 1 - num_heads  # positions with all K targets in the window
            if not keep or n < 1:
                continue
            tokens = shard["tokens"][a:b].long()
            fs.append(shard["hidden"][a:a + n])
            inputs.append(torch.stack([tokens[1 + j:1 + j + n] for j in range(num_heads)], 1))
            targets.append(torch.stack([tokens[2 + j:2 + j + n] for j in range(num_heads)], 1))
    if not fs:
        hidden = meta["hidden_size"]
        return (torch.zeros(0, hidden, dtype=torch.bfloat16),
                torch.zeros(0, num_heads, dtype=torch.long),
                torch.zeros(0, num_heads, dtype=torch.long))
    return torch.cat(fs), torch.cat(inputs), torch.cat(targets)


def target_matrices(settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embeddings and LM head [V, H], in the serving dtype."""
    path = models.resolve(settings.model, settings.cache_dir)
    dtype = models.resolve_dtype(settings.dtype)
    model = models.load_model(path, dtype, linear="torch")
    embed = model.get_input_embeddings().weight.detach().to(dtype)
    head = model.get_output_embeddings().weight.detach().to(dtype)
    return embed, head


@torch.no_grad()
def accuracy(heads: GroundedHeads, data: tuple[torch.Tensor, ...], batch: int = 1024
             ) -> list[dict]:
    """Top-1 and top-5 accuracy of each head over `data`."""
    f, inputs, targets = data
    hits = [[0, 0] for _ in range(heads.num_heads)]
    for at in range(0, f.shape[0], batch):
        for k in range(1, heads.num_heads + 1):
            logits = heads.logits(k, f[at:at + batch], inputs[at:at + batch, :k])
            top = logits.topk(5, dim=-1).indices
            want = targets[at:at + batch, k - 1:k]
            hits[k - 1][0] += int((top[:, :1] == want).sum())
            hits[k - 1][1] += int((top == want).any(-1).sum())
    n = max(f.shape[0], 1)
    return [{"head": k + 1, "top1": h1 / n, "top5": h5 / n} for k, (h1, h5) in enumerate(hits)]


def train(settings: Settings, hidden_dir: Path, out: Path, num_heads: int = 3,
          batch: int = 256, lr: float = 1e-3, warmup: int = 50, max_tokens: int | None = None,
          max_seconds: float | None = None, checkpoint_every: int = 200, seed: int = 0,
          grounded: bool = True, progress: bool = True) -> dict:
    """Trains `num_heads` grounded heads for one pass over the cached hidden states (at most
    `max_tokens` examples, `max_seconds`); writes and returns heads.json's content."""
    meta = extract.require_meta(hidden_dir)
    if meta["model"] != settings.model:
        raise extract.HiddenStatesMismatch(
            f"{hidden_dir} holds hidden states of {meta['model']}, not {settings.model}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    embed, head = target_matrices(settings)
    torch.manual_seed(seed)
    heads = GroundedHeads(meta["hidden_size"], num_heads, embed, head, grounded)
    data = examples(hidden_dir, num_heads, held_out=False)
    held = examples(hidden_dir, num_heads, held_out=True)
    total = data[0].shape[0] if max_tokens is None else min(max_tokens, data[0].shape[0])
    steps = max(math.ceil(total / batch), 1)
    order = torch.randperm(data[0].shape[0], generator=torch.Generator().manual_seed(seed))
    order = order[:total]
    optimizer = torch.optim.Adam(heads.parameters(), lr=lr, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    step = 0
    if (out / CHECKPOINT).is_file():
        saved = torch.load(out / CHECKPOINT, weights_only=False)
        if (saved["steps"], saved["num_heads"], saved.get("grounded", True)) == (
                steps, num_heads, grounded):
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
            pick = order[step * batch:(step + 1) * batch]
            f, inputs, targets = data[0][pick], data[1][pick], data[2][pick]
            loss = sum(F.cross_entropy(heads.logits(k, f, inputs[:, :k]), targets[:, k - 1])
                       for k in range(1, num_heads + 1)) / num_heads
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{loss.detach().item():.3f}")
            if step % checkpoint_every == 0 and step < steps:
                _save_checkpoint(out, heads, optimizer, schedule, step, steps, num_heads,
                                 grounded)
    finally:
        if bar is not None:
            bar.close()
    if step < steps:  # the time budget ran out: resumable from here
        _save_checkpoint(out, heads, optimizer, schedule, step, steps, num_heads, grounded)
    result = {"model": settings.model, "tokenizer": meta["tokenizer"],
              "hidden_size": meta["hidden_size"], "num_heads": num_heads, "grounded": grounded,
              "tokens_seen": min(step * batch, total), "steps": step, "of_steps": steps,
              "complete": step >= steps, "held_out_examples": int(held[0].shape[0]),
              "accuracy": accuracy(heads, held), "hidden_states": str(hidden_dir),
              "seconds": round(time.monotonic() - started, 1), "lr": lr, "batch": batch}
    _save_heads(out, heads, result)
    if result["complete"] and (out / CHECKPOINT).is_file():
        (out / CHECKPOINT).unlink()
    return result


def _save_checkpoint(out, heads, optimizer, schedule, step, steps, num_heads,
                     grounded) -> None:
    tmp = out / f".{CHECKPOINT}.tmp"
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "step": step, "steps": steps,
                "num_heads": num_heads, "grounded": grounded}, tmp)
    os.replace(tmp, out / CHECKPOINT)


def _save_heads(out: Path, heads: GroundedHeads, result: dict) -> None:
    from safetensors.torch import save_file

    tmp = out / ".heads.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp))
    os.replace(tmp, out / "heads.safetensors")
    tmp = out / ".heads.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "heads.json")
