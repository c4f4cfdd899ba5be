import argparse

import pytest

from sdkit.common import atomic_path, format_bytes, format_table, parse_bytes, write_text


def test_atomic_path_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "result.json"
    write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half-writ")
        raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind
    write_text(target, "new")
    assert target.read_text() == "new"


def test_sizes_and_tables():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes("2e9") == 2 * 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    assert format_bytes(128 * 2**30) == "128.0 GiB" and format_bytes(100) == "100 B"
    table = format_table(["name", "count"], [["a", 1234567], ["bb", 0.5]]).splitlines()
    assert table == ["name      count", "----  ---------", "a     1,234,567", "bb          0.5"]
