"""A vector as event text: base64 of its little-endian float32 bytes. Exact for float32 embeddings (what
the embedders produce), and a string, so an event's sealing covers it like the text it was computed from."""

from __future__ import annotations

import base64
import binascii

import numpy as np

_FLOAT32_LE = np.dtype("<f4")


def encode_vector(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype=_FLOAT32_LE).tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    """The float32 vector of `encode_vector`'s text; ValueError for text that is not one (bad base64, a
    length that is no whole number of floats, or values that are not finite)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"not a base64 vector: {exc}") from None
    if not raw or len(raw) % _FLOAT32_LE.itemsize:
        raise ValueError(f"a vector of {len(raw)} bytes is no whole number of float32 values")
    vector = np.frombuffer(raw, dtype=_FLOAT32_LE).astype(np.float32)
    if not np.isfinite(vector).all():
        raise ValueError("the vector holds values that are not finite")
    return vector
