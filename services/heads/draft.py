"""Grounded heads as a drafter: trees below a verified step's bonus token (Hydra 3.2, grounded
tree candidates), built level by level, each head conditioned on the path drafted so far; run
by the verifier right after its step (docs/decisions/heads-in-verifier.md).

Level k runs head k on every frontier node of every request at once; each frontier node's WIDTH
likeliest tokens become candidates scored by the product of the heads' probabilities along
their path, the FRONTIER best the next frontier; the tree is the `max_nodes` best-scored
candidates, scores attached for the router's sizing (docs/heads.md, Serving). Deviation from
Hydra's fixed tree (the Cartesian product of per-head top-k): a per-step shape from the heads'
own scores, which the ProPD sizing needs (docs/decisions/heads-training.md). Lossless whatever
the heads guess: the verifier checks every node.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from specmesh_services.common.drafts import HEADS, heads_path
from specmesh_services.common.tree import TokenTree
from specmesh_services.heads.model import GroundedHeads

WIDTH = 4  # children per frontier node
FRONTIER = 2  # nodes of a level expanded to the next (docs/decisions/heads-in-verifier.md)


class HeadsMismatch(ValueError):
    """The heads were trained for another model (or tokenizer, or hidden size)."""


class HeadsDrafter:
    """K grounded heads over a target's final hidden states, served for speed: on a CPU their
    products (each head's two layers and the LM head's rows of the draft vocabulary) in int8
    (FBGEMM; int4 where it does not run), float32 activations; elsewhere in the target's
    dtype. Drafting a few rows is memory-bound: 8-bit weights read half of bf16's, and the
    int4 kernel, faster for one row, slows down with the rows of a level
    (docs/decisions/heads-in-verifier.md)."""

    def __init__(self, heads: GroundedHeads, meta: dict, weights: str | None = "auto") -> None:
        self.meta = meta
        self.depth = heads.num_heads
        self.grounded = heads.grounded
        self.vocab = heads.vocab.to(heads.lm_head.device)
        self.layers, self.dtype, self.weights = served_products(heads.up, heads.down,
                                                                heads.lm_head, weights)
        self.embed = heads.embed  # the target's, as served

    @classmethod
    def load(cls, folder: Path, model: str, tokenizer: str, embed: torch.Tensor,
             lm_head: torch.Tensor, weights: str | None = "auto") -> "HeadsDrafter":
        """Heads of `folder` (heads.json + heads.safetensors) for the served target `model`
        (its tokenizer family, input embeddings and LM head [V, H] as served)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / "heads.json").is_file():
            raise FileNotFoundError(f"no trained heads in {folder} (`specmesh heads train`)")
        meta = json.loads((folder / "heads.json").read_text())
        for key, want in (("model", model), ("tokenizer", tokenizer),
                          ("hidden_size", embed.shape[1])):
            if meta.get(key) != want:
                raise HeadsMismatch(f"the heads in {folder} were trained for {key} "
                                    f"{meta.get(key)!r}, the target has {want!r}")
        weights_file = load_file(str(folder / "heads.safetensors"))
        heads = GroundedHeads(meta["hidden_size"], meta["num_heads"], embed, lm_head,
                              meta.get("grounded", True), weights_file.get("vocab"))
        heads.load_state_dict(weights_file, strict=False)
        return cls(heads, meta, weights)

    def _logits(self, k: int, f: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Head k's logits [N, vocab columns] from f [N, H] and the path's k tokens [N, k]."""
        layers = self.layers
        x = torch.cat((f, self.embed[path].to(self.dtype).flatten(1)), dim=-1) \
            if self.grounded else f
        h = f + layers["down"][k - 1](torch.nn.functional.silu(layers["up"][k - 1](x)))
        return layers["lm"](h)

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, bonus: list[int], max_nodes: list[int],
              depth: int | None = None) -> list[TokenTree]:
        """One tree per request: `hidden` [B, H] the final hidden states of each request's
        last accepted token, `bonus` the token the target chose after it (the trees' root),
        `max_nodes` each tree's size limit (0: no tree). Every level runs on the device where
        the hidden states are, the frontier kept there too; the candidates come to the host
        in one copy at the end (one sync, not two a level: a GPU waits on each)."""
        depth = min(depth or self.depth, self.depth, max(max_nodes, default=0))
        live = [r for r, n in enumerate(max_nodes) if n > 0]
        trees = [TokenTree((), ())] * len(bonus)
        if not live or depth <= 0:
            return trees
        f = hidden[live].to(self.dtype)
        b = len(live)
        # the frontier: [b, F] paths below the root (bonus first) and their scores
        paths = torch.tensor([[bonus[r]] for r in live], device=f.device)[:, None, :]
        scores = torch.ones(b, 1, dtype=torch.float64, device=f.device)
        levels = []  # per level: candidates' tokens and scores [b, F * WIDTH], next frontier
        for k in range(1, depth + 1):
            width = paths.shape[1]
            logits = self._logits(k, f.repeat_interleave(width, 0),
                                  paths.flatten(0, 1)).float()
            top, cols = logits.topk(WIDTH, dim=-1)
            probs = (top - logits.logsumexp(-1, keepdim=True)).exp().double()
            tokens = self.vocab[cols].view(b, width * WIDTH)
            cand = (scores[:, :, None] * probs.view(b, width, WIDTH)).flatten(1)
            # stable: among equal scores the earlier candidate first, as a sorted list keeps
            order = cand.sort(dim=1, descending=True, stable=True).indices[:, :FRONTIER]
            levels.append((tokens, cand, order))
            parent = torch.div(order, WIDTH, rounding_mode="floor")
            paths = torch.cat((paths.gather(1, parent[:, :, None].expand(-1, -1, paths.shape[2])),
                               tokens.gather(1, order)[:, :, None]), dim=2)
            scores = cand.gather(1, order)
        host = torch.cat([torch.cat((t.double(), c, o.double()), dim=1)
                          for t, c, o in levels], dim=1).cpu().tolist()  # the one sync
        for i, r in enumerate(live):
            row, at, offset, frontier = host[i], 0, 0, [-1]  # frontier: candidates' indices
            toks, scs, pars = [], [], []
            for tokens, _, order in levels:
                n, m = tokens.shape[1], order.shape[1]
                toks += [int(t) for t in row[at:at + n]]
                scs += row[at + n:at + 2 * n]
                pars += [frontier[j // WIDTH] for j in range(n)]
                frontier = [offset + int(j) for j in row[at + 2 * n:at + 2 * n + m]]
                at, offset = at + 2 * n + m, offset + n
            trees[r] = _best(toks, pars, scs, max_nodes[r])
        return trees

def served_products(up, down, lm_head: torch.Tensor, weights: str | None = "auto"):
    """A small head's products (copies of its `up` and `down` layers, and `lm`: the LM head
    rows [V', H] it reads out with) served for speed: on a CPU in int8 (FBGEMM; int4 where it
    does not run; `weights` None: float32), float32 activations; elsewhere in the target's
    dtype. Returns (the products as a ModuleDict, activation dtype, weights' name)."""
    from torch import nn

    from specmesh_kernels.int4 import int4_supports
    from specmesh_kernels.int8 import int8_supports
    from specmesh_kernels.linear_rules import quantize_linears

    target_dtype, device = lm_head.dtype, lm_head.device
    lm = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device=device,
                   dtype=target_dtype)
    with torch.no_grad():
        lm.weight.copy_(lm_head)
    layers = nn.ModuleDict({"up": copy.deepcopy(up), "down": copy.deepcopy(down), "lm": lm})
    if weights == "auto":  # int8 first: the int4 kernel slows with the rows of a level
        weights = "int8" if int8_supports() is None else \
            "int4" if int4_supports() is None else None
    quantized = weights if device.type == "cpu" else None
    dtype = torch.float32 if quantized or device.type == "cpu" else target_dtype
    layers = layers.to(device=device, dtype=dtype)
    if quantized:
        quantize_linears(layers, quantized)
    return layers, dtype, quantized or str(dtype).removeprefix("torch.")


def _best(tokens: list[int], parents: list[int], scores: list[float], limit: int) -> TokenTree:
    """The `limit` best-scored candidates (tokens, parent candidate -1 for the root, scores) as
    a tree (ties: earlier first), in tree order."""
    if limit <= 0 or not tokens:
        return TokenTree((), ())
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:limit])
    index = {old: new for new, old in enumerate(keep)}
    return TokenTree(tuple(tokens[i] for i in keep),
                     tuple(-1 if parents[i] < 0 else index[parents[i]] for i in keep),
                     tuple(scores[i] for i in keep), (0,) * len(keep), (HEADS,))

def default_folder(settings, model: str) -> Path:
    """Where `heads` (no path) finds the model's heads: trained ones in the cache
    (`specmesh heads train`), else the ones shipped with specmesh, else the cache's path (for
    the error message)."""
    cached = Path(settings.cache_dir) / "heads" / model / "heads-3"
    if (cached / "heads.json").is_file():
        return cached
    shipped = Path(__file__).parent / "trained" / model
    return shipped if (shipped / "heads.json").is_file() else cached


def load_for_target(settings, spec: str) -> HeadsDrafter:
    """The heads a spec names, for `settings.model` as served: its embeddings and LM head in
    the fast dtype of this machine (bfloat16 where it runs fast), whatever the target's
    weights."""
    from specmesh_services.common import models
    from specmesh_services.common.datastore_files import tokenizer_family

    path = models.resolve(settings.model, settings.cache_dir)
    folder = heads_path(spec) or default_folder(settings, settings.model)
    from specmesh_services.common.device import resolve_device

    device = resolve_device(settings.device)
    model = models.load_model(path, models.resolve_dtype(settings.dtype, device), linear="torch",
                              device=device)
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    return HeadsDrafter.load(folder, settings.model, tokenizer_family(models.load_tokenizer(path)),
                             embed, lm_head)
