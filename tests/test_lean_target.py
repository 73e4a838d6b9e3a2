"""The verifier's lean target forward (common/lean.py through verifier/packed.py) against
transformers' forward of the same weights through the same packed batch, KV store and attention
backend: logits of prefill rows, a one-row step and a tree under its ancestor mask, mixed in one
pass, within float rounding; the final hidden states it keeps; what `target_runner` serves.
Greedy identity of the whole mesh with the lean target is tested by the lossless tests
(base_settings: target_runner auto = lean for SmolLM2) and, for native weights, by
tests/test_bf16_ties.py."""
from __future__ import annotations

import pytest
import torch

from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.lm import CausalLM
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.packed import Segment
from specmesh_services.verifier.server import load_target
from specmesh_kernels import tree_attention
from specmesh_kernels.int4 import Int4Linear, int4_supports

FLOAT32_ATOL = 1e-4  # measured ~1e-5 on logits of magnitude ~20
NATIVE_ATOL = 0.05  # int4: bf16 activations round differently after fused products (~1e-2)


def chain(rid: str, tokens: list[int], start: int, logits: bool) -> Segment:
    n = len(tokens)
    return Segment(rid, start, torch.tensor(tokens), torch.arange(start, start + n),
                   torch.ones(n, n, dtype=torch.bool).tril(), logits_from=0 if logits else n)


def tree(rid: str, tokens: list[int], parents: list[int], start: int) -> Segment:
    """Row 0 is the root (parent -1); each row sees itself and its ancestors."""
    n = len(tokens)
    mask, depth = torch.eye(n, dtype=torch.bool), [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return Segment(rid, start, torch.tensor(tokens), start + torch.tensor(depth), mask, 0)


def packed_steps(engine: VerifierEngine, prompt: list[int]) -> list[torch.Tensor]:
    """Two packed forwards as the verifier runs them: request a's prompt with logits next to b's
    prefill chunk; then a's one-row step next to b's tree. Returns every logits row."""
    a, b = prompt[:40], prompt[3:30]
    for rid, n in (("a", 41), ("b", len(b) + 4)):
        assert engine.store.reserve(rid, n)
    out = engine.target.forward([chain("a", a, 0, True), chain("b", b[:-1], 0, False)])
    engine.store.set_length("a", 40)
    engine.store.set_length("b", len(b) - 1)
    out += engine.target.forward([chain("a", [prompt[40]], 40, True),
                                  tree("b", [b[-1], 17, 99, 512], [-1, 0, 0, 1], len(b) - 1)])
    for rid in ("a", "b"):
        engine.store.free(rid)
    return out


def assert_same_logits(lean, reference, prompt, atol: float):
    limits = EngineLimits(kv_budget_tokens=1024)
    ours = packed_steps(VerifierEngine(lean, limits=limits), prompt)
    theirs = packed_steps(VerifierEngine(reference, limits=limits), prompt)
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    for x, y in zip(ours, theirs):
        if x.numel():
            torch.testing.assert_close(x, y, atol=atol, rtol=0)
            assert torch.equal(x.argmax(-1), y.argmax(-1)) or atol > FLOAT32_ATOL


@pytest.fixture(scope="module")
def lean_target(base_settings):
    target = load_target(base_settings)
    assert isinstance(target, LeanDecoder), "auto serves SmolLM2 through the lean forward"
    return target


def test_lean_logits_equal_transformers_float32(lean_target, target_lm, chat_prompt_ids):
    assert_same_logits(lean_target, target_lm, chat_prompt_ids(1), FLOAT32_ATOL)


@pytest.mark.skipif(int4_supports() is not None, reason=str(int4_supports()))
def test_lean_native_logits_equal_transformers_native(base_settings, chat_prompt_ids):
    native = base_settings.with_overrides(target_weights="native")
    lean = load_target(native)
    reference = load_target(native.with_overrides(target_runner="transformers"))
    assert isinstance(reference, CausalLM)
    fused = [m for m in lean.linears.values() if isinstance(m, Int4Linear)]
    assert len(fused) == 4 * lean.num_layers  # q/k/v, o, gate/up, down: all Q4_1, all int4
    # the loop against transformers' with the same products for every row (prompt rows take
    # the dense copy when served: the next test)
    lean.prefill_layers = None
    assert_same_logits(lean, reference, chat_prompt_ids(2), NATIVE_ATOL)


@pytest.mark.skipif(int4_supports() is not None, reason=str(int4_supports()))
def test_native_prompt_rows_take_the_dense_copy_alone_or_beside_a_tree(base_settings,
                                                                        chat_prompt_ids,
                                                                        monkeypatch):
    """A native target's prompt rows go through the int4 layers' dense copy (`prefill`), tree
    rows through the int4 kernel, whether the prompt is prefilled in a forward of its own or
    beside the tree: the tree's logits agree to float rounding of attention either way, and
    differ by the int4 kernel's rounding when the prompt takes the int4 kernel too. The tree's
    rows take SDPA in both forwards: a lone tree's own attention path sums in another order,
    and its float32 differences (~1e-7) reach the logits through the int4 kernel's bf16 inputs."""
    monkeypatch.setattr(tree_attention, "LONE_ROWS", 0)
    lean_target = load_target(base_settings.with_overrides(target_weights="native"))
    assert lean_target.prefill_layers is not None
    prompt = chat_prompt_ids(3)[:60]
    leaf = tree("a", [prompt[-1], 17, 99, 512], [-1, 0, 0, 1], len(prompt) - 1)

    def tree_logits(separate: bool, dense: bool) -> torch.Tensor:
        engine = VerifierEngine(lean_target, limits=EngineLimits(kv_budget_tokens=1024))
        layers = lean_target.prefill_layers
        lean_target.prefill_layers = layers if dense else None
        try:
            engine.store.reserve("a", len(prompt) + 3)
            head = chain("a", prompt[:-1], 0, False)
            if separate:
                engine.target.forward([head])
                engine.store.set_length("a", len(prompt) - 1)
                return engine.target.forward([leaf])[0]
            segment = Segment("a", 0, torch.cat([head.tokens, leaf.tokens]),
                              torch.cat([head.positions, leaf.positions]),
                              torch.block_diag(head.mask, leaf.mask), head.num_rows)
            segment.mask[head.num_rows:, :head.num_rows] = True
            return engine.target.forward([segment])[0]
        finally:
            lean_target.prefill_layers = layers

    together, alone = tree_logits(False, True), tree_logits(True, True)
    torch.testing.assert_close(together, alone, atol=2e-3, rtol=0)
    int4_prompt = tree_logits(False, False)
    assert (int4_prompt - together).abs().max() > 2e-3


def test_lean_target_keeps_the_accepted_rows_hidden_states(lean_target, chat_prompt_ids):
    engine = VerifierEngine(lean_target, limits=EngineLimits(kv_budget_tokens=1024))
    prompt = chat_prompt_ids(0)
    engine.store.reserve("a", len(prompt) + 3)
    logits = engine.target.forward([chain("a", prompt, 0, True)])[0]
    hidden = engine.target.hidden[0]
    assert hidden.shape == (len(prompt), lean_target.config.hidden_size)
    torch.testing.assert_close(lean_target.logits(hidden), logits)


def test_target_runner_transformers_and_refusals(base_settings, target_path):
    hf = load_target(base_settings.with_overrides(target_runner="transformers"))
    assert isinstance(hf, CausalLM)
    with pytest.raises(ValueError, match="target_runner"):
        base_settings.with_overrides(target_runner="fast")
