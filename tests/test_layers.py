"""No import circle in the product: every module of handlers/ and streams/ reads after what it
imports, never before.

In a circle one side runs on the other half-built, and the layers import-linter checks
(pyproject.toml: handlers' sub-packages by role, then streams' processes) no longer say
which comes first. An import inside a function closes a circle too: grimp reads every import.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

PRODUCT = ("handlers", "streams")


def circles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Each import circle once, as the chain from one of its modules back to it."""
    found: list[tuple[str, ...]] = []
    seen: set[frozenset[str]] = set()
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None and frozenset(back) not in seen:
                seen.add(frozenset(back))
                found.append((importer, *back))
    return found


def test_the_product_imports_in_no_circle() -> None:
    found = circles(grimp.build_graph(*PRODUCT, cache_dir=None))
    assert not found, "import circles:\n" + "\n".join(" → ".join(chain) for chain in found)


def test_the_check_sees_a_circle_closed_inside_a_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ring = tmp_path / "ring"
    ring.mkdir()
    (ring / "__init__.py").write_text("")
    (ring / "a.py").write_text("from ring import b\n")
    (ring / "b.py").write_text("from ring import c\n")
    (ring / "c.py").write_text("def late():\n    from ring import a\n    return a\n")
    (ring / "d.py").write_text("from ring import a\n")  # imports the circle, is not in it
    monkeypatch.syspath_prepend(str(tmp_path))
    assert circles(grimp.build_graph("ring", cache_dir=None)) == [("ring.a", "ring.b", "ring.c", "ring.a")]
