"""`specmesh datastore tune`: the offline grid search of the fusion discounts (SSSD 3.1.3).

Ground truth is the target's greedy continuations of held-out prompts (prompts.py, cached in the
datastore's directory); the sources' trees at every position are computed once; every setting
of the grid is then simulated without the model (fuse, accept the longest path matching the
ground truth, emit it plus the bonus token), scored by the mean accepted length, and the best
is written into the datastore's meta.json, where the service reads it. The steps in detail:
docs/datastore.md, Fusion.
"""
from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.prompts import tuning_prompts
from specmesh_services.common.tree import TokenTree
from specmesh_services.datastore.engine import open_for_target
from specmesh_services.datastore.fusion import DATASTORE, INPUT, Discounts, WeightedTree, fuse
from specmesh_services.datastore.input_index import InputIndex
from specmesh_services.datastore.suffix import SuffixDatastore, write_meta

GRID = {
    "datastore_decay": [1.0, 0.8],
    "input_scale": [0.2, 0.4, 0.6, 0.8, 1.0, 1.5],
    "input_decay": [1.0, 0.8],
    "input_match": [[1.0, 1.0, 1.0, 1.0], [0.5, 0.7, 0.9, 1.0], [0.2, 0.5, 0.8, 1.0],
                    [0.05, 0.2, 0.6, 1.0]],
}


def grid() -> list[Discounts]:
    keys = list(GRID)
    return [Discounts(**dict(zip(keys, values))) for values in itertools.product(*GRID.values())]


def accepted_length(tree: TokenTree, truth: Sequence[int]) -> int:
    """Draft tokens the target accepts under greedy decoding: the longest root path of `tree`
    that equals the start of `truth`."""
    children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in
                                            enumerate(zip(tree.tokens, tree.parents))}
    node, depth = -1, 0
    while depth < len(truth) and (node, truth[depth]) in children:
        node = children[(node, truth[depth])]
        depth += 1
    return depth


@dataclass
class Position:
    """The sources' trees at one position of one ground-truth sequence."""

    store_tree: WeightedTree
    input_trees: list[tuple[WeightedTree, int]]


def precompute(store: SuffixDatastore, settings: Settings, prompt: list[int],
               output: list[int]) -> list[Position]:
    ds = settings.datastore
    depth = settings.speculation.depth
    index = InputIndex(ds.prefix_len)
    index.extend(prompt)
    contexts, inputs = [], []
    for i in range(len(output)):
        contexts.append(index.tokens[-ds.prefix_len:])
        inputs.append(index.continuations(depth))
        index.extend(output[i:i + 1])
    trees = store.continuations_batch(contexts, depth, ds.prefix_len, ds.max_conts, ds.min_conts)
    return [Position(t, inp) for t, inp in zip(trees, inputs)]


def simulate(positions: list[list[Position]], outputs: list[list[int]], discounts: Discounts,
             max_nodes: int, max_depth: int) -> float:
    tokens = steps = 0
    for seq, output in zip(positions, outputs):
        i = 0
        while i < len(output):
            pos = seq[i]
            sources = [(DATASTORE, pos.store_tree, 0)] + [(INPUT, t, m) for t, m in pos.input_trees]
            tree = fuse(sources, max_nodes, max_depth, discounts)
            emitted = min(accepted_length(tree, output[i:]) + 1, len(output) - i)
            i += emitted
            tokens += emitted
            steps += 1
    return tokens / steps if steps else 0.0


def ground_truth(settings: Settings, store: SuffixDatastore, tokenizer, count: int,
                 max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the target's greedy continuations), cached in the datastore's directory."""
    dtype = models.resolve_dtype(settings.dtype)
    model = settings.model.replace("/", "--")  # a directory or a Hub id names no file
    cache = store.path / f"tune-truth-{model}-{str(dtype)[6:]}-{count}x{max_tokens}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        return data["prompts"], data["outputs"]
    prompts = tuning_prompts(tokenizer, count)
    model = models.load_model(models.resolve(settings.model, settings.cache_dir), dtype,
                              linear=settings.linear)
    outputs = []
    for ids in tqdm(prompts, desc="ground truth (target greedy)", unit=" prompts"):
        x = torch.tensor([ids])
        with torch.inference_mode():
            seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_id)
        outputs.append(seq[0, len(ids):].tolist())
    cache.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    return prompts, outputs


def main(settings: Settings, count: int, max_tokens: int) -> int:
    tokenizer = models.load_tokenizer(models.resolve(settings.model, settings.cache_dir))
    store = open_for_target(settings, tokenizer)
    prompts, outputs = ground_truth(settings, store, tokenizer, count, max_tokens)
    start = time.perf_counter()
    positions = [precompute(store, settings, p, o) for p, o in
                 tqdm(list(zip(prompts, outputs)), desc="lookups", unit=" sequences")]
    max_nodes, max_depth = settings.speculation.max_nodes, settings.speculation.depth
    current = Discounts.model_validate(store.meta["discounts"]) if "discounts" in store.meta \
        else Discounts()
    baseline = simulate(positions, outputs, current, max_nodes, max_depth)
    scored = [(simulate(positions, outputs, d, max_nodes, max_depth), d)
              for d in tqdm(grid(), desc="grid", unit=" settings")]
    scored.sort(key=lambda item: -item[0])
    print(f"{len(prompts)} sequences, {sum(map(len, outputs))} tokens, {max_nodes} nodes / "
          f"depth {max_depth} per step, {time.perf_counter() - start:.1f} s")
    print(f"current discounts: mean accepted length {baseline:.3f}")
    for score, d in scored[:5]:
        print(f"  {score:.3f}  {d.model_dump_json()}")
    best_score, best = scored[0]
    if best_score > baseline:
        meta = {**store.meta, "discounts": best.model_dump(),
                "tuning": {"mean_accepted_length": best_score, "sequences": len(prompts),
                           "max_nodes": max_nodes, "max_depth": max_depth,
                           "model": settings.model}}
        write_meta(store.path, meta)
        print(f"wrote the best discounts to {store.path / 'meta.json'}")
    else:
        print("the current discounts are already the best of the grid: meta.json unchanged")
    return 0
