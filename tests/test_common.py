import argparse
import re

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
    assert (
        parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes("2e9") == 2 * 10**9
    )
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    assert format_bytes(128 * 2**30) == "128.0 GiB" and format_bytes(100) == "100 B"
    table = format_table(["name", "count"], [["a", 1234567], ["bb", 0.5]]).splitlines()
    assert table == ["name      count", "----  ---------", "a     1,234,567", "bb          0.5"]


@pytest.mark.parametrize(
    "argv",
    [
        ["audit", "sd15"],
        ["audit", "sdxl", "--context-dim", "1024"],
        ["audit", "minisd"],
        ["scoretable"],
        ["scoretable", "--preset", "minisd", "--size", "64"],
        ["condition"],
        ["scoretable", "--height", "512", "--width", "768", "--batch", "2", "--cfg"],
        ["--help"],
        ["condition", "--help"],
        ["minisd", "train", "--help"],
    ],
)
def test_output_lines_fit_in_120_columns(cli, argv):
    code, out, err = cli(*argv)
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 120


def test_every_option_says_what_it_does():
    from sdkit.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            for sub in getattr(action, "choices", None).values() if isinstance(action.choices, dict) else []:
                yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS:
                assert action.help, (parser.prog, action.option_strings)
        help_text = parser.format_help()
        for action in parser._actions:  # every default is shown, 0 too (0 == False once hid it)
            if (
                action.option_strings
                and action.default is not None
                and not isinstance(action.default, bool)
                and argparse.SUPPRESS not in (action.default, action.help)
            ):
                text = " ".join(help_text.split())
                shown = ",".join(map(str, action.default)) if isinstance(action.default, tuple) else action.default
                said = "default" in (action.help or "")  # the help says it in its own words, once
                assert said or f"(default: {shown})" in text, (parser.prog, action.dest)
        # once: never the formatter's "(default: X)" beside the help's own "default X"
        assert not re.search(r"default:? [^()]*\) \(default: ", " ".join(help_text.split())), parser.prog
