"""docs/exports.md's options table of ``veoptim-export`` names every ``--format`` the CLI takes."""

from __future__ import annotations

from pathlib import Path

from veoptim.export import FORMATS

DOC = Path(__file__).resolve().parents[2] / "docs" / "exports.md"


def test_the_options_table_lists_every_export_format():
    (row,) = [line for line in DOC.read_text().splitlines() if line.startswith("| `--format` |")]
    missing = [fmt for fmt in FORMATS if f"`{fmt}`" not in row]
    assert not missing, f"docs/exports.md's --format row does not name {missing}"
