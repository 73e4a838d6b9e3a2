"""`specmesh datastore build`: tokenize a corpus with the target's tokenizer into a suffix-array
datastore on disk (services/datastore/suffix.py holds the format)."""
from __future__ import annotations

import time
from pathlib import Path

from specmesh_services.common import models
from specmesh_services.common.datastore_files import default_path, tokenizer_family
from specmesh_services.common.config import Settings
from specmesh_services.datastore import corpus as corpora
from specmesh_services.datastore.suffix import build_datastore


def target_tokenizer(settings: Settings):
    return models.load_tokenizer(models.resolve(settings.model, settings.cache_dir))


def corpus_name(corpus: str) -> str:
    return "sharegpt" if corpus == "sharegpt" else Path(corpus).stem


def output_dir(settings: Settings, corpus: str, tokenizer) -> Path:
    """The default directory of `corpus`'s datastore for the target's tokenizer family."""
    return default_path(settings.cache_dir, tokenizer_family(tokenizer), corpus_name(corpus))


def build(settings: Settings, corpus: str = "sharegpt", out: Path | None = None,
          limit: int | None = None, progress: bool = True, tokenizer=None) -> tuple[Path, dict]:
    """Builds the datastore of `corpus` for the target's tokenizer; returns (path, meta)."""
    source = corpora.resolve(corpus)
    tokenizer = tokenizer or target_tokenizer(settings)
    family = tokenizer_family(tokenizer)
    out = out or output_dir(settings, corpus, tokenizer)
    start = time.perf_counter()
    documents = corpora.tokenize(corpora.iter_texts(source, limit), tokenizer)
    meta = {"name": f"{corpus_name(corpus)}-{family}", "tokenizer": family,
            "model": settings.model, "vocab_size": len(tokenizer), "corpus": str(source),
            "records_limit": limit}
    meta = build_datastore(out, documents, meta, progress=progress)
    meta["total_seconds"] = time.perf_counter() - start
    return out, meta
