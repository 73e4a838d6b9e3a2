"""The paged KV cache manager: preallocated, block-allocated storage shared by all requests (the
verifier's; on CUDA a lean draft model's too), and `Segment`, one request's new rows in a step.

One tensor per K and V, `[num_layers, num_slots, kv_heads, head_dim]`, allocated and written
(zeros) at start-up, so the process holds its budget from the start and its RSS stays flat
under load (docs/verifier.md, KV memory). A request owns a list of blocks of `block_size` slots;
position p lives at slot `blocks[p // block_size] * block_size + p % block_size`, which the
attention kernels read through (kernels/). Accepting a path is KV compaction (Minions 4, EAGLE):
the accepted rows are copied down in place, the length set, and blocks past it freed. When the
slots run out `reserve` fails (the engine evicts or defers); nothing ever grows.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specmesh_kernels.compaction import compact_kv_torch


@dataclass(frozen=True)
class Segment:
    """One request's new rows in a step over the store (the packed forward, the bucketed step)."""

    request_id: str
    start: int  # position of the first new row (= rows already in the KV store)
    tokens: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long position ids (start + index for a chain, + depth in a tree)
    # [n, n] bool: new row i may attend new row j; the bucketed step (graphs.py) also takes
    # [n, W], W > n: the mask over the last W positions, the ones before always visible
    mask: torch.Tensor
    logits_from: int  # rows >= this need logits (the tree part); n = none (a prefill chunk)
    parents: torch.Tensor | None = None  # tree rows' parent rows (root -1): early pruning

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class SeqBlocks:
    """One request's storage: its blocks and how many positions hold committed rows."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # committed rows (positions 0 .. length - 1)


class KVStore:
    """Block-allocated KV storage for all requests of one verifier."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity_tokens: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 compact: Callable | None = None) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError(f"KV budget of {capacity_tokens} tokens is smaller than one block "
                             f"({block_size} tokens)")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.num_slots = self.num_blocks * block_size
        # one slot more than the budget: where a bucketed step's padding rows write (never read)
        self.scratch_slot = self.num_slots
        shape = (num_layers, self.num_slots + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, KVH, D]
        self.free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() = lowest
        self.seqs: dict[str, SeqBlocks] = {}
        self._compact = compact or compact_kv_torch
        self._offsets = torch.arange(block_size)

    # accounting -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Total positions the budget holds."""
        return self.num_slots

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def bytes_per_token(self) -> int:
        layers, _, heads, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def length(self, request_id: str) -> int:
        seq = self.seqs.get(request_id)
        return seq.length if seq else 0

    def missing_blocks(self, request_id: str, positions: int) -> int:
        """Free blocks `reserve(request_id, positions)` would take."""
        seq = self.seqs.get(request_id)
        owned = len(seq.blocks) if seq else 0
        return max(0, self.blocks_for(positions) - owned)

    # allocation -------------------------------------------------------------------------------
    def reserve(self, request_id: str, positions: int) -> bool:
        """Makes room for positions 0 .. positions - 1; False (nothing taken) if out of budget."""
        need = self.missing_blocks(request_id, positions)
        if need > len(self.free_blocks):
            return False
        seq = self.seqs.setdefault(request_id, SeqBlocks())
        seq.blocks.extend(self.free_blocks.pop() for _ in range(need))
        return True

    def free(self, request_id: str) -> int:
        """Returns all of a request's blocks to the free list; the number of blocks freed."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return 0
        self.free_blocks.extend(reversed(seq.blocks))
        return len(seq.blocks)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Slot ids of positions start .. end - 1 (reserved): [end - start] long."""
        blocks = torch.tensor(self.seqs[request_id].blocks, dtype=torch.long)
        all_slots = (blocks[:, None] * self.block_size + self._offsets).reshape(-1)
        assert end <= all_slots.numel(), f"positions up to {end} not reserved"
        return all_slots[start:end]

    # commit -----------------------------------------------------------------------------------
    def commit(self, request_id: str, base: int, keep: Sequence[int]) -> None:
        """After a step that wrote rows at positions base, base + 1, ...: keeps the rows at
        offsets `keep` (ascending, keep[i] >= i), moved to base .. base + len(keep) - 1, sets
        the length and frees blocks past it."""
        seq = self.seqs[request_id]
        keep = list(keep)
        moves = [(base + r, base + i) for i, r in enumerate(keep) if r != i]
        if moves:
            slots = self.slots(request_id, 0, base + max(keep) + 1)
            device = self.k.device  # slot ids built here, moved in one copy each
            src = slots[[m[0] for m in moves]].to(device, non_blocking=True)
            dst = slots[[m[1] for m in moves]].to(device, non_blocking=True)
            self._compact(self.k, self.v, src, dst)
        seq.length = base + len(keep)
        self.truncate_blocks(request_id)

    def set_length(self, request_id: str, length: int) -> None:
        """Marks positions 0 .. length - 1 as committed (after a prefill chunk)."""
        self.seqs[request_id].length = length

    def truncate_blocks(self, request_id: str) -> None:
        """Frees the blocks past the request's committed length."""
        seq = self.seqs[request_id]
        keep_blocks = self.blocks_for(seq.length)
        while len(seq.blocks) > keep_blocks:
            self.free_blocks.append(seq.blocks.pop())
