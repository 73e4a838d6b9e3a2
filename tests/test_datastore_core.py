"""The SSSD datastore's algorithms on literal token arrays, against hand-computed expectations:
suffix-array search (single, batched, at document ends, across separators, vs brute force),
regular-interval sampling, the fallback to shorter prefixes, the prompt + self-output index, the
fusion queue (Algorithm 1), and the lookup engine's index lifecycle. No model; milliseconds."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from pydantic import ValidationError

from specmesh_services.common.config import DatastoreSettings
from specmesh_services.common.rpc import FailedPrecondition
from specmesh_services.common.tree import TokenTree
from specmesh_services.common.datastore_files import DatastoreMismatch, check_family
from specmesh_services.datastore.engine import LookupEngine, LookupRequest
from specmesh_services.datastore.fusion import Discounts, WeightedTree, fuse
from specmesh_services.datastore.input_index import InputIndex
from specmesh_services.datastore import suffix
from specmesh_services.datastore.suffix import SEPARATOR, SuffixDatastore, build_datastore

S = int(SEPARATOR)
# tokens.u32:  1 2 3 1 2 4 S 2 3 S   (positions 0..9)
DOCS = [[1, 2, 3, 1, 2, 4], [2, 3]]


def make_store(tmp_path, docs, name: str = "ds") -> SuffixDatastore:
    build_datastore(tmp_path / name, docs, {"tokenizer": "t"}, progress=False)
    return SuffixDatastore.open(tmp_path / name)


# suffix array -------------------------------------------------------------------------------
@pytest.fixture(params=["bisect", "vectorized"])
def search(request, monkeypatch):
    """Each search test runs over both searches: one prefix at a time and the vectorized one."""
    monkeypatch.setattr(suffix, "SCALAR_PREFIXES", 10**9 if request.param == "bisect" else -1)
    return request.param


def test_suffix_array_and_ranges_by_hand(tmp_path, search):
    store = make_store(tmp_path, DOCS)
    assert np.asarray(store.tokens).tolist() == [1, 2, 3, 1, 2, 4, S, 2, 3, S]
    # the suffixes sorted token by token (S after every token; a suffix that is a prefix of
    # another first):
    #   0: 1 2 3 1..   1: 1 2 4 S..   2: 2 3 1 2..   3: 2 3 S   4: 2 4 S..   5: 3 1 2 4..
    #   6: 3 S         7: 4 S 2 3 S   8: S           9: S 2 3 S
    assert np.asarray(store.sa).tolist() == [0, 3, 1, 7, 4, 2, 8, 5, 9, 6]
    expected = {
        (1, 2): (0, 2),      # positions 0, 3
        (2,): (2, 5),        # 1, 7, 4
        (2, 3): (2, 4),      # 1, and 7: the end of document 2
        (2, 3, 1): (2, 3),   # 1
        (3,): (5, 7),        # 2, 8
        (4,): (7, 8),        # 5: the end of document 1
        (4, 2): (7, 7),      # absent: "4 S 2" crosses the separator (4 S > 4 2: insert at 7)
        (3, 2): (6, 6),      # absent: between "3 1" (row 5) and "3 S" (row 6)
        (9,): (8, 8),        # absent: after every real token, before S
        (0,): (0, 0),        # absent: before everything
        (): (0, 10),         # the empty prefix matches every suffix
    }
    for prefix, bounds in expected.items():
        assert store.count(prefix) == bounds, prefix
    lo, hi = store.find_batch([list(p) for p in expected])
    assert list(zip(lo.tolist(), hi.tolist())) == list(expected.values())
    lo, hi = store.find_batch([])
    assert lo.size == hi.size == 0


def test_build_meta_replace_and_errors(tmp_path):
    meta = build_datastore(tmp_path / "ds", DOCS, {"tokenizer": "fam"}, progress=False)
    assert meta["num_tokens"] == 10 and meta["num_documents"] == 2
    assert meta["sa_dtype"] == "int32" and meta["bytes"] == 10 * 4 + 10 * 4
    assert json.loads((tmp_path / "ds" / "meta.json").read_text()) == meta
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["meta.json", "sa.i32",
                                                                 "tokens.u32"]
    # rebuilding replaces the store; empty documents are skipped; no temp dir is left behind
    meta = build_datastore(tmp_path / "ds", [[5, 6], [], [7]], {"tokenizer": "fam"},
                           progress=False)
    assert meta["num_documents"] == 2
    assert np.asarray(SuffixDatastore.open(tmp_path / "ds").tokens).tolist() == [5, 6, S, 7, S]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with pytest.raises(ValueError, match="no tokens"):
        build_datastore(tmp_path / "empty", [[]], {}, progress=False)
    with pytest.raises(ValueError, match="separator"):
        build_datastore(tmp_path / "bad", [[1, S]], {}, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def random_store(tmp_path, seed: int, alphabet: int, max_len: int, docs: int):
    """A store of `docs` random documents; returns (store, its token list, the rng)."""
    rng = random.Random(seed)
    store = make_store(tmp_path, [[rng.randrange(alphabet) for _ in range(rng.randint(1, max_len))]
                                  for _ in range(docs)])
    return store, np.asarray(store.tokens).tolist(), rng


def test_batched_search_equals_brute_force_on_a_random_corpus(tmp_path, search):
    store, text, rng = random_store(tmp_path, seed=7, alphabet=6, max_len=40, docs=60)
    queries = [[rng.randrange(7) for _ in range(rng.randint(1, 5))] for _ in range(400)]
    lo, hi = store.find_batch(queries)  # token 6 never occurs
    for q, a, b in zip(queries, lo.tolist(), hi.tolist()):
        brute = {i for i in range(len(text)) if text[i:i + len(q)] == q}
        assert sorted(int(p) for p in store.sa[a:b]) == sorted(brute), q


# continuations ------------------------------------------------------------------------------
def test_continuations_are_sampled_at_regular_intervals(tmp_path):
    # 1000 documents "70 x": x = 0 in 500 of them, 1 in 300, 2 in 200. The suffix-array range of
    # [70] holds the 1000 suffixes "70 x S" sorted by x: rows 0-499 x=0, 500-799 x=1, 800-999 x=2.
    # M = 10 regular picks take the middle of each slice of 100: rows 50, 150, .., 950 ->
    # x = 0 (50..450: 5 picks), 1 (550, 650, 750: 3), 2 (850, 950: 2); each weighs 1000 / 10 = 100
    # -> counts 500 / 300 / 200 and probs .5 / .3 / .2: the true distribution
    docs = [[70, 0]] * 500 + [[70, 1]] * 300 + [[70, 2]] * 200
    store = make_store(tmp_path, docs)
    tree = store.continuations([70], max_depth=3, prefix_len=1, max_conts=10, min_conts=1)
    assert tree.count == 1000
    assert tree.paths() == {(0,): 500.0, (1,): 300.0, (2,): 200.0}  # depth 2 is the separator
    assert tree.probs() == pytest.approx([0.5, 0.3, 0.2])
    # REST's first M of the range: all 10 are x = 0, so the tree says P(0) = 1
    lo, _ = store.count([70])
    first = WeightedTree.from_rows(store.read(np.asarray(store.sa[lo:lo + 10]) + 1, 3),
                                   np.ones(10), 10)
    assert first.paths() == {(0,): 10.0} and first.probs() == [1.0]
    # a range of at most M suffixes is taken whole
    whole = store.continuations([70], max_depth=1, prefix_len=1, max_conts=1000, min_conts=1)
    assert whole.paths() == tree.paths()


def test_shorter_prefixes_are_added_while_too_few_continuations(tmp_path):
    # 5 6 9 S 6 8 S 6 8 S: [5, 6] occurs once (-> 9); [6] three times (-> 9, 8, 8)
    store = make_store(tmp_path, [[5, 6, 9], [6, 8], [6, 8]])
    enough = store.continuations([5, 6], max_depth=2, prefix_len=2, min_conts=1)
    assert enough.count == 1 and enough.paths() == {(9,): 1.0}  # depth 2 stops at S
    # min_conts 2: [5, 6]'s 1 occurrence is too few, so [6] adds its 3, summed along the edges:
    # 9: 1 (from [5, 6]) + 1 (from [6], the same occurrence again), 8: 2; root 1 + 3 = 4
    more = store.continuations([5, 6], max_depth=2, prefix_len=2, min_conts=2)
    assert more.count == 4 and more.paths() == {(8,): 2.0, (9,): 2.0}
    assert more.probs() == [0.5, 0.5]
    # prefix_len beyond the context is capped; a context matching nothing gives an empty tree
    batch = store.continuations_batch([[5, 6], [6], [3], []], 2, prefix_len=3, min_conts=2)
    assert [t.paths() for t in batch] == [more.paths(), {(8,): 2.0, (9,): 1.0}, {}, {}]
    assert [t.count for t in batch] == [4, 3, 0, 0]
    assert store.continuations([5, 6], max_depth=0) == WeightedTree()


def test_continuations_equal_a_brute_force_count(tmp_path):
    # without sampling (M >= every range) and with every prefix length used (min_conts huge),
    # the tree counts, per prefix length L, each occurrence of the context's last L tokens
    store, text, rng = random_store(tmp_path, seed=3, alphabet=4, max_len=30, docs=40)
    contexts = [[rng.randrange(4) for _ in range(rng.randint(1, 5))] for _ in range(30)]
    trees = store.continuations_batch(contexts, 4, prefix_len=3, max_conts=10**6,
                                      min_conts=10**6)
    for context, tree in zip(contexts, trees):
        conts = []
        for length in range(1, min(3, len(context)) + 1):
            q = context[-length:]
            for i in range(len(text)):
                if text[i:i + length] == q:
                    cont = text[i + length:i + length + 4]
                    conts.append(cont[:cont.index(S)] if S in cont else cont)
        assert tree == WeightedTree.of(conts), context


def test_weighted_tree_builders_agree():
    # 7 8 x3 (weights 1, 1, 2), 7 9, 6, and an empty continuation (a match at a document end)
    tree = WeightedTree.of([[7, 8], [7, 9], [7, 8], [6], [], [7, 8]], weights=[1, 1, 1, 1, 1, 2])
    # breadth first, siblings by token: 6, 7 | 8, 9 (children of 7 = nodes 2, 3)
    assert tree.tokens == [6, 7, 8, 9] and tree.parents == [-1, -1, 1, 1]
    assert tree.counts == [1.0, 5.0, 4.0, 1.0] and tree.count == 6
    assert list(tree.children(-1)) == [0, 1] and list(tree.children(1)) == [2, 3]
    assert list(tree.children(0)) == list(tree.children(3)) == []
    rows = np.array([[7, 8], [7, 9], [7, 8], [6, -1], [-1, -1], [7, 8]])
    assert WeightedTree.from_rows(rows, np.array([1, 1, 1, 1, 1, 2.0]), 6) == tree
    rng = random.Random(5)
    for _ in range(50):
        conts = [[rng.randrange(3) for _ in range(rng.randint(0, 4))]
                 for _ in range(rng.randint(0, 12))]
        weights = [rng.choice([0.5, 1.0, 3.0]) for _ in conts]
        rows = np.full((len(conts), 4), -1)
        for i, c in enumerate(conts):
            rows[i, :len(c)] = c
        assert WeightedTree.from_rows(rows, np.array(weights), 9) == \
            WeightedTree.of(conts, 9, weights)


# prompt + self-output -----------------------------------------------------------------------
def test_input_index_trees_per_match_length():
    index = InputIndex(prefix_len=4)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2])  # positions 0..7
    # "2" ended at 1 and 4 before the current end (7): continuations "3 1" and "4 1"; the same
    # for "1 2" (ends 1, 4); "4 1 2" and "2 4 1 2" occur only at the end: no trees
    trees = index.continuations(max_depth=2)
    assert [m for _, m in trees] == [1, 2]
    for tree, _ in trees:
        assert tree.count == 2
        assert tree.paths() == {(3,): 1.0, (4,): 1.0, (3, 1): 1.0, (4, 1): 1.0}
        assert tree.probs() == [0.5, 0.5, 0.5, 0.5]


def test_input_index_overlaps_and_cuts_at_the_end():
    index = InputIndex(prefix_len=4)
    index.extend([7, 7, 7, 7])
    by_len = {m: t for t, m in index.continuations(max_depth=3)}
    # L=1 "7" ended at 0, 1, 2: continuations 7 7 7 / 7 7 / 7 (cut at the end of the input)
    assert by_len[1].count == 3 and by_len[1].paths() == {(7,): 3.0, (7, 7): 2.0, (7, 7, 7): 1.0}
    # L=2 "7 7" ended at 1, 2 (overlapping the current end): 7 7 / 7
    assert by_len[2].count == 2 and by_len[2].paths() == {(7,): 2.0, (7, 7): 1.0}
    assert by_len[3].paths() == {(7,): 1.0}  # "7 7 7" ended at 2
    assert set(by_len) == {1, 2, 3}  # "7 7 7 7" only at the end
    assert [m for _, m in index.continuations(3, prefix_len=2)] == [1, 2]
    assert index.continuations(max_depth=0) == [] and InputIndex().continuations(4) == []
    # only the most recent max_occurrences occurrences: "1" at 0, 2, 4 -> 2 and 4 -> 6, 7
    recent = InputIndex(prefix_len=1, max_occurrences=2)
    recent.extend([1, 5, 1, 6, 1, 7, 1])
    (tree, _), = recent.continuations(max_depth=1)
    assert tree.count == 2 and tree.paths() == {(6,): 1.0, (7,): 1.0}


def test_input_index_is_incremental():
    tokens = [5, 1, 2, 5, 1, 3, 5, 1, 2, 2, 5, 1]
    whole = InputIndex(prefix_len=3)
    whole.extend(tokens)
    parts = InputIndex(prefix_len=3)
    for chunk in ([5, 1], [2, 5, 1, 3], [5], [1, 2, 2, 5, 1]):
        parts.extend(chunk)
    assert parts.ends == whole.ends and parts.tokens == whole.tokens
    assert parts.continuations(2) == whole.continuations(2)
    # "5 1" ended at 1, 4, 7 (11 is the end): next "2 5" / "3 5" / "2 2"
    by_len = {m: t.paths() for t, m in whole.continuations(max_depth=2)}
    assert by_len[2] == {(2,): 2.0, (3,): 1.0, (2, 2): 1.0, (2, 5): 1.0, (3, 5): 1.0}
    assert by_len[3] == {(3,): 1.0, (3, 5): 1.0}  # "2 5 1" ended at 4 only


# fusion -------------------------------------------------------------------------------------
def fusion_sources():
    # datastore: 10 11 / 10 12 / 13 -> 10: 2/3, 13: 1/3; below 10: 11: 1/3, 12: 1/3
    store = WeightedTree.of([[10, 11], [10, 12], [13]])
    # input, match length 2: 10 11 twice -> 10: 1, 10 11: 1
    inp = WeightedTree.of([[10, 11], [10, 11]])
    return [("datastore", store, 0), ("input", inp, 2)]


DISCOUNTS = Discounts(input_scale=0.5, input_match=[0.5, 1.0])  # input x 0.5 x 1.0 at match 2


def test_fusion_queue_pops_best_first_and_merges_shared_nodes():
    # queue: ds 10 (2/3), ds 13 (1/3), input 10 (1 x .5). Pop ds 10 -> node 0; push ds 11, ds 12
    # (1/3 each, under node 0). Pop input 10 -> the existing (root, 10) = node 0; push input 11
    # (1 x .5). Pop input 11 -> node 1 under 0. Pop ds 13 (1/3, pushed before ds 11 and 12) ->
    # node 2. Budget 3: stop.
    tree = fuse(fusion_sources(), max_nodes=3, max_depth=4, discounts=DISCOUNTS)
    assert tree.tokens == (10, 11, 13) and tree.parents == (-1, 0, -1)
    assert tree.scores == pytest.approx((2 / 3, 0.5, 1 / 3))
    assert tree.source_names == ("datastore", "input") and tree.sources == (0, 1, 0)
    # more budget: ds 11 finds the existing (node 0, 11); ds 12 becomes node 3; the queue empties
    tree = fuse(fusion_sources(), max_nodes=10, max_depth=4, discounts=DISCOUNTS)
    assert tree.tokens == (10, 11, 13, 12) and tree.parents == (-1, 0, -1, 0)
    assert tree.scores == pytest.approx((2 / 3, 0.5, 1 / 3, 1 / 3))
    assert tree.sources == (0, 1, 0, 0)
    # depth limit 1: only the first level (input 10 merges into node 0)
    tree = fuse(fusion_sources(), max_nodes=10, max_depth=1, discounts=DISCOUNTS)
    assert tree.tokens == (10, 13) and tree.parents == (-1, -1)
    assert fuse(fusion_sources(), 0, 4, DISCOUNTS) == TokenTree()
    assert fuse([("datastore", WeightedTree(), 0)], 5, 4, DISCOUNTS) == TokenTree()


def test_fusion_depth_decay_and_switched_off_source():
    # datastore decay .25: ds 11 / ds 12 at depth 2 = 1/3 x .25 = 1/12; input 11 at depth 2 =
    # 1 x .5 (no input decay). Pops: ds 10 (2/3), input 10 (merged), input 11 (.5), ds 13 (1/3),
    # ds 11 (merged), ds 12 (1/12)
    tree = fuse(fusion_sources(), 10, 4, DISCOUNTS.model_copy(update={"datastore_decay": 0.25}))
    assert tree.tokens == (10, 11, 13, 12)
    assert tree.scores == pytest.approx((2 / 3, 0.5, 1 / 3, 1 / 12))
    # input scale 0: its nodes are never queued, the datastore alone fills the tree
    off = fuse(fusion_sources(), 10, 4, Discounts(input_scale=0.0))
    assert off.tokens == (10, 13, 11, 12) and off.parents == (-1, -1, 0, 0)
    assert off.source_names == ("datastore",) and off.sources == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="unknown draft source"):
        fuse([("model", WeightedTree.of([[1]]), 0)], 5, 4, DISCOUNTS)


def test_discount_formula_and_meta_round_trip():
    d = Discounts(datastore_scale=2.0, datastore_decay=0.5, input_scale=0.4, input_decay=0.9,
                  input_match=[0.1, 0.3, 0.6, 1.0])
    assert d.discount("datastore", 3) == pytest.approx(2.0 * 0.5 ** 2)
    assert d.discount("input", 2, match_len=3) == pytest.approx(0.4 * 0.9 * 0.6)
    assert d.discount("input", 1, match_len=9) == pytest.approx(0.4 * 1.0)  # beyond P: the last
    assert Discounts.model_validate(json.loads(json.dumps(d.model_dump()))) == d
    with pytest.raises(ValidationError):
        Discounts(input_match=[])
    with pytest.raises(ValidationError):
        Discounts.model_validate({"input_scael": 1.0})


# the engine around them -----------------------------------------------------------------------
def test_engine_index_lifecycle(tmp_path):
    now = [0.0]
    store = make_store(tmp_path, [[1, 2, 3, 4], [2, 3, 5]])
    engine = LookupEngine(store, DatastoreSettings(index_ttl_s=10, min_conts=1),
                          clock=lambda: now[0])
    with pytest.raises(FailedPrecondition, match="reset"):
        engine.lookup([LookupRequest("r", [2], 4, 3)])
    # context "9 2 3": the datastore continues "2 3" with 4 and 5
    tree, = engine.lookup([LookupRequest("r", [9, 2, 3], 4, 3, reset=True)])
    assert sorted(tree.tokens) == [4, 5] and tree.source_names == ("datastore",)
    # the accepted "4 9 2" make "2" occur twice in the input: the input continues it with 3
    tree, = engine.lookup([LookupRequest("r", [4, 9, 2], 4, 3)])
    assert engine.requests["r"].index.tokens == [9, 2, 3, 4, 9, 2]
    assert tree.tokens[0] == 3 and "input" in tree.source_names
    assert engine.lookup([LookupRequest("r", [], 0, 3)]) == [TokenTree()]
    now[0] = 11.0  # idle beyond the TTL: dropped on the next call
    engine.lookup([LookupRequest("s", [1], 4, 3, reset=True)])
    assert set(engine.requests) == {"s"}
    assert engine.release(["s", "unknown"]) == 1 and engine.info().active_requests == 0


def test_mismatched_tokenizer_family_is_refused():
    check_family({"tokenizer": "abc"}, "abc", "/ds")
    with pytest.raises(DatastoreMismatch, match="tokenizer family abc.*target's is xyz"):
        check_family({"tokenizer": "abc", "model": "m"}, "xyz", "/ds")
