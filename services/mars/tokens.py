"""Token counting per model family for packing (Eq. 13).

A model's pool entry may name its tokenizer: `gguf:<path>` (the vocabulary of a GGUF model, read by
llama.cpp without loading weights) or `hf:<path to tokenizer.json>` (Hugging Face `tokenizers`). Without
one, or when it cannot be loaded, packing uses the conservative estimate of mars.domain.text, which
over-counts so a packed prompt stays inside the budget.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from typing import Any

from mars.domain.text import estimate_tokens
from mars.model_pool import TOKENIZER_KINDS

log = logging.getLogger(__name__)

TokenCounter = Callable[[str], int]

#: GGUF vocabularies loaded by counters, freed by close_tokenizers.
_vocabularies: list[Any] = []


@atexit.register
def close_tokenizers() -> None:
    """Free every loaded GGUF vocabulary now. Runs at exit while the interpreter still works: left to
    garbage collection, llama_cpp's finaliser can run after its module globals are gone and print
    `TypeError: 'NoneType' object is not callable` from free_model. Counters made before are dropped."""
    load_counter.cache_clear()
    while _vocabularies:
        _vocabularies.pop().close()


#: Texts whose token counts a real tokenizer keeps: memory blocks recur from turn to turn (the active
#: state, recent turns, often-retrieved history) and on every fallback repack.
COUNT_CACHE_SIZE = 8192


@functools.lru_cache(maxsize=16)
def load_counter(spec: str | None) -> TokenCounter:
    exact = _load_exact(spec)
    return exact if exact is estimate_tokens else functools.lru_cache(maxsize=COUNT_CACHE_SIZE)(exact)


def _load_exact(spec: str | None) -> TokenCounter:
    if not spec:
        return estimate_tokens
    kind, _, path = spec.partition(":")
    if kind not in TOKENIZER_KINDS:
        # A misconfigured pool is refused when it loads (mars.model_pool); anything else naming one is refused here.
        raise ValueError(
            f"unknown tokenizer kind {kind!r} in {spec!r} (use gguf:<path> or hf:<tokenizer.json>)"
        )
    if not path:
        return estimate_tokens  # e.g. gguf:${MARS_LOCAL_GGUF:-} outside the local stack
    try:
        if kind == "gguf":
            from llama_cpp import Llama

            vocab = Llama(model_path=path, vocab_only=True, verbose=False)
            _vocabularies.append(vocab)
            return lambda text: len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False))
        from tokenizers import Tokenizer  # hf

        tok = Tokenizer.from_file(path)
        tok.no_padding()  # count the text, not a padded window
        tok.no_truncation()
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    except Exception as exc:  # a missing or unreadable file: the estimate never packs past the budget
        log.error("tokenizer %s unavailable (%s); packing with the conservative estimate", spec, exc)
        return estimate_tokens
