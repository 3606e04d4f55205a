"""The embedder's tokenizer read from tokenizer.json by the `tokenizers` library alone (FastTokenizer) gives
the ids, masks and type ids that transformers' AutoTokenizer gives for the same call, on texts that exercise
the normalizer (case, accents, CJK, control characters), padding and truncation; and the embedder loads
without importing transformers or torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mars.retrieval.embedder import (
    FastTokenizer,
    _load_tokenizer,
    _tokenizer_json_is_whole,
    default_model_path,
    load_embedder,
)

TEXTS = [
    "Plan a short trip to Lisbon.",
    "CAFÉ Crème brûlée, naïve façade — résumé!",
    "我想去北京旅行，三天。",
    "tabs\tand\nnewlines \x00 and a zero-width\u200bspace",
    "",
    "word " * 400,  # far past the window: truncated
    "Remind me what budget we set for the zebra safari in Kenya.",
]


@pytest.mark.parametrize("max_length", [16, 128, 256])
def test_the_same_ids_as_transformers(max_length: int) -> None:
    from transformers import AutoTokenizer

    path = str(default_model_path())
    ours = _load_tokenizer(path)
    assert isinstance(ours, FastTokenizer)
    theirs = AutoTokenizer.from_pretrained(path)
    got = ours(list(TEXTS), padding=True, truncation=True, max_length=max_length, return_tensors="np")
    want = theirs(list(TEXTS), padding=True, truncation=True, max_length=max_length, return_tensors="np")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(got[key], np.asarray(want[key]), err_msg=key)
    assert got["input_ids"].shape[1] == max_length  # the long text filled the window


def test_a_config_that_asks_more_than_the_file_holds_goes_through_transformers() -> None:
    folder = Path(default_model_path())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    fast = json.loads((folder / "tokenizer.json").read_text())
    assert _tokenizer_json_is_whole(config, fast)
    assert not _tokenizer_json_is_whole({**config, "do_lower_case": False}, fast)
    assert not _tokenizer_json_is_whole({**config, "strip_accents": True}, fast)
    assert not _tokenizer_json_is_whole({**config, "tokenizer_class": "XLMRobertaTokenizer"}, fast)


def test_the_embedder_loads_without_transformers_or_torch() -> None:
    load_embedder()  # exported to ONNX first where it is not yet (that export needs torch)
    code = (
        "import sys; from mars.retrieval.embedder import load_embedder; e = load_embedder(); "
        "assert e.encode(['hello']).shape == (1, e.dim); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
