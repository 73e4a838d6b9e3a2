"""The target's final hidden states over a corpus of conversations: what grounded draft heads
(Hydra, section 4: heads over the frozen base model's last hidden state) train on.

Each conversation goes through the target's chat template, is cut into windows of `seq_len`
tokens, and the windows run through the target in batches (right-padded, serving dtype). Out:
`<cache_dir>/heads/<model>/hidden-<corpus>-<L>/`, safetensors shards (tokens, final hidden
states, optionally the residual stream after `layers` for ProPD's early heads, window starts)
and meta.json (the layout: docs/heads.md, The data). Written a shard at a time, so an
interrupted run resumes and a larger budget extends what is there.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.datastore_files import tokenizer_family
from specmesh_services.datastore import corpus as corpora

FORMAT_VERSION = 1
META = "meta.json"

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


class HiddenStatesMismatch(ValueError):
    """The folder holds hidden states of another model, tokenizer or window length."""


def default_dir(settings: Settings, corpus: str, seq_len: int, layers: tuple[int, ...] = ()
                ) -> Path:
    name = corpus if corpus == "sharegpt" else Path(corpus).stem
    suffix = "".join(f"-l{n}" for n in layers)
    return Path(settings.cache_dir) / "heads" / settings.model / f"hidden-{name}-{seq_len}{suffix}"


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """A conversation's tokens cut into windows of at most seq_len (a window of one token
    predicts nothing and is dropped)."""
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids) - i > 1]


def conversations(path: Path, tokenizer) -> Iterator[list[int]]:
    """Token ids of each record through the chat template ([] for a record without turns)."""
    for record in corpora.iter_records(path):
        messages = corpora.record_messages(record)
        if not messages:
            yield []
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        yield tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class _Shard:
    tokens: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    layers: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)


def extract(settings: Settings, max_tokens: int | None, corpus: str = "sharegpt",
            out: Path | None = None, seq_len: int = 512, batch_size: int = 8,
            shard_tokens: int = 1 << 16, max_seconds: float | None = None,
            progress: bool = True, layers: tuple[int, ...] = ()) -> dict:
    """Hidden states of at least `max_tokens` corpus tokens (whole conversations; fewer if the
    corpus runs out or `max_seconds` pass; None: the whole corpus) in `out`; returns its meta.
    `layers`: also the residual stream after each of these layers. Resumes what is there."""
    if seq_len < 2 or batch_size < 1 or shard_tokens < 1:
        raise ValueError("need seq_len >= 2, batch_size >= 1 and shard_tokens >= 1")
    path = models.resolve(settings.model, settings.cache_dir)
    tokenizer = models.load_tokenizer(path)
    dtype = models.resolve_dtype(settings.dtype)
    config = models.load_config(path)
    layers = tuple(sorted(set(layers)))
    if any(not 1 <= n < config.num_hidden_layers for n in layers):
        raise ValueError(f"layers must lie in 1 .. {config.num_hidden_layers - 1} (the model has "
                         f"{config.num_hidden_layers})")
    out = Path(out) if out is not None else default_dir(settings, corpus, seq_len, layers)
    want = {"format_version": FORMAT_VERSION, "model": settings.model,
            "tokenizer": tokenizer_family(tokenizer), "hidden_size": config.hidden_size,
            "seq_len": seq_len, "corpus": corpus}
    if layers:
        want["layers"] = list(layers)
    meta = load_meta(out)
    if meta is None:
        meta = {**want, "dtype": str(dtype).removeprefix("torch."), "shards": [], "records": 0,
                "tokens": 0, "complete": False}
    else:
        wrong = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        if wrong:
            raise HiddenStatesMismatch(
                f"{out} holds hidden states of another setup: " + ", ".join(
                    f"{k} {have!r} (asked {asked!r})" for k, (have, asked) in wrong.items())
                + ": give another folder or remove it")
    source = corpora.resolve(corpus)
    if meta["complete"] and meta.get("corpus_bytes") not in (None, source.stat().st_size):
        meta["complete"] = False  # the corpus grew (the target's answers, appended): go on
    if meta["complete"] or (max_tokens is not None and meta["tokens"] >= max_tokens):
        return meta
    out.mkdir(parents=True, exist_ok=True)
    model = models.load_model(path, dtype)
    started = time.monotonic()
    bar = (tqdm(total=max_tokens, initial=meta["tokens"], unit=" tok", desc="hidden states",
                disable=not progress) if tqdm is not None else None)
    shard, pending, read = _Shard(), [], meta["records"]
    try:
        for index, ids in enumerate(conversations(source, tokenizer)):
            if index < meta["records"]:
                continue  # in an earlier shard
            pending += windows(ids, seq_len)
            read = index + 1
            if len(pending) < batch_size:
                continue
            done = _run(model, pending, batch_size, shard, layers)
            pending = []
            if bar is not None:
                bar.update(done)
            reached = max_tokens is not None and meta["tokens"] + shard.size >= max_tokens
            late = max_seconds is not None and time.monotonic() - started >= max_seconds
            if shard.size >= shard_tokens or reached or late:
                _write(out, meta, shard, read)
                shard = _Shard()
            if reached or late:
                break
        else:
            if pending:
                done = _run(model, pending, batch_size, shard, layers)
                if bar is not None:
                    bar.update(done)
            meta["complete"] = True
            meta["corpus_bytes"] = source.stat().st_size
            _write(out, meta, shard, read)
    finally:
        if bar is not None:
            bar.close()
    return meta


@torch.inference_mode()
def _run(model, pending: list[list[int]], batch_size: int, shard: _Shard,
         layers: tuple[int, ...] = ()) -> int:
    """Runs the windows through the target (the longest together: less padding); appends each
    window's tokens and hidden states (and `layers`' states) to the shard in the order given.
    Returns the tokens."""
    order = sorted(range(len(pending)), key=lambda i: -len(pending[i]))
    hidden: dict[int, torch.Tensor] = {}
    early: dict[tuple[int, int], torch.Tensor] = {}
    for at in range(0, len(order), batch_size):
        group = order[at:at + batch_size]
        width = len(pending[group[0]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(pending[i])] = torch.tensor(pending[i])
            mask[row, :len(pending[i])] = 1
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=bool(layers))
        states = out.last_hidden_state
        for row, i in enumerate(group):
            hidden[i] = states[row, :len(pending[i])].to(torch.bfloat16).clone()
            for n in layers:  # hidden_states[n]: the output of layer n (0: the embeddings)
                early[i, n] = out.hidden_states[n][row, :len(pending[i])].to(torch.bfloat16).clone()
    for i, window in enumerate(pending):
        shard.tokens.append(torch.tensor(window, dtype=torch.int32))
        shard.hidden.append(hidden[i])
        for n in layers:
            shard.layers.setdefault(n, []).append(early[i, n])
    return sum(len(w) for w in pending)


def _write(out: Path, meta: dict, shard: _Shard, records: int) -> None:
    """The shard (if any tokens) to its file, then meta.json: both replaced atomically."""
    from safetensors.torch import save_file

    if shard.size:
        name = f"shard-{len(meta['shards']):05d}.safetensors"
        lengths = torch.tensor([0] + [int(t.numel()) for t in shard.tokens], dtype=torch.int64)
        tmp = out / f".{name}.tmp"
        save_file({"tokens": torch.cat(shard.tokens), "hidden": torch.cat(shard.hidden),
                   "starts": torch.cumsum(lengths, 0),
                   **{f"layer-{n}": torch.cat(states) for n, states in shard.layers.items()}},
                  str(tmp))
        os.replace(tmp, out / name)
        meta["shards"].append({"file": name, "tokens": shard.size,
                               "windows": len(shard.tokens)})
        meta["tokens"] += shard.size
    meta["records"] = records
    tmp = out / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / META)


def load_meta(out: Path) -> dict | None:
    path = Path(out) / META
    return json.loads(path.read_text()) if path.is_file() else None


def require_meta(out: Path) -> dict:
    """meta.json of a hidden-states folder, or a clear error where there is none."""
    meta = load_meta(out)
    if meta is None:
        raise FileNotFoundError(f"{out} holds no hidden states: run `specmesh heads extract` "
                                f"first")
    return meta


def load_shard(out: Path, entry: dict) -> dict[str, torch.Tensor]:
    """One shard's tensors (tokens, hidden, starts)."""
    from safetensors.torch import load_file

    return load_file(str(Path(out) / entry["file"]))


def split_windows(hidden_dir: Path, held_out: bool, hold_out_every: int
                  ) -> Iterator[tuple[dict[str, torch.Tensor], int, int]]:
    """(shard, start, end) of every window of the training split (`held_out`: of the held-out
    one: every `hold_out_every`-th window), in data order."""
    window = 0
    for entry in require_meta(hidden_dir)["shards"]:
        shard = load_shard(hidden_dir, entry)
        starts = shard["starts"].tolist()
        for a, b in zip(starts, starts[1:]):
            if (window % hold_out_every == hold_out_every - 1) == held_out:
                yield shard, a, b
            window += 1
