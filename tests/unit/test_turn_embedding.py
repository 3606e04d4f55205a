"""Each turn's text is embedded once on the answer path: the state controller's vector travels on the
state event (sealed like the text) and the memory service takes it as the query's vector."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from mars import sealing
from mars.domain.vectors import decode_vector, encode_vector
from mars.retrieval.embedder import LruEmbedder, embedder_tag
from mars.v1 import events_pb2 as ev
from mars_memory.settings import MemorySettings
from mars_memory.store import MemoryStore


class CountingEmbedder:
    """A stand-in model: a fixed vector per text, and a count of the texts it was asked to embed."""

    def __init__(self, dim: int = 8) -> None:
        self._dim = dim
        self.embedded: list[str] = []

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.embedded += list(texts)
        return np.stack([np.full(self._dim, len(t), dtype=np.float32) for t in texts])


def test_a_vector_round_trips_exactly_and_bad_text_is_refused() -> None:
    vector = np.random.default_rng(7).standard_normal(384).astype(np.float32)
    assert np.array_equal(decode_vector(encode_vector(vector)), vector)
    for bad in ("", "not base64!", encode_vector(vector)[:-4] + "AA==", encode_vector(np.array([np.nan]))):
        with pytest.raises(ValueError):
            decode_vector(bad)


def test_the_lru_holds_a_given_vector_and_looks_up_without_computing() -> None:
    inner = CountingEmbedder()
    cache = LruEmbedder(inner, size=2)
    assert cache.cached("hello") is None
    cache.put("hello", np.ones(8, dtype=np.float32))
    assert np.array_equal(cache.encode(["hello"])[0], np.ones(8))
    assert inner.embedded == []
    cache.encode(["a", "b"])  # the oldest goes
    assert cache.cached("hello") is None and cache.cached("b") is not None


def test_memory_takes_its_own_models_vector_and_embeds_anything_else_itself() -> None:
    store = MemoryStore(None, MemorySettings(), CountingEmbedder())  # type: ignore[arg-type]
    own = embedder_tag(None)
    given = np.arange(8, dtype=np.float32)
    assert not store.accept_query_embedding("q", own, "")
    assert not store.accept_query_embedding("q", "another-model", encode_vector(given))
    assert not store.accept_query_embedding("q", own, encode_vector(np.ones(4, dtype=np.float32)))
    assert not store.accept_query_embedding("q", own, "%%%")
    assert store.accept_query_embedding("q", own, encode_vector(given))
    queries = store.embedding.query_embedder
    assert queries is not None and np.array_equal(queries.encode(["q"])[0], given)
    assert embedder_tag(None, "int8") != own  # an int8 memory never takes the fp32 controller's vectors


def test_the_state_events_embedding_is_sealed_like_its_text() -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = AESGCM(sealing.new_key())
    turn = ev.TurnEnvelope(turn_id="t1", tenant="acme", user_id="u1", seq=1)
    plain = encode_vector(np.arange(4, dtype=np.float32))
    event = ev.StateEstimated(turn=turn, text="hi", text_embedding=plain, text_embedder="all-MiniLM-L6-v2")
    sealed = sealing.seal(event, turn, "k1", key)
    assert isinstance(sealed, ev.StateEstimated)
    assert sealed.text_embedding != plain and sealed.text_embedder == "all-MiniLM-L6-v2"
    sealing.unseal(sealed, key)
    assert sealed.text_embedding == plain
