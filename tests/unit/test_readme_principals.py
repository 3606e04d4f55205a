"""The README's "Who may do what" table against the code: each principal's gRPC methods are those
mars.topology allows it, each service's tables those its schema creates, its ledger rows its stages, and the
data keys the ingress's to write. A change of permissions or ownership that the README does not follow
fails here."""

from __future__ import annotations

import re
from pathlib import Path

from mars import forget, topology

README = Path(__file__).resolve().parents[2] / "README.md"
TICKED = re.compile(r"`([^`]+)`")


def table() -> dict[str, list[str]]:
    text = README.read_text()
    start = text.index("**Who may do what.**")
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("| ") and not line.startswith("| ---") and not line.startswith("| principal"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`").removesuffix(" (tools)").strip("`")] = cells
        elif rows and not line.startswith("|"):
            break
    return rows


def allowed_methods() -> dict[str, set[str]]:
    by: dict[str, set[str]] = {}
    for method, callers in topology.PERMISSIONS.items():
        _, service, name = method.split("/")
        for caller in callers:
            by.setdefault(caller, set()).add(f"{service.rsplit('.', 1)[-1]}.{name}")
    return by


def test_every_principal_has_a_row_and_its_methods_are_the_topologys() -> None:
    rows = table()
    allowed = allowed_methods()
    assert set(rows) >= {*topology.NAMES, *allowed}
    for principal, cells in rows.items():
        if principal == "a tenant's API key":
            continue
        listed = {t for t in TICKED.findall(cells[1]) if "." in t}
        assert listed == allowed.get(principal, set()), principal


def test_each_services_tables_and_ledger_rows_are_its_own() -> None:
    rows = table()
    every_table = {t for name in topology.NAMES for t in forget.owned_tables(name)}
    every_stage = {s for spec in topology.SERVICES for s in spec.stages}
    for spec in topology.SERVICES:
        ticked = set(TICKED.findall(rows[spec.name][3]))
        assert ticked & every_table == set(forget.owned_tables(spec.name)), spec.name
        assert ticked & every_stage == set(spec.stages), spec.name
        writes_keys = "writes `user_data_keys`" in rows[spec.name][3]
        assert writes_keys == (forget.owner("user_data_keys") == spec.name), spec.name
