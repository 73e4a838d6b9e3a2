"""The GPU path, where the CPU suite cannot go: the Triton kernels compiled for CUDA (not
interpreted) on batches of served shapes (SmolLM2-135M's 9 heads / 3 KV heads of 64, Qwen2.5-1.5B's
12 / 2 of 128; contexts up to 2048, trees of up to 64 rows, prefill chains) against the float32
references computed on the CPU, and the lean target forward (common/lean.py) on CUDA against
transformers' forward of the same tiny random-weight Llama / Qwen2 model, in float32 and bf16.

Skipped without CUDA. On a GPU machine set CUDA_VISIBLE_DEVICES, so that conftest.py leaves
TRITON_INTERPRET unset (tests/test_kernels.py then runs all its cases on CUDA too):

    CUDA_VISIBLE_DEVICES=0 .venv/bin/pytest tests/test_cuda.py tests/test_kernels.py -q -s
"""
from __future__ import annotations

import os

import pytest
import torch

from test_kernels import Batch, assert_close, make_batch, reference_lse  # tests/ is on the path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA with compiled Triton (set CUDA_VISIBLE_DEVICES: conftest.py then leaves "
           "TRITON_INTERPRET unset)")

CUDA = torch.device("cuda")
SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}  # heads, KV heads, head dim
BATCHES = {  # name: (prefixes, trees, chain segments); 8 / 8 / 4 segments
    "decode": ([1023, 1, 517, 2047, 64, 300, 1000, 129], [1] * 8, ()),
    "trees": ([1008, 37, 511, 1, 2000, 64, 300, 900], [16, 5, 1, 23, 9, 16, 3, 64], ()),
    "prefill+trees": ([0, 0, 700, 1000], [200, 63, 16, 1], (0, 1)),
}
DTYPES = {"fp32": (torch.float32, 1e-3), "bf16": (torch.bfloat16, 2e-2),
          "fp16": (torch.float16, 1e-2)}  # dtype, tolerance relative to max |expected|


def cuda_batch(batch: str, shape: str, dtype: torch.dtype, seed: int = 0) -> Batch:
    prefixes, trees, chains = BATCHES[batch]
    return make_batch(prefixes, trees, *SHAPES[shape], dtype=dtype, chains=chains, seed=seed,
                      device=CUDA)


# ---------------------------------------------------------------------------------------------
# kernels
@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.keys())
@pytest.mark.parametrize("batch", BATCHES.keys())
def test_tree_attention_triton_on_cuda(batch, shape, dtype):
    from specmesh_kernels.tree_attention import tree_attention_ref, tree_attention_triton

    torch_dtype, tol = DTYPES[dtype]
    b = cuda_batch(batch, shape, torch_dtype, seed=len(batch))
    out = tree_attention_triton(*b.args())
    assert out.dtype == torch_dtype and out.is_cuda
    expected = tree_attention_ref(*b.to("cpu").args())
    assert_close(out.cpu(), expected, rel=tol, what=f"triton {batch} {shape} {dtype}")


@pytest.mark.parametrize("chunk", [64, 512])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES.keys())
@pytest.mark.parametrize("batch", BATCHES.keys())
def test_decomposed_attention_triton_on_cuda(batch, shape, dtype, chunk):
    from specmesh_kernels.decomposed import decomposed_attention_triton
    from specmesh_kernels.tree_attention import tree_attention_ref

    torch_dtype, tol = DTYPES[dtype]
    b = cuda_batch(batch, shape, torch_dtype, seed=chunk)
    out, lse = decomposed_attention_triton(*b.args(), chunk)
    cpu = b.to("cpu")
    assert_close(out.cpu(), tree_attention_ref(*cpu.args()), rel=tol, what=f"o chunk {chunk}")
    assert_close(lse.cpu(), reference_lse(cpu), rel=1e-4, what=f"lse chunk {chunk}")


@pytest.mark.parametrize("shape", SHAPES.keys())
def test_cuda_backend_attends_and_compacts(shape):
    """select_attention_backend('cuda'): triton (flash-attn where importable); its attend (one
    TreeBatch reused across calls as across layers), the triton attend's split-KV path (forced
    here by min_kv=512: by default it splits only beyond 4096 positions) and compact."""
    from specmesh_kernels.backend import select_attention_backend, tree_attention_split
    from specmesh_kernels.compaction import compact_kv_ref
    from specmesh_kernels.tree_attention import tree_attention_ref

    backend = select_attention_backend(CUDA)
    assert backend.name in ("triton", "flash-attn")
    b = cuda_batch("trees", shape, torch.bfloat16, seed=5)
    expected = tree_attention_ref(*b.to("cpu").args())
    for _ in range(2):
        assert_close(backend.attend(*b.args()).cpu(), expected, rel=2e-2, what=backend.name)
    assert_close(tree_attention_split(*b.args(), min_kv=512).cpu(), expected, rel=2e-2,
                 what="split-KV")
    k = torch.randn(4, 600, SHAPES[shape][1], SHAPES[shape][2], device=CUDA).bfloat16()
    v = torch.randn_like(k)
    src, dst = accepted_path(base=500, rows=64, num_slots=600, seed=1)
    k_ref, v_ref = k.cpu(), v.cpu()
    compact_kv_ref(k_ref, v_ref, src.cpu(), dst.cpu())
    backend.compact(k, v, src, dst)
    assert torch.equal(k.cpu(), k_ref) and torch.equal(v.cpu(), v_ref)


def accepted_path(base: int, rows: int, num_slots: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """KVStore.commit's pairs for a random accepted path among `rows` tree rows written at
    positions base..base + rows - 1 (row 0, the root, always kept), through a shuffled
    position -> slot map. Returns (src, dst) on CUDA."""
    g = torch.Generator().manual_seed(seed)
    keep = [0] + sorted(torch.randperm(rows - 1, generator=g)[:rows // 3].add(1).tolist())
    slot_of = torch.randperm(num_slots, generator=g)
    moves = [(base + r, base + i) for i, r in enumerate(keep) if r != i]
    assert moves, "the path should move rows"
    src = slot_of[[m[0] for m in moves]]
    dst = slot_of[[m[1] for m in moves]]
    return src.to(CUDA), dst.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads,dim", [(3, 64), (2, 128), (16, 128)],
                         ids=["3x64", "2x128", "16x128"])  # 16 x 128: two programs per layer
def test_compaction_triton_on_cuda(kv_heads, dim, dtype):
    from specmesh_kernels.compaction import compact_kv_ref, compact_kv_triton

    g = torch.Generator().manual_seed(kv_heads)
    shape = (6, 2048, kv_heads, dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    src, dst = accepted_path(base=1900, rows=64, num_slots=2048, seed=dim)
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_ref(k_ref, v_ref, src.cpu(), dst.cpu())
    k_gpu, v_gpu = k.to(CUDA), v.to(CUDA)
    compact_kv_triton(k_gpu, v_gpu, src, dst)
    assert torch.equal(k_gpu.cpu(), k_ref) and torch.equal(v_gpu.cpu(), v_ref)
    # in order: pair 1 reads the slot pair 0 wrote
    src, dst = torch.tensor([1, 0, 5], device=CUDA), torch.tensor([0, 2, 1], device=CUDA)
    compact_kv_ref(k_ref, v_ref, src.cpu(), dst.cpu())
    compact_kv_triton(k_gpu, v_gpu, src, dst)
    assert torch.equal(k_gpu.cpu(), k_ref) and torch.equal(v_gpu.cpu(), v_ref)


# ---------------------------------------------------------------------------------------------
# the lean target forward on CUDA
LEAN_MODELS = {  # served attention shapes, 3 layers, a 1024-token vocabulary, random weights
    "llama": ("LlamaForCausalLM", dict(hidden_size=576, intermediate_size=1536,
                                       num_attention_heads=9, num_key_value_heads=3)),
    "qwen2": ("Qwen2ForCausalLM", dict(hidden_size=1536, intermediate_size=2048,
                                       num_attention_heads=12, num_key_value_heads=2)),
}
# max |lean - transformers| over the logits, relative to their largest magnitude
LEAN_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def tiny_model(arch: str, dtype: torch.dtype):
    """A transformers causal LM of `arch` with random weights (q/k/v biases and norm weights
    random too, so that the lean forward's handling of both is exercised), on CUDA."""
    import transformers

    name, shape = LEAN_MODELS[arch]
    cls = getattr(transformers, name)
    config = cls.config_class(vocab_size=1024, num_hidden_layers=3, max_position_embeddings=4096,
                              tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
            elif type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    return model.to(CUDA, dtype).eval()


def plain_transformers_logits(lm, prompt: list[int]) -> list[torch.Tensor]:
    """What tests/test_lean_target.packed_steps returns, from transformers alone (its own
    attention, a DynamicCache, the tree as a 4D mask): a's 40 prompt rows, nothing for b's
    prefill chunk, a's next row, b's 4 tree rows."""
    from test_lean_target import tree

    with torch.inference_mode():
        a = lm.model(input_ids=torch.tensor([prompt[:41]], device=CUDA)).logits[0].float()
        b = prompt[3:30]
        cache = lm.new_cache()
        lm.forward(cache, torch.tensor(b[:-1]))
        seg = tree("b", [b[-1], 17, 99, 512], [-1, 0, 0, 1], len(b) - 1)
        visible = torch.cat([torch.ones(4, len(b) - 1, dtype=torch.bool), seg.mask], dim=1)
        b_tree = lm.forward(cache, seg.tokens, seg.positions, visible)
    return [a[:40], a[40:40], a[40:], b_tree]


@pytest.mark.parametrize("dtype", LEAN_TOLERANCE.keys())
@pytest.mark.parametrize("arch", LEAN_MODELS.keys())
def test_lean_target_logits_on_cuda(arch, dtype):
    """The verifier's packed forward (a prompt with logits next to a prefill chunk, then a one-row
    step next to a tree) with the lean target on CUDA, against (1) transformers' modules through
    the same packed batch, KV store and attention backend, (2) transformers alone."""
    from specmesh_services.common.lean import LeanDecoder
    from specmesh_services.common.lm import CausalLM
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from test_lean_target import packed_steps

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model = tiny_model(arch, torch_dtype)
    lean, hf = LeanDecoder(model, f"tiny-{arch}"), CausalLM(model, f"tiny-{arch}")
    assert lean.device.type == "cuda" and lean.dtype == torch_dtype
    prompt = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    limits = EngineLimits(kv_budget_tokens=1024)
    engine = VerifierEngine(lean, limits=limits)
    ours = packed_steps(engine, prompt)
    references = {"packed transformers": packed_steps(VerifierEngine(hf, limits=limits), prompt),
                  "plain transformers": plain_transformers_logits(hf, prompt)}
    tol = LEAN_TOLERANCE[dtype]
    for what, theirs in references.items():
        assert [t.shape for t in ours] == [t.shape for t in theirs], what
        for i, (x, y) in enumerate(zip(ours, theirs)):
            if not x.numel():
                continue
            diff = (x - y).abs().max().item()
            scale = y.abs().max().item()
            agree = (x.argmax(-1) == y.argmax(-1)).float().mean().item()
            print(f"\nlean {arch} {dtype} {engine.backend.name} vs {what}, piece {i}: max |diff| "
                  f"{diff:.2e}, max |logit| {scale:.2f}, argmax agreement {agree:.3f}")
            assert diff <= tol * scale, f"{what}, piece {i}: {diff:.2e} > {tol} * {scale:.2f}"
            if dtype == "fp32":
                assert agree == 1.0, f"{what}, piece {i}: argmax differs"


# ---------------------------------------------------------------------------------------------
# the verify step replayed from CUDA graphs (services/common/graphs.py)
def tiny_cuda_lean(dtype: torch.dtype):
    """tests/test_step_graphs.py's tiny Qwen2 on CUDA."""
    from test_step_graphs import tiny_qwen2_lean

    return tiny_qwen2_lean("cuda", dtype)


@pytest.mark.parametrize("capture", ["lazy", "at start"])
def test_graph_replay_gives_the_greedy_stream_on_cuda(capture):
    """fp32 (TF32 off): requests stepped with trees (side branches, the right path behind a
    wrong sibling: compaction on the device) through replayed graphs of several buckets and eager
    steps between them give the target's own greedy tokens (an eager engine's one-row steps)."""
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from test_step_graphs import stream

    assert not torch.backends.cuda.matmul.allow_tf32
    lean = tiny_cuda_lean(torch.float32)
    engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=512, block_size=8,
                                                      graph_rows=16))
    graphs = engine.target.graphs
    assert graphs is not None and graphs.capture, "CUDA + lean target: the step replays graphs"
    if capture == "at start":
        assert engine.capture_graphs() > 0 and graphs.captured == len(graphs.buckets)
    outputs, references, seen = stream(engine, lean)
    assert outputs == references
    assert graphs.replays > 0 and 0 in seen and len(seen - {0}) >= 3, sorted(seen)


def test_split_kv_graphs_give_the_greedy_stream_on_cuda():
    """The same stream with KV past 24 positions cut into chunks of 8 inside the replayed
    graphs (partial states merged in the graph): the target's own greedy tokens."""
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from specmesh_services.common.graphs import StepGraphs
    from test_step_graphs import stream

    lean = tiny_cuda_lean(torch.float32)
    engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=512, block_size=8))
    engine.target.graphs = graphs = StepGraphs(lean, engine.store, 128, split_min=24, chunk=8)
    outputs, references, _ = stream(engine, lean)
    assert outputs == references
    assert any(chunks for _, chunks in graphs._graphs), "no split step was replayed"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graph_replay_equals_eager_on_cuda(dtype):
    """One step of three requests (a one-row step, a tree, a chain with logits) replayed from
    the 16-row graph: the eager packed forward's logits (bf16: within rounding)."""
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from test_lean_target import chain, tree

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    lean = tiny_cuda_lean(torch_dtype)
    out = {}
    for rows in (16, 0):
        engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=512, block_size=8,
                                                          graph_rows=rows))
        for rid, n in (("a", 30), ("b", 9), ("c", 50)):
            assert engine.store.reserve(rid, n + 8)
            prompt = torch.arange(n) * 7 % 512
            engine.target.forward([chain(rid, prompt.tolist(), 0, False)])
            engine.store.set_length(rid, n)
        step = [chain("a", [7], 30, True), tree("b", [3, 17, 99, 250, 8], [-1, 0, 0, 1, 1], 9),
                chain("c", [5, 6, 7, 8, 9, 10], 50, True)]
        for _ in range(2):  # the second replays the graph the first captured
            logits = [x.clone() for x in engine.target.forward(step)]
        out[rows] = (logits, engine.target.last_bucket)
    assert out[16][1] == 16 and out[0][1] == 0
    tol = 1e-4 if dtype == "fp32" else 5e-2
    for x, y in zip(out[16][0], out[0][0]):
        assert (x - y).abs().max().item() <= tol * max(1.0, y.abs().max().item())


@pytest.mark.parametrize("split", [{}, {"split_min": 24, "chunk": 8}], ids=["whole", "split"])
def test_runs_ahead_replay_the_tokens_of_one_step_a_sync_on_cuda(split):
    """tests/test_run_ahead.py's runs with the graphs captured, fp32: rounds of 8 replays a
    host sync give the target's greedy tokens, end at a stop inside a round and keep the KV
    rows of one step a sync; sampled, the same draws (split: KV chunks change within a round)."""
    import test_run_ahead as ahead

    lean = tiny_cuda_lean(torch.float32)
    ahead.test_greedy_runs_ahead_are_the_targets_tokens_and_end_at_stops(lean, split)
    if not split:
        ahead.test_sampled_runs_ahead_draw_what_one_step_a_sync_draws(lean)
        ahead.test_penalized_sampling_and_short_runs_do_not_run_ahead(lean)


def test_draft_graphs_draft_the_lean_trees_on_cuda():
    """tests/test_paged_draft.py's rounds (batched trees, rollbacks, pending rows, an eager
    prefill) with the draft's steps replayed from CUDA graphs: the trees the lean forward over
    per-request buffers drafts on the same card (fp32, TF32 off)."""
    from specmesh_services.drafter.engine import DraftModel
    from specmesh_services.drafter.lean import LeanLM
    from test_lean_draft import tiny_qwen2
    from test_paged_draft import paged, rounds

    assert not torch.backends.cuda.matmul.allow_tf32
    page = paged(device="cuda")
    assert page.graphs.capture and page.capture_all() > 0
    trees = rounds(DraftModel(page, "d", "model"))
    assert trees == rounds(DraftModel(LeanLM(tiny_qwen2().to(CUDA), "d"), "d", "model"))
    assert page.graphs.replays > 0
