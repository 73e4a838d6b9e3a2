"""Grounded draft heads (services/heads), with the real default model in float32 over a small
corpus of conversations. Extraction: the windows are the chat template's tokens, each window's
hidden states are the target's own final hidden states, an interrupted run resumes to the same
shards as an uninterrupted one, a folder of another setup is refused. Training: a new head
reads the target's own distribution and is grounded on the drafted tokens; a run writes heads
with held-out accuracy and resumes from its checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from specmesh_services.heads import extract

CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "What is a suffix array?"},
                       {"from": "gpt", "value": "A sorted array of all suffixes of a string."}]},
    {"conversations": []},  # no turns: read, nothing extracted
    {"conversations": [{"from": "human", "value": "Say hi."},
                       {"from": "gpt", "value": "Hi! How can I help you today?"}]},
    {"conversations": [{"from": "human", "value": "Count to five."},
                       {"from": "gpt", "value": "One, two, three, four, five."}]},
]
SEQ_LEN = 16


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS))
    return str(path)


def run(base_settings, corpus, out, **kwargs):
    return extract.extract(base_settings, kwargs.pop("max_tokens", 10**6), corpus, out,
                           seq_len=SEQ_LEN, batch_size=2, progress=False, **kwargs)


def shards(out, meta):
    return [extract.load_shard(out, entry) for entry in meta["shards"]]


def test_windows_are_the_templated_conversations_and_their_target_hidden_states(
        base_settings, corpus, tmp_path, tokenizer, hf_target):
    meta = run(base_settings, corpus, tmp_path / "h", shard_tokens=40)
    expected = [w for ids in extract.conversations(extract.corpora.resolve(corpus), tokenizer)
                for w in extract.windows(ids, SEQ_LEN)]
    assert meta["complete"] and meta["records"] == len(CONVERSATIONS)
    assert meta["tokens"] == sum(len(w) for w in expected) and len(meta["shards"]) > 1
    got = []
    for shard in shards(tmp_path / "h", meta):
        starts = shard["starts"].tolist()
        assert shard["hidden"].shape == (starts[-1], hf_target.config.hidden_size)
        for a, b in zip(starts, starts[1:]):
            window = shard["tokens"][a:b].tolist()
            got.append(window)
            with torch.inference_mode():  # the window alone, unpadded, as the reference
                ref = hf_target.model(input_ids=torch.tensor([window])).last_hidden_state[0]
            torch.testing.assert_close(shard["hidden"][a:b].float(), ref, atol=2e-2, rtol=1e-2)
    assert got == expected
    assert all(len(w) <= SEQ_LEN for w in got)


def test_an_interrupted_run_resumes_to_the_same_shards(base_settings, corpus, tmp_path):
    whole = run(base_settings, corpus, tmp_path / "whole", shard_tokens=1)
    first = run(base_settings, corpus, tmp_path / "parts", shard_tokens=1, max_tokens=1)
    assert not first["complete"] and first["records"] < len(CONVERSATIONS)
    rest = run(base_settings, corpus, tmp_path / "parts", shard_tokens=1)
    assert {k: v for k, v in rest.items()} == whole
    for a, b in zip(shards(tmp_path / "whole", whole), shards(tmp_path / "parts", rest)):
        assert a["tokens"].equal(b["tokens"]) and a["starts"].equal(b["starts"])
        torch.testing.assert_close(a["hidden"], b["hidden"], atol=2e-2, rtol=1e-2)
    # a finished folder is not recomputed
    assert run(base_settings, corpus, tmp_path / "parts") == whole


def test_a_folder_of_another_setup_is_refused(base_settings, corpus, tmp_path):
    run(base_settings, corpus, tmp_path / "h", max_tokens=1)
    with pytest.raises(extract.HiddenStatesMismatch, match="seq_len 16 .asked 32."):
        extract.extract(base_settings, 10**6, corpus, tmp_path / "h", seq_len=32,
                        progress=False)
    with pytest.raises(ValueError, match="seq_len >= 2"):
        extract.extract(base_settings, 10, corpus, tmp_path / "x", seq_len=1, progress=False)


# training --------------------------------------------------------------------------------------
def test_a_new_head_reads_the_targets_own_distribution(hf_target):
    from specmesh_services.heads.model import GroundedHeads

    embed = hf_target.get_input_embeddings().weight.detach()
    head = embed  # SmolLM2 ties its LM head to the embeddings
    heads = GroundedHeads(embed.shape[1], 2, embed, head)
    f = torch.randn(3, embed.shape[1])
    tokens = torch.tensor([[1, 2], [3, 4], [5, 6]])
    for k in (1, 2):  # W2 starts at zero: h = f whatever the tokens
        torch.testing.assert_close(heads.logits(k, f, tokens[:, :k]), f @ head.T)
    with torch.no_grad():
        heads.down[1].weight.normal_()
    other = torch.tensor([[1, 9], [3, 9], [5, 9]])  # grounded: the drafted tokens change it
    assert not torch.equal(heads.logits(2, f, tokens), heads.logits(2, f, other))
    medusa = GroundedHeads(embed.shape[1], 2, embed, head, grounded=False)
    with torch.no_grad():
        medusa.down[1].weight.normal_()
    assert medusa.up[1].in_features == embed.shape[1]  # Medusa's heads: f alone
    assert torch.equal(medusa.logits(2, f, tokens), medusa.logits(2, f, other))


def test_training_writes_heads_with_held_out_accuracy_and_resumes(base_settings, corpus,
                                                                  tmp_path):
    from safetensors.torch import load_file

    from specmesh_services.heads import train

    run(base_settings, corpus, tmp_path / "h", shard_tokens=1)
    stopped = train.train(base_settings, tmp_path / "h", tmp_path / "k", num_heads=2, batch=8,
                          max_seconds=0, progress=False)
    assert not stopped["complete"] and (tmp_path / "k" / train.CHECKPOINT).is_file()
    done = train.train(base_settings, tmp_path / "h", tmp_path / "k", num_heads=2, batch=8,
                       progress=False)
    assert done["complete"] and done["steps"] == done["of_steps"] > 0
    assert not (tmp_path / "k" / train.CHECKPOINT).exists()
    saved = json.loads((tmp_path / "k" / "heads.json").read_text())
    assert saved["model"] == base_settings.model and saved["num_heads"] == 2
    assert [a["head"] for a in saved["accuracy"]] == [1, 2]
    assert all(0 <= a["top1"] <= a["top5"] <= 1 for a in saved["accuracy"])
    weights = load_file(str(tmp_path / "k" / "heads.safetensors"))
    assert set(weights) == {"up.0.weight", "up.0.bias", "up.1.weight", "up.1.bias",
                            "down.0.weight", "down.0.bias", "down.1.weight", "down.1.bias",
                            "vocab"}
    with pytest.raises(extract.HiddenStatesMismatch, match="not qwen"):
        train.train(base_settings.with_overrides(model="qwen2.5-coder-0.5b"), tmp_path / "h",
                    tmp_path / "q", progress=False)


def test_draft_vocabulary_and_distillation(base_settings, corpus, tmp_path, tokenizer):
    from safetensors.torch import load_file

    from specmesh_services.heads import train

    run(base_settings, corpus, tmp_path / "h")
    data = train.examples(tmp_path / "h", 2, held_out=False)
    counts = torch.bincount(data.targets[:, 0], minlength=tokenizer.vocab_size)
    special = tokenizer.all_special_ids
    keep = train.draft_vocab(data, 10, counts.numel(), special)
    assert keep.tolist() == sorted(keep.tolist()) and set(special) <= set(keep.tolist())
    top = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))[:10]
    assert set(top) <= set(keep.tolist()) and len(keep) <= 10 + len(special)
    done = train.train(base_settings, tmp_path / "h", tmp_path / "k", num_heads=2, batch=8,
                       vocab=10, soft=True, progress=False)
    assert done["complete"] and done["vocab"] == len(keep) and done["targets"] == "soft"
    assert load_file(str(tmp_path / "k" / "heads.safetensors"))["vocab"].tolist() == \
        keep.tolist()
    for a in done["accuracy"]:  # guesses only from the vocabulary: against data and target
        assert 0 <= a["top1"] <= a["top5"] <= 1 and 0 <= a["agree1"] <= a["agree5"] <= 1


# self-distillation ----------------------------------------------------------------------------
def test_the_targets_own_answers_are_its_greedy_output_and_resume(base_settings, corpus,
                                                                  tmp_path, tokenizer,
                                                                  hf_target):
    from specmesh_services.heads import distill

    out = tmp_path / "answers.jsonl"
    whole = distill.generate(base_settings, 10**6, corpus, out, answer_tokens=8, batch_size=2,
                             progress=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # the records with a first human turn, in order, each answered as the target alone would
    assert [r["record"] for r in lines] == [0, 2, 3] and whole["complete"]
    for line in lines:
        question = line["conversations"][0]["value"]
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
        with torch.inference_mode():
            ref = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=8)[0, ids.shape[1]:].tolist()
        eos = [t for t in ref if t in (tokenizer.eos_token_id,)]
        ref = ref[:ref.index(eos[0])] if eos else ref
        assert line["conversations"][1]["value"] == tokenizer.decode(ref,
                                                                      skip_special_tokens=True)
        assert line["answer_tokens"] == len(ref)
    # an interrupted write (a truncated last line) is cut off and that record answered again
    text = out.read_text()
    out.write_text(text[:-20])
    again = distill.generate(base_settings, 10**6, corpus, out, answer_tokens=8, batch_size=2,
                             progress=False)
    assert out.read_text() == text and again["tokens"] == whole["tokens"]
    # the extraction reads the answers as a corpus, and extends when more were appended
    meta = extract.extract(base_settings, None, str(out), tmp_path / "h", seq_len=SEQ_LEN,
                           progress=False)
    assert meta["complete"] and meta["records"] == 3
