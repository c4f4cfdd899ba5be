"""README.md against the data it reports: every table of measured numbers is the one
scripts/readme_tables.py writes from the committed JSON (or, for FLOPs, from the code itself); and
every Python snippet runs as written."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

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


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_every_python_snippet_runs_as_written(tiny_sd, tmp_path, monkeypatch):
    """Each Python block of the README, run as written in a folder that holds what it names: a tiny
    random SD pipeline at path/to/stable-diffusion-v1-5 and the embeddings `sdkit adapter encode`
    writes, at that pipeline's width."""
    from safetensors.torch import load_file, save_file

    pipe, _ = tiny_sd
    pipe.save_pretrained(tmp_path / "path" / "to" / "stable-diffusion-v1-5")
    width = pipe.unet.config.cross_attention_dim
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(1, 77, width, generator=generator) for name in ("prompt_embeds", "negative_prompt_embeds")},
              str(tmp_path / "embeds.safetensors"))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    snippets = python_snippets()
    assert len(snippets) == 3
    namespaces = []
    for snippet in snippets:
        namespaces.append({})
        exec(compile(snippet, "README.md", "exec"), namespaces[-1])  # noqa: S102 (our own README)
    audit, traced, adapted = namespaces
    assert audit["a"].attention_blocks["mlp_share"] == pytest.approx(0.5567934304288111, rel=1e-12)
    assert audit["a"].text_width_swap["parameter_change"] == 6_389_760  # to_k, to_v: 2 x 256 x (5x320 + 5x640 + 6x1280)
    maps = load_file("maps.safetensors")
    assert sorted({key.split("@")[1] for key in maps}) == ["501", "981"]
    assert next(iter(maps.values())).shape[:2] == (2, 4)  # two prompts, four heads kept
    assert traced["trace"].token_maps(item=0, layers=[16], timesteps=[981], head=3).shape == (77, 32, 32)
    assert adapted["image"].size == (64, 64)
