"""The image's dependency pins: what `mars` needs at run time (no extras), resolved recursively through the
project's venv as installed, so the image runs the versions the tests ran.

`python pins.py VARIANT OUT`: writes `name==version` lines to OUT. The cpu variant leaves out torch and what
only torch needs (PyPI's torch is the CUDA build, ~4 GB with its nvidia-* wheels; the cpu image embeds with
ONNX Runtime and never imports torch): not downloading them is what keeps the build's disk use small.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# torch and the packages only torch pulls in (sentence-transformers stays: the ONNX embedder's fallback
# path imports it lazily, and it is small).
TORCH_ONLY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe)$")


def pins(root: str, variant: str) -> list[str]:
    seen: dict[str, str] = {}
    todo = [(root, frozenset[str]())]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in (extras or {""})
            ):
                continue
            dep = canonicalize_name(req.name)
            if variant == "cpu" and TORCH_ONLY.match(dep):
                continue
            if dep not in seen:
                seen[dep] = metadata.version(req.name)
                todo.append((req.name, frozenset(req.extras)))
    return sorted(f"{name}=={version}" for name, version in seen.items())


if __name__ == "__main__":
    variant, out = sys.argv[1], sys.argv[2]
    if variant not in ("cpu", "cuda"):
        sys.exit(f"VARIANT must be cpu or cuda, not {variant}")
    text = "\n".join(pins("mars", variant)) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print(f"{text.count(chr(10))} pins ({variant})")
