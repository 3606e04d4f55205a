"""pytest imports test modules by basename (rootdir-relative, no packages): two test files with one
name in different folders break collection of the whole suite, so names must be unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_module_names_are_unique() -> None:
    tests = Path(__file__).parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
