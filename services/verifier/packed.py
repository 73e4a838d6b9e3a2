"""One forward pass of the target over a packed, ragged batch of segments.

A segment is one request's new rows in a step: an optional causal chain (prefill or re-prefill),
then the tree's root and nodes under the ancestor mask. All rows form one `[1, T]` input (no
padding): linears, MLPs and the LM head run once over T rows, attention per segment over its own
prefix (read from the KV store through its slot list) and its new rows (docs/verifier.md).
Attention plugs into transformers' attention-function registry as "specmesh", switched on only
for the duration of a packed forward; a `LeanDecoder` target (common/lean.py) runs the same
attention body in the project's own loop (docs/decisions/lean-target-forward.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specmesh_kernels.backend import AttentionBackend
from specmesh_services.common.kv import KVStore, Segment  # Segment: imported from here too
from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.lm import attention_implementation, model_configs
from specmesh_services.verifier import prune

log = logging.getLogger(__name__)

ATTN_NAME = "specmesh"
# prompt rows in a step with tree rows go through the prompt products (a native target's dense
# copy) from this many on; fewer ride with the tree rows (one call instead of two)
PROMPT_SPLIT_ROWS = 16


@dataclass(frozen=True)
class PackedBatch:
    """What the attention function needs, built once per forward."""

    store: KVStore
    backend: AttentionBackend
    new_slots: torch.Tensor  # [T] slot of each new row (its K/V are written there)
    qo_indptr: torch.Tensor  # [S + 1] new rows of segment s: qo_indptr[s] .. qo_indptr[s + 1]
    kv_indptr: torch.Tensor  # [S + 1] kv_slots range of segment s
    kv_slots: torch.Tensor  # [sum kv_len] slots of each segment's positions 0 .. start + n - 1
    tree_mask: torch.Tensor  # [sum n_s^2] bool, row-major [n_s, n_s] blocks
    mask_indptr: torch.Tensor  # [S + 1]


def _specmesh_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        specmesh: PackedBatch | None = None, **kwargs):
    """transformers attention function. query: [1, H, T, D]; key/value: [1, KVH, T, D] (the new
    rows, RoPE applied). Returns ([1, T, H, D], None)."""
    if specmesh is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    batch, layer = specmesh, module.layer_idx
    k_layer, v_layer = batch.store.k[layer], batch.store.v[layer]  # [slots, KVH, D]
    k_layer.index_copy_(0, batch.new_slots, key[0].transpose(0, 1).to(k_layer.dtype))
    v_layer.index_copy_(0, batch.new_slots, value[0].transpose(0, 1).to(v_layer.dtype))
    out = batch.backend.attend(query[0].transpose(0, 1), k_layer, v_layer, batch.qo_indptr,
                               batch.kv_indptr, batch.kv_slots, batch.tree_mask,
                               batch.mask_indptr, scaling)  # [T, H, D]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, _specmesh_attention)


class PackedTarget:
    """The target (a transformers model or a `LeanDecoder`) plus the KV store and attention
    backend its packed forward uses. After a forward with the lean decoder, `hidden` holds each
    segment's final hidden states of the rows that got logits (draft heads train on them)."""

    def __init__(self, model, store: KVStore, backend: AttentionBackend) -> None:
        self.lean = model if isinstance(model, LeanDecoder) else None
        self.model = None if self.lean is not None else model
        self._configs = model_configs(model) if self.lean is None else []
        self.store = store
        self.backend = backend
        self.device = store.k.device
        self.hidden: list[torch.Tensor] = []
        # early pruning (verifier/prune.py, lean target only): after a forward, each segment's
        # kept tree rows (None: all of them)
        self.pruner = None
        self.survivors: list[torch.Tensor | None] = []
        # bucketed steps replayed from CUDA graphs (common/graphs.py; lean target only)
        self.graphs = None
        self.last_bucket = 0  # rows the last forward was padded to (0: run eagerly)
        self.last_chunks = 0  # its split-KV chunks (0: not split)

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Runs all segments in one pass (their positions reserved in the store); returns each
        segment's logits rows from `logits_from` on: [n_s - logits_from, V] float32."""
        self.last_bucket = self.last_chunks = 0
        if self.graphs is not None and self.pruner is None and self.graphs.covers(segments):
            logits, self.hidden = self.graphs.forward(segments)
            self.survivors = [None] * len(segments)
            self.last_bucket, self.last_chunks = self.graphs.last_bucket, self.graphs.last_chunks
            return logits
        batch, keep = self._build(segments)
        if self.lean is not None:
            return self._run_lean(segments, batch, keep)
        with attention_implementation(self._configs, ATTN_NAME):
            return self._run(segments, batch, keep)

    def _run_lean(self, segments: list[Segment], batch: PackedBatch, keep: torch.Tensor
                  ) -> list[torch.Tensor]:
        lean, store = self.lean, self.store
        self.survivors = [None] * len(segments)
        current = [batch]  # what attention reads: switched to the survivors' after pruning

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            batch = current[0]
            k_layer, v_layer = store.k[layer], store.v[layer]  # [slots, KVH, D]
            k_layer.index_copy_(0, batch.new_slots, k.to(k_layer.dtype))
            v_layer.index_copy_(0, batch.new_slots, v.to(v_layer.dtype))
            return batch.backend.attend(q, k_layer, v_layer, batch.qo_indptr, batch.kv_indptr,
                                        batch.kv_slots, batch.tree_mask, batch.mask_indptr,
                                        lean.scale)

        tokens = torch.cat([s.tokens for s in segments]).to(self.device)
        positions = torch.cat([s.positions for s in segments]).to(self.device)
        prompt = None  # prompt rows beside tree rows: their own products when there are many
        if lean.prefill_layers is not None and keep.numel() \
                and tokens.shape[0] - keep.numel() >= PROMPT_SPLIT_ROWS:
            is_prompt = torch.ones(tokens.shape[0], dtype=torch.bool)
            is_prompt[keep] = False
            prompt = is_prompt.nonzero().squeeze(1)
            if int(prompt[-1]) == prompt.numel() - 1:  # the first rows: slices
                prompt = prompt.numel()
            else:
                prompt = prompt.to(self.device)
        hidden = lean.run(tokens, positions, attend, keep.to(self.device), prompt,
                          self._prune_hook(segments, current))
        if hidden is None:  # prefill chunks only
            self.hidden = [torch.empty(0) for _ in segments]
            return [torch.empty(0) for _ in segments]
        sizes = [s.num_rows - s.logits_from if kept is None else int(kept.numel())
                 for s, kept in zip(segments, self.survivors)]
        self.hidden = list(hidden.split(sizes))
        return list(lean.logits(hidden).split(sizes))

    def _prune_hook(self, segments: list[Segment], current: list[PackedBatch]):
        """(layer, keep) for `LeanDecoder.run` when the pruner has tree nodes to judge."""
        if self.pruner is None:
            return None
        offsets = torch.tensor([0, *(s.num_rows for s in segments)]).cumsum(0).tolist()
        nodes = prune.plan(segments, offsets)
        if nodes is None:
            return None

        def keep(x: torch.Tensor) -> torch.Tensor | None:
            alive = self.pruner.keep(x, nodes)
            if alive is None:
                return None
            rows = [alive[a:a + s.num_rows] for s, a in zip(segments, offsets)]
            current[0] = self._build(segments, rows)[0]
            self.survivors = [None if bool(r.all()) else r[s.logits_from:].nonzero().squeeze(1)
                              for s, r in zip(segments, rows)]
            return alive.to(x.device)
        return self.pruner.layer, keep

    def _run(self, segments: list[Segment], batch: PackedBatch, keep: torch.Tensor
             ) -> list[torch.Tensor]:
        self.hidden = []
        self.survivors = [None] * len(segments)  # no early pruning on this path
        tokens = torch.cat([s.tokens for s in segments]).view(1, -1).to(self.device)
        positions = torch.cat([s.positions for s in segments]).view(1, -1).to(self.device)
        if keep.numel() == 0:  # prefill chunks only: skip the LM head
            self.model.model(input_ids=tokens, position_ids=positions, use_cache=False,
                             specmesh=batch)
            return [torch.empty(0) for _ in segments]
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=False,
                         logits_to_keep=keep.to(self.device), specmesh=batch)
        logits = out.logits[0].float()
        pieces, at = [], 0
        for s in segments:
            n = s.num_rows - s.logits_from
            pieces.append(logits[at:at + n])
            at += n
        return pieces

    def _build(self, segments: list[Segment], alive: list[torch.Tensor] | None = None
               ) -> tuple[PackedBatch, torch.Tensor]:
        """The batch metadata of `segments` (`alive`: each segment's new rows kept by early
        pruning; their mask is the compiled one subsampled, the rest of the pass drops the
        others) and the rows that get logits."""
        store = self.store
        new_slots, kv_slots, masks, keep = [], [], [], []
        qo, kv, mk = [0], [0], [0]
        for i, s in enumerate(segments):
            n = s.num_rows
            assert s.mask.shape == (n, n) and s.positions.shape == (n,), "segment shapes"
            slots = store.slots(s.request_id, 0, s.start + n)
            new, mask = slots[s.start:], s.mask
            if alive is not None:
                rows = alive[i]
                new, mask, n = new[rows], mask[rows][:, rows], int(rows.sum())
                slots = torch.cat([slots[:s.start], new])
            kv_slots.append(slots)
            new_slots.append(new)
            masks.append(mask.reshape(-1))
            keep.append(torch.arange(qo[-1] + s.logits_from, qo[-1] + n))
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + s.start + n)
            mk.append(mk[-1] + n * n)
        dev = self.device
        batch = PackedBatch(
            store=store, backend=self.backend, new_slots=torch.cat(new_slots).to(dev),
            qo_indptr=torch.tensor(qo, device=dev), kv_indptr=torch.tensor(kv, device=dev),
            kv_slots=torch.cat(kv_slots).to(dev), tree_mask=torch.cat(masks).to(dev),
            mask_indptr=torch.tensor(mk, device=dev))
        return batch, torch.cat(keep)
