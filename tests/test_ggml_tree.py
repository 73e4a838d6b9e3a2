"""Token trees through llama.cpp's sequence sets, on the default model's GGUF: one decode batch
gives each tree node the logits of its own root-to-node chain decoded alone (chains, wide
trees, two requests and a prefill chunk in one batch), and a committed path then decodes as if
the tree had never been there. Skipped where llama-cpp-python is not installed."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from specmesh_services.common import models
from specmesh_services.verifier.ggml_batch import tree_rows
from specmesh_services.common import ggml_model
from specmesh_services.common.ggml_model import GgmlModel, available

# a row's logits may depend on the rows batched with it where ggml picks other kernels for
# other batch shapes; measured on SmolLM2 Q4_1 (Sapphire Rapids, plain CPU kernels): identical
TOLERANCE = 1e-3  # max |difference| / max |logit| of the row


def tree(seed: int, nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a random tree: row 0 the root, each row's parent an earlier row."""
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes + 1)]
    return [rng.randrange(vocab) for _ in range(nodes + 1)], parents


def test_rows_carry_the_leaves_below_them():
    rows = tree_rows([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3], root_pos=10, main_seq=0,
                     free_seqs=[3, 4, 5])
    assert rows.positions == [10, 11, 12, 11, 12]
    assert rows.leaf_seqs == [3, 4]  # leaves: rows 2 and 4
    assert rows.seq_ids == [[0, 3, 4], [3], [3], [4], [4]]
    chain = tree_rows([1, 2, 3], [-1, 0, 1], 0, 7, [8])
    assert chain.seq_ids == [[7, 8], [8], [8]] and chain.leaf_seqs == [8]
    alone = tree_rows([1], [-1], 4, 2, [])
    assert alone.seq_ids == [[2]] and alone.leaf_seqs == []
    with pytest.raises(ValueError, match="needs as many free sequences"):
        tree_rows([1, 2, 3], [-1, 0, 0], 0, 0, [1])
    with pytest.raises(ValueError, match="must be an earlier row"):
        tree_rows([1, 2], [-1, 1], 0, 0, [1])


@pytest.fixture(scope="module")
def ggml(tokenizer):
    if (why := available()) is not None:
        pytest.skip(why)
    path = models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0]
    model = GgmlModel(path, n_ctx=2048, n_batch=256, n_seq_max=64, threads=2)
    yield model
    model.close()


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def alone(ggml: GgmlModel, context_seq: int, scratch: int, chain: list[int], start: int):
    """The logits of the last token of `chain` decoded alone after `context_seq`'s cells."""
    ggml.seq_copy(context_seq, scratch, 0, start)  # the context only, not the tree's root
    out = ggml.decode(chain, list(range(start, start + len(chain))),
                      [[scratch]] * len(chain), [False] * (len(chain) - 1) + [True])[0]
    ggml.seq_remove(scratch)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max())
    worst = float(np.abs(got - want).max())
    assert worst <= TOLERANCE * scale, f"{what}: max diff {worst:.4f} of {scale:.2f}"


def path_to(rows, parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(rows.tokens[i])
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("shape", ["chain", "wide", "two requests + a prefill chunk"])
def test_each_node_gets_its_own_chains_logits(ggml, tokenizer, shape):
    first = prompt_ids(tokenizer, "The quick brown fox jumps over the lazy dog because")
    second = prompt_ids(tokenizer, "def fibonacci(n):\n    ")
    ggml.seq_remove(-1)
    ggml.decode(first[:-1], list(range(len(first) - 1)), [[0]] * (len(first) - 1),
                [False] * (len(first) - 1))
    requests = [(0, first, list(range(1, 31)))]
    tokens, parents = (([first[-1], *first[:8]], [-1, *range(8)]) if shape == "chain" else
                       tree(1, 24, ggml.vocab_size))
    tokens[0] = first[-1]
    batches = [(tree_rows(tokens, parents, len(first) - 1, 0, requests[0][2]), parents)]
    prefill = []
    if shape.startswith("two"):
        ggml.decode(second[:-1], list(range(len(second) - 1)), [[31]] * (len(second) - 1),
                    [False] * (len(second) - 1))
        t2, p2 = tree(2, 12, ggml.vocab_size)
        t2[0] = second[-1]
        batches.append((tree_rows(t2, p2, len(second) - 1, 31, list(range(32, 60))), p2))
        chunk = prompt_ids(tokenizer, "Once upon a time, in a land far away,")
        prefill = [(c, i, [60], False) for i, c in enumerate(chunk)]
    for rows, _ in batches:
        main = rows.seq_ids[0][0]
        for leaf in rows.leaf_seqs:
            ggml.seq_copy(main, leaf)
    flat = [(t, p, s, True) for rows, _ in batches
            for t, p, s in zip(rows.tokens, rows.positions, rows.seq_ids)] + prefill
    logits = ggml.decode(*map(list, zip(*flat)))
    at = 0
    for (rows, parents), context in zip(batches, (first, second)):
        main = rows.seq_ids[0][0]
        for i in range(len(rows.tokens)):
            chain = path_to(rows, parents, i)
            want = alone(ggml, main, 63, chain, len(context) - 1)
            assert_close(logits[at + i], want, f"{shape}: row {i}")
        at += len(rows.tokens)
    ggml.seq_remove(-1)


def test_a_committed_path_decodes_as_if_the_tree_was_never_there(ggml, tokenizer):
    prompt = prompt_ids(tokenizer, "Speculative decoding makes a large model faster by")
    ggml.seq_remove(-1)
    n = len(prompt) - 1
    ggml.decode(prompt[:-1], list(range(n)), [[0]] * n, [False] * n)
    tokens, parents = tree(5, 20, ggml.vocab_size)
    tokens[0] = prompt[-1]
    rows = tree_rows(tokens, parents, n, 0, list(range(1, 40)))
    for leaf in rows.leaf_seqs:
        ggml.seq_copy(0, leaf)
    ggml.decode(rows.tokens, rows.positions, rows.seq_ids, [True] * len(rows.tokens))
    # accept the path root -> deepest node of the first leaf's branch, one node short of it
    leaf_row = max(i for i in range(len(tokens)) if rows.seq_ids[i] == [rows.leaf_seqs[0]])
    path = path_to(rows, parents, parents[leaf_row])
    accepted = len(path) - 1  # nodes below the root
    ggml.seq_copy(rows.leaf_seqs[0], 0, n + 1, n + 1 + accepted)
    for leaf in rows.leaf_seqs:
        ggml.seq_remove(leaf)
    assert ggml.seq_max(0) == n + accepted
    bonus = 42
    got = ggml.decode([bonus], [n + 1 + accepted], [[0]], [True])[0]
    ggml.seq_remove(-1)
    m = len(prompt) + accepted
    plain = [*prompt, *path[1:], bonus]
    want = ggml.decode(plain, list(range(m + 1)), [[5]] * (m + 1), [False] * m + [True])[0]
    ggml.seq_remove(-1)
    assert_close(got, want, "after the commit")
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_more_rows_than_a_batch_go_through_in_several_calls(tokenizer):
    """A decode of more rows than `n_batch` (a first prompt larger than the step's row budget)
    runs in calls of `n_batch` rows, each seeing the cells of the ones before: every row's
    logits are those of one call over all the rows."""
    path = models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0]
    prompt = prompt_ids(tokenizer, "A long prompt, longer than one batch of rows: " * 4)
    n = len(prompt)
    small = GgmlModel(path, n_ctx=256, n_batch=16, n_seq_max=2, threads=2)
    whole = GgmlModel(path, n_ctx=256, n_batch=256, n_seq_max=2, threads=2)
    args = (prompt, list(range(n)), [[0]] * n, [True] * n)
    got, want = small.decode(*args), whole.decode(*args)
    assert n > 32 and got.shape == want.shape == (n, whole.vocab_size)
    for i in range(n):
        assert_close(got[i], want[i], f"row {i}")
    small.close()
    whole.close()


@pytest.fixture(scope="module")
def q6_k_copy(ggml, tmp_path_factory) -> Path:
    """The default model's GGUF with its matrices requantized to Q6_K where their width allows
    (the FFN down projections; the rest fall back to Q8_0): the 1.5B target's second type."""
    import llama_cpp as lc

    out = tmp_path_factory.mktemp("q6_k") / "smollm2-q6_k.gguf"
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = 18, True  # LLAMA_FTYPE_MOSTLY_Q6_K
    assert lc.llama_model_quantize(str(ggml.path).encode(), str(out).encode(), params) == 0
    return out


@pytest.mark.parametrize("weights", ["Q4_1 as stored", "Q6_K"])
def test_rows_decoded_together_get_the_logits_of_one_row_a_call(ggml, tokenizer, q6_k_copy,
                                                               weights):
    """Up to 31 rows in one call give each row the logits ggml's one-token kernels give it
    (one row a call), bit for bit, with the kernels of deploy/patch-llama-cpp.sh on a CPU
    without AMX (they sum as ggml's own dot products do); llama.cpp's other many-token paths
    (its tiled K-quant product, AMX tiles) move logits by a few percent."""
    import llama_cpp as lc

    model = ggml if weights.startswith("Q4_1") else GgmlModel(q6_k_copy, n_ctx=512, n_batch=64,
                                                              n_seq_max=4, threads=2)
    tokens = prompt_ids(tokenizer, "Speculative decoding lets a small model draft tokens "
                                   "that a large one checks in a single pass. " * 3)[:64]
    model.seq_remove(-1)
    one = np.concatenate([model.decode([t], [i], [[0]], [True]) for i, t in enumerate(tokens)])
    ours = "+specmesh" in lc.__version__ and not ggml_model._has_amx()
    for size in (2, 7, 16, 31):
        many = np.concatenate([
            model.decode(tokens[i:i + size], list(range(i, min(i + size, len(tokens)))),
                         [[1]] * len(tokens[i:i + size]), [True] * len(tokens[i:i + size]))
            for i in range(0, len(tokens), size)])
        model.seq_remove(1)
        if ours:
            assert np.array_equal(many, one), f"{weights}, {size} rows a call"
        else:  # measured: 89% of the argmaxes kept through ggml's tiled Q6_K product
            assert (many.argmax(1) == one.argmax(1)).mean() >= 0.85, f"{weights}, {size} rows"
    model.seq_remove(-1)
    if model is not ggml:
        model.close()


def test_other_sequences_cells_change_no_row(ggml, tokenizer):
    """llama.cpp's one cache holds every request's cells and a row's attention skips the
    other sequences' (masked) ones, 16 mask values a compare with deploy/patch-llama-cpp.sh:
    rows decoded among three other sequences' cells, interleaved with their own, get the
    logits they get in an empty cache, bit for bit."""
    tokens = prompt_ids(tokenizer, "Masked cells of other requests are skipped, not summed. "
                                   "A tree's rows attend to their own ancestors only. " * 2)[:40]
    ggml.seq_remove(-1)
    rows = 4  # several rows a call: one row over 512 cells or more splits the cells by thread
    calls = range(0, len(tokens), rows)

    def decode(seq: int) -> np.ndarray:
        return np.concatenate([ggml.decode(tokens[i:i + rows], list(range(i, i + rows)),
                                           [[seq]] * rows, [True] * rows) for i in calls])
    alone_logits = decode(0)
    ggml.seq_remove(0)
    others = prompt_ids(tokenizer, "Another request's prompt holds these cells. " * 4)[:48]
    for seq in (1, 2, 3):  # their prompts before, then a cell of each between every call
        ggml.decode(others, list(range(len(others))), [[seq]] * len(others),
                    [False] * len(others))
    shared = []
    for k, i in enumerate(calls):
        shared.append(ggml.decode(tokens[i:i + rows], list(range(i, i + rows)),
                                  [[0]] * rows, [True] * rows))
        ggml.decode([others[k]] * 3, [len(others) + k] * 3, [[1], [2], [3]], [False] * 3)
    assert np.array_equal(np.concatenate(shared), alone_logits)
    ggml.seq_remove(-1)
