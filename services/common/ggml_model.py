"""A GGUF model run by llama.cpp's kernels (llama-cpp-python's low-level API): decode batches
whose rows carry sequence-id sets (trees: ggml_batch.py), logits of the rows asked for, and the
KV cache edited by sequence operations (copy, remove) for commit and rollback; with
`embeddings`, the final (normalized) hidden states of those rows too, which draft heads read.

One context, one unified KV buffer shared by every sequence (`kv_unified`: a row may belong to
several sequences, as a tree's shared prefix does).
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["GgmlModel", "available"]

log = logging.getLogger(__name__)


def available() -> str | None:
    """None where llama-cpp-python imports, else why not (what to install)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:  # also a failed build's missing shared library
        return (f"llama-cpp-python is not installed ({err}): `make setup` builds it for this "
                f"CPU (deploy/install-ggml.sh), or pip install 'specmesh[ggml]'")
    return None


class GgmlModel:
    """`path`'s model in one llama.cpp context of `n_ctx` cells for all sequences together,
    batches of up to `n_batch` rows, sequence ids 0 .. n_seq_max - 1. With `embeddings`, each
    decode also leaves the output rows' final hidden states in `hidden` (llama.cpp's per-token
    embeddings, after the output norm: what the torch target's `last_hidden_state` is)."""

    def __init__(self, path: Path, n_ctx: int = 4096, n_batch: int = 512, n_seq_max: int = 64,
                 threads: int | None = None, embeddings: bool = False) -> None:
        lc = self._lc = _llama_cpp()
        params = lc.llama_model_default_params()
        # llama.cpp's repacked weights (AMX tiles on AMX CPUs) make a tree's extra rows cheap
        params.use_extra_bufts = extra_buffers_safe(lc.__version__)
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {path}")
        ctx_params = lc.llama_context_default_params()
        threads = threads or len(os.sched_getaffinity(0))
        ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_ubatch = n_ctx, n_batch, n_batch
        ctx_params.n_seq_max, ctx_params.kv_unified = n_seq_max, True
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        if embeddings:  # per-token hidden states beside the logits (`_decode` turns them on)
            ctx_params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ValueError(f"llama.cpp cannot make a context of {n_ctx} cells for {path}")
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.hidden_size = lc.llama_model_n_embd(self.model)
        self.embeddings, self._states = embeddings, False
        self.hidden: np.ndarray | None = None  # the last decode's, [rows with outputs, hidden]
        self.context_length = lc.llama_model_n_ctx_train(self.model)
        self.path, self.threads = Path(path), threads
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self._batch = lc.llama_batch_init(n_batch, 0, n_seq_max)

    def close(self) -> None:
        lc = self._lc
        if self.ctx:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self.ctx)
            lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def __del__(self) -> None:
        self.close()

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], outputs: Sequence[bool]) -> np.ndarray:
        """`llama_decode` of these rows, `n_batch` rows a call (a row's ancestors always come
        before it, so a later call sees the cells of an earlier one); the logits [rows with
        outputs, vocab] (float32); with `embeddings`, their hidden states in `hidden`."""
        n = len(tokens)
        if n == 0:
            raise ValueError("a decode takes at least one row")
        parts = [self._decode(tokens[i:i + self.n_batch], positions[i:i + self.n_batch],
                              seq_ids[i:i + self.n_batch], outputs[i:i + self.n_batch])
                 for i in range(0, n, self.n_batch)]
        if len(parts) > 1:
            parts = [tuple(map(np.concatenate, zip(*parts)))]
        logits, hidden = parts[0]
        if self.embeddings:
            self.hidden = hidden
        return logits

    def _decode(self, tokens: Sequence[int], positions: Sequence[int],
                seq_ids: Sequence[Sequence[int]], outputs: Sequence[bool]
                ) -> tuple[np.ndarray, np.ndarray]:
        """One `llama_decode`: (logits, hidden states) of the rows with outputs (without
        `embeddings` the states are [rows, 0])."""
        n, batch = len(tokens), self._batch
        for i in range(n):
            batch.token[i], batch.pos[i] = tokens[i], positions[i]
            batch.n_seq_id[i] = len(seq_ids[i])
            for j, s in enumerate(seq_ids[i]):
                batch.seq_id[i][j] = s
            batch.logits[i] = bool(outputs[i])
        batch.n_tokens = n
        wanted = sum(bool(o) for o in outputs)
        # with hidden states llama.cpp outputs every row of the call: on only where one is asked
        states = self.embeddings and wanted > 0
        if states != self._states:
            self._lc.llama_set_embeddings(self.ctx, states)
            self._states = states
        code = self._lc.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed ({code}) on a batch of {n} rows")
        rows = n if states else wanted  # llama.cpp's output rows
        out = np.empty((rows, self.vocab_size), dtype=np.float32)
        hidden = np.empty((rows, self.hidden_size if self.embeddings else 0), dtype=np.float32)
        if rows:
            # a plain memmove: np.ctypeslib.as_array took 0.8 ms a call in the serving process
            ctypes.memmove(out.ctypes.data, self._lc.llama_get_logits(self.ctx), out.nbytes)
        if states:
            ctypes.memmove(hidden.ctypes.data, self._lc.llama_get_embeddings(self.ctx),
                           hidden.nbytes)
            if wanted < n:
                keep = np.flatnonzero(np.asarray(outputs, dtype=bool))
                out, hidden = out[keep], hidden[keep]
        return out, hidden

    # the KV cache, by sequence ----------------------------------------------------------------
    def seq_copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Adds `dst` to the cells of `src` at positions [p0, p1) (negative: unbounded)."""
        self._lc.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_remove(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Removes `seq` from its cells at positions [p0, p1); cells left in no sequence free."""
        self._lc.llama_memory_seq_rm(self.memory, seq, p0, p1)

    def seq_max(self, seq: int) -> int:
        """The largest position held for `seq` (-1: none)."""
        return self._lc.llama_memory_seq_pos_max(self.memory, seq)


def end_of_generation(path: Path) -> list[int]:
    """The token ids llama.cpp ends a generation on for this GGUF file (its EOS, EOT and EOM ids
    and the end and fill-in-the-middle tokens it recognizes by their text), read from the
    vocabulary alone; [] where llama-cpp-python is not installed or cannot read the file."""
    if available() is not None:
        return []
    lc = _llama_cpp()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return []
    try:
        vocab = lc.llama_model_get_vocab(model)
        return [i for i in range(lc.llama_vocab_n_tokens(vocab)) if lc.llama_vocab_is_eog(vocab, i)]
    finally:
        lc.llama_model_free(model)


def extra_buffers_safe(version: str) -> bool:
    """Whether llama.cpp may repack the weights into its extra buffers here. On an AMX CPU that
    means its AMX product, which raises SIGILL when GCC 12 compiled it unpatched: only builds of
    deploy/install-ggml.sh (version label +specmesh) get it there; others keep the plain kernels
    (docs/decisions/ggml-target.md)."""
    if "+specmesh" in version or not _has_amx():
        return True
    log.warning("llama-cpp-python %s was not built by deploy/install-ggml.sh: llama.cpp's AMX "
                "kernels stay off on this AMX CPU (an unpatched build crashes in them); "
                "`make setup` builds the patched one", version)
    return False


def amx_kernels() -> bool:
    """Whether llama.cpp's AMX kernels run here: an AMX CPU and a build of
    deploy/install-ggml.sh (`extra_buffers_safe`)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "+specmesh" in version and _has_amx()


def _has_amx() -> bool:
    from specmesh_kernels.cpu_probe import cpu_has

    return cpu_has("amx_int8", "amx_bf16", "amx_tile")


def _llama_cpp():
    """llama-cpp-python's module, its backend initialized and its log down to errors."""
    import llama_cpp as lc

    lc.llama_backend_init()
    lc.llama_log_set(_quiet(lc), ctypes.c_void_p(0))
    return lc


_CALLBACK = []  # the log callback, kept alive while llama.cpp may call it


def _quiet(lc):
    """llama.cpp's log callback that prints its errors only."""
    if not _CALLBACK:
        def log(level, text, user_data):
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                os.write(2, text)
        _CALLBACK.append(lc.llama_log_callback(log))
    return _CALLBACK[0]
