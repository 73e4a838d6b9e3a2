"""Per-forward metadata of a packed tree-attention batch (`TreeBatch`), built once per forward.

The verifier passes the same five index tensors (qo_indptr, kv_indptr, kv_slots, tree_mask,
mask_indptr) to the attention of every layer. Turning them into Python ints, per-segment masks
and kernel work tables costs host syncs and small allocations, so it is done once here and
reused by every layer: `tree_attention_torch`, `tree_attention_triton` and the decomposed
kernels all accept `meta=TreeBatch.build(...)`; without it they build one per call.

Layout (backend.AttentionBackend): segment s owns query rows qo[s]:qo[s + 1] (n_s rows) and KV
positions 0 .. kv_len_s - 1 at slots kv_slots[kv[s]:kv[s + 1]]; the first kv_len_s - n_s are
its committed prefix (always visible), the last n_s its new rows (visible under the tree mask).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """Index data of one packed batch of S segments, as Python ints plus device tensors."""

    qo: list[int]  # [S + 1] query rows of segment s: qo[s] .. qo[s + 1] - 1
    kv: list[int]  # [S + 1] kv_slots range of segment s: kv[s] .. kv[s + 1] - 1
    mask_off: list[int]  # [S + 1] start of segment s's [n_s, n_s] block in tree_mask
    kv_slots: torch.Tensor  # [sum kv_len] int64 slot of each segment position
    tree_mask: torch.Tensor  # [sum n_s^2] bool, row-major [n_s, n_s] blocks
    _cache: dict = field(default_factory=dict, compare=False, repr=False)  # derived tables

    @staticmethod
    def build(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_slots: torch.Tensor,
              tree_mask: torch.Tensor, mask_indptr: torch.Tensor) -> TreeBatch:
        """Validates the index tensors (cheap, host-side) and converts them once."""
        qo, kv, mk = qo_indptr.tolist(), kv_indptr.tolist(), mask_indptr.tolist()
        assert len(qo) == len(kv) == len(mk) >= 2, "indptr tensors must be [S + 1], S >= 1"
        assert qo[0] == kv[0] == mk[0] == 0, "indptr tensors must start at 0"
        assert tree_mask.dtype == torch.bool and tree_mask.dim() == 1, "tree_mask: flat bool"
        assert kv_slots.dim() == 1 and not kv_slots.is_floating_point(), "kv_slots: flat int"
        assert kv[-1] == kv_slots.numel() and mk[-1] == tree_mask.numel(), "indptr ends"
        for s in range(len(qo) - 1):
            n, kv_len = qo[s + 1] - qo[s], kv[s + 1] - kv[s]
            assert 0 <= n <= kv_len, f"segment {s}: {n} new rows but kv_len {kv_len}"
            assert mk[s + 1] - mk[s] == n * n, f"segment {s}: mask block is not [{n}, {n}]"
        return TreeBatch(qo=qo, kv=kv, mask_off=mk, kv_slots=kv_slots.long(), tree_mask=tree_mask)

    # sizes ------------------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return len(self.qo) - 1

    @property
    def num_rows(self) -> int:
        """T, the total number of new (query) rows."""
        return self.qo[-1]

    def n(self, s: int) -> int:
        """New rows of segment s."""
        return self.qo[s + 1] - self.qo[s]

    def kv_len(self, s: int) -> int:
        """KV positions of segment s (prefix + new rows)."""
        return self.kv[s + 1] - self.kv[s]

    def prefix_len(self, s: int) -> int:
        """Committed prefix positions of segment s (visible to all its rows)."""
        return self.kv_len(s) - self.n(s)

    def tree_block(self, s: int) -> torch.Tensor:
        """Segment s's tree mask: [n_s, n_s] bool."""
        n = self.n(s)
        return self.tree_mask[self.mask_off[s]:self.mask_off[s + 1]].view(n, n)

    # derived tables (built on first use, cached for the forward) -------------------------------
    def sdpa_masks(self) -> list[torch.Tensor | None]:
        """Per segment the SDPA bool mask [n_s, kv_len_s] (True = attend), or None when the
        segment is a causal chain without prefix (SDPA's is_causal is then exact and cheaper)."""
        if "sdpa" not in self._cache:
            self._cache["sdpa"] = [self._sdpa_mask(s) for s in range(self.num_segments)]
        return self._cache["sdpa"]

    def _sdpa_mask(self, s: int) -> torch.Tensor | None:
        n, prefix, block = self.n(s), self.prefix_len(s), self.tree_block(s)
        if prefix == 0 and torch.equal(block, _causal(n, block.device)):
            return None
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=block.device)
        mask[:, prefix:] = block
        return mask

    def kv_start(self, s: int) -> int | None:
        """The first slot of segment s when its positions lie in consecutive slots (a lone
        request's blocks usually do), else None: attention then reads K/V as a slice of the
        cache, a view with the strides of a gathered copy (the same products, no copy)."""
        if "starts" not in self._cache:
            self._cache["starts"] = [self._kv_start(t) for t in range(self.num_segments)]
        return self._cache["starts"][s]

    def _kv_start(self, s: int) -> int | None:
        own = self.kv_slots[self.kv[s]:self.kv[s + 1]]
        if own.numel() == 0 or own.device.type != "cpu":
            return None
        first = int(own[0])
        if own.numel() > 1 and not bool((own.diff() == 1).all()):
            return None
        return first

    def padded(self, max_rows: int) -> "PaddedSegments | None":
        """The segments with 1 .. `max_rows` new rows as one padded batch (built once per
        forward), or None if there are none."""
        key = ("padded", max_rows)
        if key not in self._cache:
            self._cache[key] = PaddedSegments.build(self, max_rows)
        return self._cache[key]

    def tree_mask_u8(self) -> torch.Tensor:
        """The tree mask as uint8 [sum n_s^2] (what the Triton kernels load)."""
        if "u8" not in self._cache:
            self._cache["u8"] = self.tree_mask.to(torch.uint8)
        return self._cache["u8"]

    def cached(self, key, make):
        """Returns self._cache[key], computing it with make() on first use (kernel tables)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def _causal(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


@dataclass(frozen=True, eq=False)
class PaddedSegments:
    """Short segments (few new rows each, e.g. one tree per request) laid out as one padded
    batch, so their attention runs as two batched matmuls instead of one kernel call each.

    P segments, up to N new rows and K positions each: `slots` [P, K] their KV slots (padding
    repeats a real slot), `rows` [P, N] their query rows in the packed batch (padding repeats
    the segment's first row), `visible` [P, N, K] bool (padding rows see position 0 only, so
    their softmax stays finite; their outputs are dropped), `out_rows` / `out_index` the real
    rows: o[out_rows] = padded_output.view(P * N, ...)[out_index]."""

    segments: list[int]
    slots: torch.Tensor
    rows: torch.Tensor
    visible: torch.Tensor
    out_rows: torch.Tensor
    out_index: torch.Tensor
    one_row: bool = False  # every segment has one new row: no row padding to undo
    all_visible: bool = False  # and the same positions: no masking at all
    kv_start: int | None = None  # one segment in consecutive slots from here: K/V sliced

    @staticmethod
    def build(meta: TreeBatch, max_rows: int) -> "PaddedSegments | None":
        picked = [s for s in range(meta.num_segments) if 1 <= meta.n(s) <= max_rows]
        if not picked:
            return None
        device = meta.kv_slots.device
        n_max = max(meta.n(s) for s in picked)
        k_max = max(meta.kv_len(s) for s in picked)
        slots = torch.empty(len(picked), k_max, dtype=torch.long, device=device)
        rows = torch.empty(len(picked), n_max, dtype=torch.long, device=device)
        visible = torch.zeros(len(picked), n_max, k_max, dtype=torch.bool, device=device)
        out_rows, out_index = [], []
        for p, s in enumerate(picked):
            n, kv_len, prefix = meta.n(s), meta.kv_len(s), meta.prefix_len(s)
            own = meta.kv_slots[meta.kv[s]:meta.kv[s + 1]]
            slots[p, :kv_len] = own
            slots[p, kv_len:] = own[0]
            rows[p, :n] = torch.arange(meta.qo[s], meta.qo[s + 1], device=device)
            rows[p, n:] = meta.qo[s]
            visible[p, :n, :prefix] = True
            visible[p, :n, prefix:kv_len] = meta.tree_block(s)
            visible[p, n:, 0] = True
            out_rows += range(meta.qo[s], meta.qo[s + 1])
            out_index += range(p * n_max, p * n_max + n)
        one_row = n_max == 1
        return PaddedSegments(picked, slots, rows, visible,
                              torch.tensor(out_rows, device=device),
                              torch.tensor(out_index, device=device), one_row,
                              one_row and all(meta.kv_len(s) == k_max for s in picked),
                              meta.kv_start(picked[0]) if len(picked) == 1 else None)
