"""ProPD's early prediction head (section 4.1): after the target's first n layers, a small head
guesses each tree row's successor tokens, so that the verifier prunes a node not in its
parent's Top-k with its subtree before the remaining layers run (services/verifier/prune.py).

The head: `h = norm(x_n) + W2 silu(W1 norm(x_n))` over the residual stream after layer n, read
out by the target's frozen LM head over a draft vocabulary, trained to the target's own
next-token distribution (one pass, Adam, cosine learning rate). Deviation from ProPD, which
gives no shape: the residual MLP with Medusa's zero start, so an untrained head is the logit
lens (docs/decisions/early-pruning.md). On disk: `<cache_dir>/heads/<model>/early-<n>/`
(docs/heads.md, Early pruning).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.heads import extract
from specmesh_services.heads.train import HOLD_OUT_EVERY

RECALL_AT = (5, 10, 20, 50, 100, 200)

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


class EarlyHeadMismatch(ValueError):
    """The early head was trained for another model, tokenizer or hidden size."""


class EarlyHead(nn.Module):
    def __init__(self, layer: int, lm_head: torch.Tensor, norm: torch.Tensor, eps: float,
                 vocab: torch.Tensor) -> None:
        """`lm_head` [V, H] and `norm` [H]: the target's LM head (kept frozen) and final norm
        weight (the head's own norm starts from it); `vocab`: sorted token ids kept."""
        super().__init__()
        hidden = lm_head.shape[1]
        self.layer, self.eps, self.hidden_size = layer, eps, hidden
        vocab = vocab.long()
        self.register_buffer("vocab", vocab.clone())
        columns = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
        columns[vocab] = torch.arange(vocab.numel())
        self.register_buffer("columns", columns, persistent=False)
        self.register_buffer("lm_head", lm_head.detach()[vocab], persistent=False)
        self.norm = nn.Parameter(norm.detach().float().clone())
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.up.weight.dtype
        h = F.rms_norm(x.to(dtype), (self.hidden_size,), self.norm.to(dtype), self.eps)
        return h + self.down(F.silu(self.up(h)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, vocab columns] float32 from layer-n states x [N, H]."""
        return (self.hidden(x).to(self.lm_head.dtype) @ self.lm_head.T).float()


def _target_parts(settings: Settings) -> tuple[torch.Tensor, torch.Tensor, float, list[int], int]:
    """The target's LM head [V, H] and final norm weight as served, its norm eps, special
    token ids and layer count."""
    path = models.resolve(settings.model, settings.cache_dir)
    model = models.load_model(path, models.resolve_dtype(settings.dtype), linear="torch")
    head = model.get_output_embeddings().weight.detach()
    return (head, model.model.norm.weight.detach(), model.config.rms_norm_eps,
            list(models.load_tokenizer(path).all_special_ids), model.config.num_hidden_layers)


def _states(hidden_dir: Path, layer: int, held_out: bool, max_tokens: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer-n states, final states, tokens) of every position of the training (or held-out)
    windows, at most `max_tokens`."""
    meta = extract.require_meta(hidden_dir)
    if layer not in meta.get("layers", []):
        raise ValueError(f"{hidden_dir} holds no states of layer {layer} "
                         f"(it has {meta.get('layers', [])})")
    early, final, tokens, count = [], [], [], 0
    for shard, a, b in extract.split_windows(hidden_dir, held_out, HOLD_OUT_EVERY):
        if max_tokens is not None and count >= max_tokens:
            break
        early.append(shard[f"layer-{layer}"][a:b])
        final.append(shard["hidden"][a:b])
        tokens.append(shard["tokens"][a:b])
        count += b - a
    if not early:
        raise ValueError(f"{hidden_dir} holds no {'held-out' if held_out else 'training'} windows")
    return (torch.cat(early)[:max_tokens], torch.cat(final)[:max_tokens],
            torch.cat(tokens)[:max_tokens].long())


@torch.no_grad()
def recall(head: EarlyHead, early: torch.Tensor, final: torch.Tensor, full_head: torch.Tensor,
           batch: int = 2048) -> dict[int, float]:
    """Per k, the share of positions whose target greedy token the pruning criterion keeps:
    in the head's Top-k, or outside its vocabulary (never pruned)."""
    kept = {k: 0 for k in RECALL_AT}
    for at in range(0, early.shape[0], batch):
        greedy = (final[at:at + batch].to(full_head.dtype) @ full_head.T).argmax(-1)
        column = head.columns[greedy]
        logits = head.logits(early[at:at + batch])
        mine = logits.gather(1, column.clamp(min=0)[:, None]).squeeze(1)
        rank = (logits > mine[:, None]).sum(-1)  # ties kept, as the criterion keeps them
        for k in RECALL_AT:
            kept[k] += int(((column < 0) | (rank < k)).sum())
    n = max(early.shape[0], 1)
    return {k: v / n for k, v in kept.items()}


def train_early(settings: Settings, hidden_dir: Path, out: Path, layer: int,
                max_tokens: int | None = None, vocab: int = 16384, batch: int = 512,
                lr: float = 1e-3, warmup: int = 50, seed: int = 0, progress: bool = True) -> dict:
    """Trains the early head of `layer` for one pass over the cached states; writes and
    returns early.json's content."""
    meta = extract.require_meta(hidden_dir)
    if meta["model"] != settings.model:
        raise extract.HiddenStatesMismatch(
            f"{hidden_dir} holds hidden states of {meta['model']}, not {settings.model}")
    from specmesh_services.drafter.vocab import frequent_tokens

    head_w, norm, eps, special, _ = _target_parts(settings)
    head_w = head_w.to(models.training_dtype())
    early, final, tokens = _states(hidden_dir, layer, held_out=False, max_tokens=max_tokens)
    held_early, held_final, _ = _states(hidden_dir, layer, held_out=True)
    size = head_w.shape[0]
    keep = (frequent_tokens(torch.bincount(tokens, minlength=size).numpy(), vocab, special)
            if 0 < vocab < size else torch.arange(size))  # FR-Spec's rule, as the heads
    torch.manual_seed(seed)
    head = EarlyHead(layer, head_w, norm, eps, keep)
    lens = recall(head, held_early, held_final, head_w)  # untrained: the logit lens
    steps = max(math.ceil(early.shape[0] / batch), 1)
    order = torch.randperm(early.shape[0], generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr,
                                 betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    started = time.monotonic()
    bar = (tqdm(total=steps, unit=" step", desc=f"early head (layer {layer})",
                disable=not progress) if tqdm is not None else None)
    try:
        for step in range(steps):
            pick = order[step * batch:(step + 1) * batch]
            with torch.no_grad():
                teacher = (final[pick].to(head.lm_head.dtype) @ head.lm_head.T).float().softmax(-1)
            loss = F.cross_entropy(head.logits(early[pick]), teacher)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{loss.detach().item():.3f}")
    finally:
        if bar is not None:
            bar.close()
    result = {"model": settings.model, "tokenizer": meta["tokenizer"],
              "hidden_size": meta["hidden_size"], "layer": layer, "vocab": int(keep.numel()),
              "tokens_seen": int(early.shape[0]), "held_out_tokens": int(held_early.shape[0]),
              "recall": recall(head, held_early, held_final, head_w), "logit_lens_recall": lens,
              "seconds": round(time.monotonic() - started, 1), "hidden_states": str(hidden_dir)}
    save(head, Path(out), result)
    return result


def save(head: EarlyHead, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v
             for k, v in head.state_dict().items()}
    tmp = out / ".early.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, out / "early.safetensors")
    tmp = out / ".early.json.tmp"
    tmp.write_text(json.dumps({**meta, "weights_dtype": "bfloat16"}, indent=2) + "\n")
    os.replace(tmp, out / "early.json")


def default_folder(settings: Settings, model: str, layer: int | None = None) -> Path | None:
    """The model's early head: in the cache (`specmesh heads early`; the lowest layer when
    several and `layer` is None), else the one shipped with specmesh; None where there is none."""
    root = Path(settings.cache_dir) / "heads" / model
    cached = sorted((p for p in root.glob("early-*") if (p / "early.json").is_file()),
                    key=lambda p: int(p.name.split("-")[1]))
    if layer is not None:
        cached = [p for p in cached if p.name == f"early-{layer}"]
    if cached:
        return cached[0]
    shipped = Path(__file__).parent / "trained" / model / "early"
    if (shipped / "early.json").is_file() and (
            layer is None or json.loads((shipped / "early.json").read_text())["layer"] == layer):
        return shipped
    return None


def load(folder: Path, model: str, tokenizer: str, lm_head: torch.Tensor, norm: torch.Tensor,
         eps: float) -> EarlyHead:
    """The early head of `folder` for the served target (its LM head and final norm)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "early.json").is_file():
        raise FileNotFoundError(f"no early head in {folder} (`specmesh heads early`)")
    meta = json.loads((folder / "early.json").read_text())
    for key, want in (("model", model), ("tokenizer", tokenizer), ("hidden_size", lm_head.shape[1])):
        if meta.get(key) != want:
            raise EarlyHeadMismatch(f"the early head in {folder} was trained for {key} "
                                    f"{meta.get(key)!r}, the target has {want!r}")
    weights = load_file(str(folder / "early.safetensors"))
    head = EarlyHead(meta["layer"], lm_head, norm, eps, weights["vocab"])
    head.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in weights.items()}, strict=False)
    head.meta = meta
    return head
