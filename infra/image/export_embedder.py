"""The service image's embedding model, exported to ONNX on the host and checked inside the build.

`python export_embedder.py export OUT_DIR IMAGE_SITE_PACKAGES`, on the host, in the project's venv (it has
torch): exports the default embedding model to ONNX (fp32 and int8) into OUT_DIR, under the names the memory
service looks for inside the image, where the model's folder lies under IMAGE_SITE_PACKAGES. torch never
enters the cpu image's build: PyPI's torch is the CUDA build (~4 GB with its nvidia-* wheels).

`python export_embedder.py --check OUT_DIR VARIANT`, inside the image build with the app installed: the memory
service's embedder loads from OUT_DIR and encodes; on the cpu variant without torch (it is not in the image).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path


def export(out_dir: str, image_site_packages: str) -> None:
    from mars.retrieval.embedder import (
        PRECISIONS,
        OnnxEmbedder,
        default_model_path,
        onnx_cache_key,
        onnx_file_name,
    )

    model = default_model_path()
    inside = Path(model).resolve().relative_to(Path(sysconfig.get_paths()["purelib"]).resolve())
    host_key, image_key = onnx_cache_key(model), onnx_cache_key(str(Path(image_site_packages) / inside))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in PRECISIONS:
            embedder = OnnxEmbedder(model, cache_dir=tmp, precision=precision)
            assert embedder.encode(["export check"]).shape == (1, embedder.dim)
            target = Path(out_dir) / onnx_file_name(image_key, precision)
            os.replace(Path(tmp) / onnx_file_name(host_key, precision), target)
            print(f"exported {precision}: {target.name} (the model at {Path(image_site_packages) / inside})")


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
    elif sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} export OUT_DIR IMAGE_SITE_PACKAGES | --check OUT_DIR VARIANT")
