"""`mars probe`: the QTM controller's sensitivity probes and its accuracy on the labelled turn set."""

from __future__ import annotations

import argparse

from mars_tools.probe.common import CONFIG_HELP
from mars_tools.probe.qtm import add_qtm_parsers
from mars_tools.probe.qtm_labels import add_labels_parser


def add_probe_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    add_labels_parser(add_qtm_parsers(sub), CONFIG_HELP)
