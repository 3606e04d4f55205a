"""Run while the service image is built (infra/image/Containerfile), in two modes:

`python export_embedder.py EMBEDDER_PY OUT_DIR` exports the default embedding model to ONNX (fp32 and int8)
into OUT_DIR, with embedder.py loaded by its path: the app is not installed yet, so this layer stays cached
while other code changes.

`python export_embedder.py --check OUT_DIR VARIANT`, with the app installed: the memory service's embedder
loads from OUT_DIR and encodes; on the cpu variant without torch (it is not in the image).
"""

from __future__ import annotations

import importlib.util
import sys


def export(embedder_py: str, out_dir: str) -> None:
    spec = importlib.util.spec_from_file_location("mars_embedder_export", embedder_py)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for precision in module.PRECISIONS:
        embedder = module.OnnxEmbedder(cache_dir=out_dir, precision=precision)
        assert embedder.encode(["export check"]).shape == (1, embedder.dim)
        print(f"exported {precision}: {embedder._onnx_path}")


def check(out_dir: str, variant: str) -> None:
    from mars.retrieval.embedder import OnnxEmbedder, load_embedder

    for precision in ("fp32", "int8"):
        embedder = load_embedder(backend="onnx", cache_dir=out_dir, precision=precision)
        assert isinstance(embedder, OnnxEmbedder), embedder
        assert embedder.encode(["image check"]).shape == (1, embedder.dim)
    auto = load_embedder(cache_dir=out_dir)
    if variant == "cpu":
        assert isinstance(auto, OnnxEmbedder), auto
        assert "torch" not in sys.modules, "the cpu image must not need torch"
    print(f"embedder ok ({variant}): {type(auto).__name__}, dim {auto.dim}")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(sys.argv[2], sys.argv[3])
    else:
        export(sys.argv[1], sys.argv[2])
