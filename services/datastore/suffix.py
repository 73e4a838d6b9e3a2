"""The suffix-array datastore (SSSD 3.1.2, built as in REST): a large tokenized corpus searched
for the continuations of a request's last tokens; the datastore engine's corpus source.

On disk: tokens.u32 (every document's tokens, each followed by SEPARATOR), the suffix array
sa.i32 / sa.i64 (libdivsufsort) and meta.json; memory-mapped read-only at serve time (the
format: docs/datastore.md, Build). `continuations_batch` looks up each context's last P..1 tokens
and merges the picks into a weighted tree (fusion.py). Departures from REST / SSSD, each with
its reason in docs/decisions/datastore-search.md:
- shorter prefixes are added while fewer than `min_conts` occurrences were found;
- a range of more than `max_conts` suffixes is sampled at regular intervals, a pick weighing R / m;
- batches of up to SCALAR_PREFIXES search one prefix at a time with `bisect`, larger ones numpy.
"""
from __future__ import annotations

import bisect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

from specmesh_services.datastore.fusion import WeightedTree

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    def tqdm(iterable, **_):
        return iterable

SEPARATOR = np.uint32(0xFFFFFFFF)
FORMAT_VERSION = 1
INT32_MAX = 2**31 - 1
SA_FILES = {"int32": "sa.i32", "int64": "sa.i64"}
# up to this many prefixes a batch is searched one prefix at a time with `bisect` (a few µs a
# prefix); more take the vectorized search, whose ~25 steps of numpy calls cost ~0.4 ms
# whatever the batch (docs/decisions/datastore-search.md)
SCALAR_PREFIXES = 64
MAX_TABLE_TOKEN = 1 << 24  # the first-token table covers ids below this (every tokenizer's)


def build_datastore(out_dir: Path, documents: Iterable[Sequence[int]], meta: dict,
                    progress: bool = True) -> dict:
    """Writes the datastore of `documents` (token id sequences; empty ones are skipped) to
    `out_dir`, replacing any previous one; returns its meta."""
    from pydivsufsort import divsufsort

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        num_docs = 0
        separator = np.array([SEPARATOR], "<u4").tobytes()
        with open(tmp / "tokens.u32", "wb") as f:
            for doc in tqdm(documents, desc="documents", unit=" docs", disable=not progress):
                arr = np.asarray(doc, dtype=np.int64)
                if not arr.size:
                    continue
                if arr.min() < 0 or arr.max() >= SEPARATOR:
                    raise ValueError("token ids must be in [0, 0xFFFFFFFF): 0xFFFFFFFF is the "
                                     "document separator")
                f.write(arr.astype("<u4").tobytes())
                f.write(separator)
                num_docs += 1
        tokens = np.fromfile(tmp / "tokens.u32", dtype="<u4")
        if not num_docs:
            raise ValueError("the corpus holds no tokens")
        if progress:
            print(f"suffix array of {tokens.size:,} tokens...", flush=True)
        sa_dtype = "int32" if tokens.size <= INT32_MAX else "int64"
        divsufsort(tokens).astype(np.dtype(sa_dtype).newbyteorder("<")).tofile(
            tmp / SA_FILES[sa_dtype])
        meta = {**meta, "format_version": FORMAT_VERSION, "num_tokens": int(tokens.size),
                "num_documents": num_docs, "sa_dtype": sa_dtype,
                "bytes": sum((tmp / name).stat().st_size
                             for name in ("tokens.u32", SA_FILES[sa_dtype])),
                "build_seconds": round(time.perf_counter() - start, 3)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _replace_dir(src: Path, dst: Path) -> None:
    """Renames `src` to `dst`; an existing `dst` is first renamed aside, so `dst` is always either
    the old complete store or the new one (never a half-written one)."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}-old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_meta(path: Path, meta: dict) -> None:
    """Replaces a datastore's meta.json atomically (e.g. with tuned discounts)."""
    tmp = Path(path) / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, Path(path) / "meta.json")


def first_token_starts(tokens: np.ndarray) -> list[int]:
    """starts[t]: the first suffix-array row whose suffix starts with a token >= t, for t up to
    the largest token + 1 (the suffixes are sorted by their first token, so it is the number of
    positions holding a smaller token: a histogram's running sum, ~0.1 s for 28M tokens). A
    one-token prefix's range is then read, not searched, and a longer one is searched within
    its first token's range: ~10-20 steps instead of ~25, each a random read of both arrays.
    Empty when the ids are too large for a table (no tokenizer's are): every search then spans
    the whole array."""
    counts = np.zeros(1, np.int64)
    for at in range(0, tokens.size, 1 << 23):  # bounded temporaries
        chunk = tokens[at:at + (1 << 23)]
        chunk = chunk[chunk != SEPARATOR]
        if chunk.size and int(chunk.max()) >= MAX_TABLE_TOKEN:
            return []
        part = np.bincount(chunk, minlength=counts.size)
        part[:counts.size] += counts
        counts = part
    return np.concatenate([[0], np.cumsum(counts)]).tolist()


class SuffixDatastore:
    """A built datastore, memory-mapped (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, meta: dict, path: Path) -> None:
        self.tokens = tokens
        self.sa = sa
        self.meta = meta
        self.path = path
        # the arrays as flat memoryviews: indexing one gives a Python int without numpy's
        # per-call cost (native byte order only; else the vectorized search serves every batch)
        native = tokens.dtype.isnative and sa.dtype.isnative and tokens.size
        self._token_view = memoryview(np.asarray(tokens)).cast("B").cast("I") if native else None
        self._sa_view = (memoryview(np.asarray(sa)).cast("B").cast("i" if sa.itemsize == 4
                                                                    else "q")
                         if native else None)
        self._starts = first_token_starts(np.asarray(tokens))

    @classmethod
    def open(cls, path: Path) -> SuffixDatastore:
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: datastore format {meta.get('format_version')}, this "
                             f"version reads {FORMAT_VERSION}: rebuild it")
        sa_dtype = meta["sa_dtype"]
        tokens = np.memmap(path / "tokens.u32", dtype="<u4", mode="r")
        sa = np.memmap(path / SA_FILES[sa_dtype], dtype=np.dtype(sa_dtype).newbyteorder("<"),
                       mode="r")
        if tokens.size != meta["num_tokens"] or sa.size != tokens.size:
            raise ValueError(f"{path}: files do not match meta.json (truncated copy?): rebuild it")
        return cls(tokens, sa, meta, path)

    def __len__(self) -> int:
        return int(self.tokens.size)

    # search ----------------------------------------------------------------------------------
    def count(self, prefix: Sequence[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes that start with `prefix`
        (hi - lo = its occurrences)."""
        lo, hi = self.find_batch([prefix])
        return int(lo[0]), int(hi[0])

    def find_batch(self, prefixes: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The suffix-array ranges [lo, hi) of many prefixes. The lower and upper bound searches
        of the whole batch advance together: ~log2(N) vectorized steps, each gathering
        tokens[sa[mid] + k] for every query and prefix position k."""
        b = len(prefixes)
        if b <= SCALAR_PREFIXES and self._sa_view is not None:
            found = [self._find_one(list(p)) for p in prefixes]
            return (np.array([lo for lo, _ in found], np.int64),
                    np.array([hi for _, hi in found], np.int64))
        lengths = np.fromiter((len(p) for p in prefixes), np.int64, count=b)
        width = int(lengths.max(initial=0))
        if width == 0:  # an empty prefix matches every suffix
            return np.zeros(b, np.int64), np.full(b, len(self), np.int64)
        query = np.full((b, width), -1, np.int64)
        for i, prefix in enumerate(prefixes):
            query[i, :len(prefix)] = prefix
        bounds = self._bounds(np.concatenate([query, query]), np.concatenate([lengths, lengths]),
                              upper=np.repeat([False, True], b))
        return bounds[:b], bounds[b:]

    def _find_one(self, prefix: list[int]) -> tuple[int, int]:
        """One prefix's range by `bisect` over the suffix array within its first token's rows,
        keyed by each suffix's first len(prefix) tokens as a list (list order is the
        token-by-token order; a suffix cut by the end of the array is a shorter list and sorts
        first, as in `_bounds`)."""
        if not prefix:
            return 0, len(self)
        starts, first = self._starts, prefix[0]
        if not starts:
            lo, hi = 0, len(self)
        elif not 0 <= first < len(starts) - 1:  # a token the corpus never holds
            at = starts[-1] if first >= 0 else 0  # before the separators' suffixes
            return at, at
        else:
            lo, hi = starts[first], starts[first + 1]
        if len(prefix) == 1 or lo == hi:
            return lo, hi
        tokens, width = self._token_view, len(prefix)

        def key(start: int) -> list[int]:
            return tokens[start:start + width].tolist()
        lo = bisect.bisect_left(self._sa_view, prefix, lo, hi, key=key)
        return lo, bisect.bisect_right(self._sa_view, prefix, lo, hi, key=key)

    def _bounds(self, query: np.ndarray, lengths: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Per row: the first suffix-array index whose suffix compares > the query (`upper`) or
        >= it (lower bound), comparing only the query's first `lengths` tokens."""
        n = len(self)
        rows = np.arange(query.shape[0])
        cols = np.arange(query.shape[1])
        in_query = cols[None, :] < lengths[:, None]
        lo = np.zeros(len(rows), np.int64)
        hi = np.full(len(rows), n, np.int64)
        while (active := lo < hi).any():
            mid = (lo + hi) // 2
            idx = np.asarray(self.sa[np.minimum(mid, n - 1)], np.int64)[:, None] + cols
            values = np.asarray(self.tokens[np.minimum(idx, n - 1)], np.int64)
            values[idx >= n] = -1  # past the end: the shorter suffix sorts first
            differs = (values != query) & in_query
            first = differs.argmax(axis=1)
            sign = np.where(differs.any(axis=1),
                            np.sign(values[rows, first] - query[rows, first]), 0)
            go_right = np.where(upper, sign <= 0, sign < 0)
            lo = np.where(active & go_right, mid + 1, lo)
            hi = np.where(active & ~go_right, mid, hi)
        return lo

    # retrieval -------------------------------------------------------------------------------
    def read(self, starts: np.ndarray, depth: int) -> np.ndarray:
        """[len(starts), depth]: the tokens from each start, -1 from the first SEPARATOR on."""
        n = len(self)
        idx = np.asarray(starts, np.int64)[:, None] + np.arange(depth)
        rows = np.asarray(self.tokens[np.minimum(idx, n - 1)], np.int64)
        ended = np.logical_or.accumulate((rows == SEPARATOR) | (idx >= n), axis=1)
        rows[ended] = -1
        return rows

    def continuations(self, context: Sequence[int], max_depth: int, prefix_len: int = 4,
                      max_conts: int = 100, min_conts: int = 20) -> WeightedTree:
        """The weighted continuation tree of one context (see `continuations_batch`)."""
        return self.continuations_batch([context], max_depth, prefix_len, max_conts,
                                        min_conts)[0]

    def continuations_batch(self, contexts: Sequence[Sequence[int]], max_depth: int,
                            prefix_len: int = 4, max_conts: int = 100, min_conts: int = 20
                            ) -> list[WeightedTree]:
        """One weighted tree of the continuations of each context's last tokens (module
        docstring). Root count = the occurrences of every prefix length used."""
        if max_depth <= 0:
            return [WeightedTree() for _ in contexts]
        queries = [(i, length) for i, context in enumerate(contexts)
                   for length in range(min(prefix_len, len(context)), 0, -1)]  # longest first
        # a few queries are searched one at a time, a shorter prefix only when the longer ones
        # found too few; many, all at once (vectorized)
        each = len(queries) <= SCALAR_PREFIXES and self._sa_view is not None
        los, his = (([], []) if each else self.find_batch(
            [contexts[i][len(contexts[i]) - length:] for i, length in queries]))
        # The threshold (SSSD 3.1.2): a context adds its next shorter prefix while fewer than
        # `min_conts` occurrences were collected. The ranges used are summed along the tree edges
        # as the paper says; every occurrence of a longer prefix is also one of each shorter
        # prefix, so its continuation is counted once per prefix length it matched. This is
        # deliberate, not deduplicated: the longest matches, the most specific evidence, weigh
        # more than the shorter prefix's other occurrences.
        # per range used: its context (non-decreasing), prefix length, first row and size
        owner: list[int] = []
        lengths: list[int] = []
        lo: list[int] = []
        size: list[int] = []
        found = [0] * len(contexts)
        for q, (i, length) in enumerate(queries):
            if found[i] >= min_conts:
                continue
            a, b = (self._find_one(list(contexts[i][len(contexts[i]) - length:])) if each
                    else (int(los[q]), int(his[q])))
            if b > a:
                owner.append(i)
                lengths.append(length)
                lo.append(a)
                size.append(b - a)
                found[i] += b - a
        if not owner:
            return [WeightedTree() for _ in contexts]
        sizes = np.array(size, np.int64)
        picks = np.minimum(sizes, max_conts)
        of_range = np.repeat(np.arange(len(sizes)), picks)  # [total picks]: its range
        k = np.arange(of_range.size) - np.repeat(np.cumsum(picks) - picks, picks)  # pick # in it
        r = sizes[of_range]
        # regular intervals: the middle of each of `max_conts` equal slices of a larger range
        # (distinct, since a slice is wider than one suffix); a smaller range is taken whole
        index = np.array(lo, np.int64)[of_range] + np.where(
            r > max_conts, (2 * k + 1) * r // (2 * max_conts), k)
        starts = np.asarray(self.sa[index], np.int64) + np.array(lengths, np.int64)[of_range]
        rows = self.read(starts, max_depth)
        weights = (sizes / picks)[of_range]
        bounds = np.searchsorted(np.array(owner)[of_range], np.arange(len(contexts) + 1))
        return [WeightedTree.from_rows(rows[a:b], weights[a:b], found[i])
                for i, (a, b) in enumerate(pairwise(bounds.tolist()))]
