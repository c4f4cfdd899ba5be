"""README.md against the data it reports: every table of measured numbers is the one
scripts/readme_tables.py writes from the committed JSON (or, for FLOPs, from the code itself)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = readme_tables()


def mismatches(readme: str) -> list[str]:
    """The names of the tables README text does not hold as written from their data."""
    return [name for name in TABLES.TABLES if TABLES.block(name) not in readme]


def test_readme_tables_are_their_data():
    readme = (ROOT / "README.md").read_text()
    wrong = mismatches(readme)
    assert not wrong, f"README.md's {', '.join(wrong)} table(s) differ from their data: python scripts/readme_tables.py --write"


@pytest.mark.parametrize("name", ["eval", "memory", "steering"])
def test_a_number_edited_by_hand_fails(name):
    readme = (ROOT / "README.md").read_text()
    table = TABLES.TABLES[name]()
    row = table.splitlines()[2]
    digit = next(i for i, c in enumerate(row) if c.isdigit())
    edited_row = row[:digit] + str((int(row[digit]) + 1) % 10) + row[digit + 1 :]
    edited = readme.replace(row, edited_row, 1)
    assert edited != readme and mismatches(edited) == [name]
