"""The tools' terminal: one rich console, wide enough for tables in a pipe or a CI log."""

from __future__ import annotations

import sys

from rich.console import Console

# A pipe or CI log gets a wide table rather than rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 180)
