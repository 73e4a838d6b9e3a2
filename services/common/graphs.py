"""A step over the paged KV store in static shapes: buckets of rows, replayed from CUDA graphs
(the verifier's step; on CUDA a lean draft model's too: services/drafter/paged.py).

A step whose rows all need logits (trees and plain steps, no prefill chain) is padded to the
next bucket of rows. Its inputs (tokens, positions, the new rows' KV slots, the attention
work-item table, every segment's KV slots and tree mask) go into persistent buffers with two
host-to-device copies; the forward over the bucket (the lean decoder's layers, the Triton tree
attention over the item table, final norm, LM head) is captured once per bucket as a CUDA graph
and replayed: one launch instead of ~10 a layer (the decoder's fused elementwise kernels, RoPE
writing the new rows' K/V to the store). Padding rows write their K/V to the store's scratch
slot and belong to no work item; their outputs are dropped. Batch size needs no buckets of its
own: requests enter only through the item table, padded with empty items to one per row.
A step whose longest KV passes the split-KV threshold replays a graph of its own per bucket
and power-of-two count of KV chunks C: every segment's KV cut into chunks of at most
`SPLIT_KV_CHUNK` positions, each chunk a work item writing a partial state, merged by
log-sum-exp (kernels/decomposed.py), while bucket x C stays within the item table. Prefill
chunks, early pruning and larger split steps run eagerly (vLLM, too, runs prefill outside its
graphs). Without CUDA the same padded forward runs eagerly (tests). A segment's mask may be
wider than its rows ([n, W], the last W positions under it): a draft model's tree level, whose
rows see only their ancestors among the levels before (services/drafter/paged.py). `ahead`
replays several one-row steps back to back, each step's draws fed to the next on the device
(a plain run's round decoded ahead: services/verifier/engine.py).
"""
from __future__ import annotations

import logging
import math
import time

import torch

from specmesh_kernels.backend import SPLIT_KV_CHUNK, SPLIT_KV_MIN
from specmesh_kernels.decomposed import merge_states_triton, plan_chunks
from specmesh_kernels.tree_attention import LOG2E
from specmesh_services.common.kv import KVStore, Segment
from specmesh_services.common.lean import LeanDecoder

log = logging.getLogger(__name__)



def buckets(max_rows: int) -> tuple[int, ...]:
    """Row buckets: powers of two below `max_rows`, then `max_rows` (on a GPU a step's cost
    barely moves with its rows, so coarse buckets waste little)."""
    out = [1 << i for i in range(max(0, math.ceil(math.log2(max_rows))))]
    return tuple(b for b in out if b < max_rows) + (max_rows,)


class StepGraphs:
    """Bucketed forwards of a lean target over its KV store (module docstring). `forward` takes
    the segments `covers` accepts and returns each one's logits [n_s, V] float32 and final hidden
    states [n_s, hidden], views valid until the next forward."""

    def __init__(self, lean: LeanDecoder, store: KVStore, max_rows: int = 256,
                 capture: bool | None = None, split_min: int = SPLIT_KV_MIN,
                 chunk: int = SPLIT_KV_CHUNK, mask_width: int = 0,
                 capture_mode: str = "global") -> None:
        from specmesh_kernels import triton_kernels as tk  # lazy: imports triton

        self.lean, self.store, self.max_rows = lean, store, max_rows
        # the eager path's threshold: graph-replayed, splitting pays from ~2048 positions on
        # an H100 (docs/decisions/cuda-split-kv.md), not yet measured in the step
        self.split_min, self.chunk = split_min, chunk
        self.device = store.k.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.capture_mode = capture_mode  # "thread_local": other threads' CUDA work goes on
        self.buckets = buckets(max_rows)
        self._tk, self._cols = tk, tk.ITEM_COLS  # the work-item table's row width
        self._per_item = tk.rows_per_item(self.device, lean.dtype, lean.heads, lean.kv_heads,
                                          lean.head_dim)
        t = max_rows
        # int64 layout: tokens [t], positions [t], new slots [t], items [t, 10], KV slots
        self._kv_at = (3 + self._cols) * t
        size = self._kv_at + store.num_slots
        pin = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self._dev = torch.zeros(size, dtype=torch.long, device=self.device)
        self.mask_size = t * max(t, mask_width)  # the masks' bytes: sum of n_s x W_s
        self._host_mask = torch.zeros(self.mask_size, dtype=torch.uint8, pin_memory=pin)
        self._dev_mask = torch.zeros(self.mask_size, dtype=torch.uint8, device=self.device)
        self._rows = torch.arange(t, device=self.device)
        self._copied = torch.cuda.Event() if pin else None  # the staging buffers are free again
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (rows, KV chunks)
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self.replays = 0
        self.last_bucket = 0  # rows the last forward was padded to
        self.last_chunks = 0  # KV chunks a segment of it was cut into (0: not split)

    # what runs here ---------------------------------------------------------------------------
    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def chunks(self, segments) -> int:
        """KV chunks of the step's graph: 0 where no segment's KV passes the split threshold,
        else the most any segment is cut into, rounded up to a power of two."""
        longest = max(s.start + s.num_rows for s in segments)
        if longest <= self.split_min:
            return 0
        return 1 << math.ceil(math.log2(-(-longest // self.chunk)))

    def covers(self, segments) -> bool:
        """Every row needs logits, the rows fit the largest bucket, their masks the mask buffer,
        and a split step's work items (bucket x chunks) fit the item table."""
        rows = sum(s.num_rows for s in segments)
        return (bool(segments) and rows <= self.max_rows
                and all(s.logits_from == 0 for s in segments)
                and sum(s.mask.numel() for s in segments) <= self.mask_size
                and self.bucket(rows) * max(1, self.chunks(segments)) <= self.max_rows)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    # the step ---------------------------------------------------------------------------------
    def forward(self, segments) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rows = sum(s.num_rows for s in segments)
        size, chunks = self.bucket(rows), self.chunks(segments)
        self._stage(segments, rows, size, chunks)
        hidden, logits = self._replay(size, chunks)
        sizes = [s.num_rows for s in segments]
        return list(logits[:rows].split(sizes)), list(hidden[:rows].split(sizes))

    def ahead(self, segments, steps: int, draw) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`steps` steps of one row a segment, back to back with no host sync between them
        (vLLM's multi-step decoding): step j's rows are the segments' moved on j positions, and
        their tokens are `draw(j - 1, logits)` of the step before, copied on the device (step
        0's: the segments'). The segments' KV must be reserved through the last step. Returns
        each step's draws ([b] on the device) and the last step's final hidden states."""
        rows, draws = len(segments), []
        size = self.bucket(rows)
        for j in range(steps):
            step = segments if not j else [
                Segment(s.request_id, s.start + j, s.tokens, s.positions + j, s.mask, 0)
                for s in segments]
            chunks = self.chunks(step)
            self._stage(step, rows, size, chunks)
            if j:  # after the staging copy, on the same stream: the drawn tokens win
                self._dev[:rows].copy_(draws[-1])
            hidden, logits = self._replay(size, chunks)
            draws.append(draw(j, logits[:rows]))
        return draws, hidden[:rows]

    def _replay(self, size: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged bucket's forward: replayed (captured on first use), or run eagerly."""
        key = (size, chunks)
        if self.capture:
            graph = self._graphs.get(key) or self._capture(*key)
            graph.replay()
            self.replays += 1
            hidden, logits = self._outputs[key]
        else:
            hidden, logits = self._body(size, chunks)
        self.last_bucket, self.last_chunks = size, chunks
        return hidden, logits

    def _stage(self, segments, rows: int, size: int, chunks: int = 0) -> None:
        """The step's inputs into the persistent buffers: two copies to the device. Split
        (`chunks`): a work item per query block and KV chunk."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging buffers
        t, host, store = self.max_rows, self._host, self.store
        new_slots, items, kv_slots, masks = self._layout(segments, chunks)
        host[:rows] = torch.cat([s.tokens for s in segments])
        host[rows:size] = 0
        host[t:t + rows] = torch.cat([s.positions for s in segments])
        host[t + rows:t + size] = 0
        host[2 * t:2 * t + rows] = new_slots
        host[2 * t + rows:2 * t + size] = store.scratch_slot
        slots_items = size * max(1, chunks)
        table = host[3 * t:3 * t + self._cols * slots_items].view(slots_items, self._cols)
        table[:len(items)] = torch.tensor(items, dtype=torch.long)
        table[len(items):] = 0  # empty items
        end, mask_at = self._kv_at + kv_slots.numel(), masks.numel()
        host[self._kv_at:end] = kv_slots
        self._host_mask[:mask_at] = masks
        cuda = self._copied is not None
        self._dev[:end].copy_(host[:end], non_blocking=cuda)
        self._dev_mask[:mask_at].copy_(self._host_mask[:mask_at], non_blocking=cuda)
        if cuda:
            self._copied.record()

    def _layout(self, segments, chunks: int = 0):
        """What a step over `segments` reads besides tokens and positions: the new rows' slots,
        the work items (one per query block, and per KV chunk where `chunks`), every segment's
        KV slots and its mask, flat."""
        kv_slots, new_slots, masks, items = [], [], [], []
        q_at = kv_at = mask_at = 0
        for s in segments:
            n, width = s.num_rows, s.mask.shape[1]  # the mask covers the last `width` positions
            slots = self.store.slots(s.request_id, 0, s.start + n)
            kv_slots.append(slots)
            new_slots.append(slots[s.start:])
            masks.append(s.mask.reshape(-1))
            for c, (_, lo, hi) in enumerate(plan_chunks([s.start + n], self.chunk)
                                            if chunks else [(0, 0, s.start + n)]):
                items += self._tk.item_rows(q_at, n, kv_at, lo, hi, s.start + n - width,
                                            mask_at, c, self._per_item, width)
            q_at, kv_at, mask_at = q_at + n, kv_at + s.start + n, mask_at + n * width
        return torch.cat(new_slots), items, torch.cat(kv_slots), torch.cat(masks)

    def eager(self, segments) -> list[torch.Tensor]:
        """A step the graphs do not cover (more rows than the largest bucket, a split step past
        the item table, prefill rows), over tensors of its own: one work item per query block
        over the whole KV (no split). Each segment's logits [n_s - logits_from, V] float32."""
        dev, lean, store, tk = self.device, self.lean, self.store, self._tk
        new_slots, items, kv_slots, masks = self._layout(segments)
        new_slots, kv_slots = new_slots.to(dev), kv_slots.to(dev)
        items = torch.tensor(items, dtype=torch.long, device=dev).view(-1, self._cols)
        mask, scale = masks.to(dev, torch.uint8), lean.scale * LOG2E
        keep, at = [], 0
        for s in segments:
            keep.append(torch.arange(at + s.logits_from, at + s.num_rows))
            at += s.num_rows

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:  # the new rows' K/V are in the store (`kv_at`)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            tk.launch_items(q, store.k[layer], store.v[layer], items, kv_slots, mask, scale, out)
            return out

        def kv_at(layer: int):
            return store.k[layer], store.v[layer], new_slots

        tokens = torch.cat([s.tokens for s in segments]).to(dev)
        positions = torch.cat([s.positions for s in segments]).to(dev)
        hidden = lean.run(tokens, positions, attend, torch.cat(keep).to(dev), store=kv_at)
        if hidden is None:  # no row needs logits
            return [torch.empty(0, lean.columns, device=dev) for _ in segments]
        return list(lean.logits(hidden).split([s.num_rows - s.logits_from for s in segments]))

    def _body(self, size: int, chunks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the first `size` rows of the persistent buffers; split into
        `chunks` partial states a row, merged, where `chunks`."""
        t, dev, lean, store, tk = self.max_rows, self._dev, self.lean, self.store, self._tk
        new_slots = dev[2 * t:2 * t + size]
        n_items = size * max(1, chunks)
        items = dev[3 * t:3 * t + self._cols * n_items].view(n_items, self._cols)
        kv_slots, mask, scale = dev[self._kv_at:], self._dev_mask, lean.scale * LOG2E

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:  # the new rows' K/V are in the store (`kv_at`)
            k_layer, v_layer = store.k[layer], store.v[layer]
            if chunks:  # partial states no item writes stay (0, -inf): the merge drops them
                part = torch.zeros(size, chunks, *q.shape[1:], dtype=torch.float32,
                                   device=q.device)
                lse = torch.full(part.shape[:3], float("-inf"), device=q.device)
                tk.launch_items(q, k_layer, v_layer, items, kv_slots, mask, scale, part, lse)
                return merge_states_triton(part, lse, out_dtype=q.dtype)[0]
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            tk.launch_items(q, k_layer, v_layer, items, kv_slots, mask, scale, out)
            return out

        def kv_at(layer: int):
            return store.k[layer], store.v[layer], new_slots

        hidden = lean.run(dev[:size], dev[t:t + size], attend, self._rows[:size], store=kv_at)
        return hidden, lean.logits(hidden)

    def _capture(self, size: int, chunks: int = 0) -> torch.cuda.CUDAGraph:
        """Captures the bucket's forward over the buffers as they are (the current step's
        inputs: the warm-up runs compute what the replay will, so they change nothing)."""
        start = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles the kernels, settles cuBLAS' workspaces
            for _ in range(2):
                self._body(size, chunks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=self.capture_mode):
            self._outputs[size, chunks] = self._body(size, chunks)
        self._graphs[size, chunks] = graph
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        log.info("verify step captured for %d rows, %d KV chunks in %.2f s (%d graphs)", size,
                 chunks, seconds, len(self._graphs))
        return graph

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Captures every bucket, largest first (their memory then reuses the largest's pool),
        over padding-only inputs (no request's KV is touched); returns the seconds it took."""
        start = time.perf_counter()
        t, host = self.max_rows, self._host
        host[:2 * t] = 0
        host[2 * t:3 * t] = self.store.scratch_slot
        host[3 * t:self._kv_at] = 0
        self._dev[:self._kv_at].copy_(host[:self._kv_at])
        for size in sorted(self.buckets, reverse=True):  # split steps' graphs: at first use
            if (size, 0) not in self._graphs:
                self._capture(size)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
