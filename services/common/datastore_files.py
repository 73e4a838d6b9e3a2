"""Where a target's lookup datastore lives on disk, and whether it fits the target's tokenizer.

Shared by the roles that read the datastore's files without calling its service: the datastore
itself, the drafter (token counts for the draft vocabulary) and the router (the family check of
a remote datastore). Roles otherwise talk only through the protos and the pool.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specmesh_services.common.config import Settings


class DatastoreMismatch(ValueError):
    """The datastore was built with another tokenizer family than the target's."""


def tokenizer_family(tokenizer) -> str:
    """Fingerprint of a tokenizer's token list: models whose vocabularies map the same strings to
    the same ids share a datastore (the two Qwen2.5-Coder models do; chat templates may differ)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256("\n".join(f"{i}\t{s}" for s, i in vocab).encode("utf-8"))
    return digest.hexdigest()[:16]


def default_path(cache_dir: Path, family: str, corpus: str = "sharegpt") -> Path:
    """Where `specmesh datastore build` puts a corpus's datastore for a tokenizer family."""
    return cache_dir / "datastores" / f"{corpus}-{family}"


def check_family(meta: dict, family: str, path: Path | str) -> None:
    if meta.get("tokenizer") != family:
        raise DatastoreMismatch(
            f"the datastore at {path} was built with tokenizer family {meta.get('tokenizer')} "
            f"(model {meta.get('model')}), the target's is {family}: build one for this model "
            f"with `specmesh datastore build --model ...`")


def locate(settings: Settings, tokenizer) -> Path:
    """The configured datastore directory (default: ShareGPT for the target's tokenizer family),
    refusing a missing one and one built with another tokenizer."""
    family = tokenizer_family(tokenizer)
    path = settings.datastore.path or default_path(settings.cache_dir, family)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"no datastore at {path}: build it with `specmesh datastore build "
                                f"--model {settings.model}` (or set --datastore-path)")
    check_family(json.loads(meta_file.read_text()), family, path)
    return path
