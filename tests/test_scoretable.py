import json

import pytest
import torch

from sdkit.scoretable import (
    attention_scores,
    chunked_attention,
    format_score_tables,
    largest_naive_tokens,
    latent_grid,
    measure,
    naive_attention,
    predicted_peak,
    relative_difference,
    score_tables,
    sdpa_attention,
    table_bytes,
)


def test_512_latent_against_pixel():
    t = score_tables(512)
    finest = t.levels[0]
    assert (finest.tokens, finest.entries_per_head, finest.heads, finest.head_dim) == (4096, 16_777_216, 8, 40)
    assert (t.pixel.tokens, t.pixel.entries_per_head) == (262_144, 68_719_476_736)
    assert t.pixel.bytes_per_head == 128 * 2**30  # float16
    assert [lv.tokens for lv in t.levels] == [4096, 1024, 256, 64]
    assert [lv.layers for lv in t.levels] == [5, 5, 5, 1]  # 2 down + 3 up per level, 1 in the middle
    assert [lv.head_dim for lv in t.levels] == [40, 80, 160, 160]


def test_doubling_the_side_gives_16x_the_table():
    sweep = {s["scale"]: s for s in score_tables(512).sweep}
    assert [(s["height"], s["width"]) for s in sweep.values()] == [
        (256, 256),
        (512, 512),
        (768, 768),
        (1024, 1024),
        (2048, 2048),
    ]
    for small, big in [(0.5, 1), (1, 2), (2, 4)]:
        assert sweep[big]["tokens"] == 4 * sweep[small]["tokens"]
        assert sweep[big]["entries_per_head"] == 16 * sweep[small]["entries_per_head"]
    assert score_tables(1024).levels[0].entries_per_head == 16 * score_tables(512).levels[0].entries_per_head


def test_batch_cfg_and_non_square():
    t = score_tables(512, 768, batch=2, cfg=True, dtype="float32")
    finest = t.levels[0]
    assert finest.grid == (64, 96) and finest.tokens == 6144
    assert finest.bytes_all_heads == 6144**2 * 4 * 8 * 4  # fp32, 8 heads, batch 2 x 2
    # the sweep keeps 2:3, and compares against the requested size, not a square 512
    assert [(s["height"], s["width"]) for s in t.sweep] == [
        (256, 384),
        (512, 768),
        (768, 1152),
        (1024, 1536),
        (2048, 3072),
    ]
    assert [s["cells_vs_requested"] for s in t.sweep] == [0.25, 1, 2.25, 4, 16]
    assert "Size sweep at the requested aspect ratio" in format_score_tables(t) and "512x768" in format_score_tables(t)


def test_cross_attention_tables_are_cells_by_text_tokens():
    t = score_tables(512)
    assert [(lv.tokens, lv.layers, lv.entries_per_head) for lv in t.cross] == [
        (4096, 5, 4096 * 77),
        (1024, 5, 1024 * 77),
        (256, 5, 256 * 77),
        (64, 1, 64 * 77),
        (262_144, 0, 262_144 * 77),
    ]
    assert t.cross[0].bytes_per_head == 4096 * 77 * 2  # float16
    assert t.cross[-1].entries_per_head // t.cross[0].entries_per_head == 64  # linear in cells, unlike self-attention
    assert score_tables(512, text_tokens=154).cross[0].entries_per_head == 4096 * 154
    assert "Cross-attention score tables (cells x 77 text tokens" in format_score_tables(t)
    assert latent_grid(520, 520, 3) == (9, 9)  # 65 -> 33 -> 17 -> 9: stride-2 convs round up
    assert score_tables(512, model="sd21").levels[0].heads == 5


def test_sdxl_has_no_self_attention_at_the_finest_level():
    t = score_tables(1024, model="sdxl")
    assert [lv.tokens for lv in t.levels] == [64 * 64, 32 * 32]
    assert [lv.heads for lv in t.levels] == [10, 20]


@pytest.mark.parametrize("grid", [(16, 16), (12, 20), (7, 9)])
@pytest.mark.parametrize("rows", [1, 7, 64, 100, 1000])
def test_chunked_equals_naive(grid, rows):
    torch.manual_seed(0)
    tokens = grid[0] * grid[1]
    q, k, v = (torch.randn(2, 3, tokens, 40) for _ in range(3))
    naive = naive_attention(q, k, v)
    assert relative_difference(chunked_attention(q, k, v, rows), naive) <= 1e-5
    assert relative_difference(sdpa_attention(q, k, v), naive) <= 1e-5
    assert relative_difference(naive, torch.softmax(q @ k.transpose(-1, -2) / 40**0.5, -1) @ v) <= 1e-5


def test_predicted_table_bytes_are_what_naive_builds():
    for tokens, heads, dtype in [(256, 8, torch.float32), (100, 3, torch.float16), (64, 1, torch.bfloat16)]:
        q = torch.randn(1, heads, tokens, 40).to(dtype)
        table = attention_scores(q, q)
        name = str(dtype).removeprefix("torch.")
        assert table.numel() * table.element_size() == table_bytes(tokens, name, heads=heads)


def test_softmax_mixes_it_never_picks():
    q = torch.tensor([[1.0, 0.0]])
    k = torch.tensor([[3.0, 0.0], [3.0, 0.0], [0.0, 0.0], [0.0, 0.0]]) * 2**0.5  # scores 3, 3, 0, 0 after 1/sqrt(2)
    weights = attention_scores(q, k)[0]
    assert torch.allclose(weights, torch.tensor([0.476, 0.476, 0.024, 0.024]), atol=5e-4)


def test_largest_tokens_inverts_the_prediction():
    available = 3 * 2**30
    n = largest_naive_tokens(1, 40, "float16", available)
    assert predicted_peak("naive", n, 1, 40, "float16", n) <= available
    assert predicted_peak("naive", n + 1024, 1, 40, "float16", n + 1024) > available


def test_measure_on_cpu_skips_what_does_not_fit():
    ms = measure(
        512, heads=2, head_dim=40, dtype="float32", device="cpu", budget=1_500_000, chunk_budget=2**16, repeats=1
    )
    by = {m.implementation: m for m in ms}
    assert by["naive"].skipped == (
        "naive attention at 512 tokens needs 2.6 MiB for 2 float32 heads; the budget is 1.4 MiB"
    )
    assert by["naive"].peak_bytes is None
    assert by["chunked"].chunk_rows == 16 and by["chunked"].peak_bytes > 0 and by["chunked"].reference
    assert by["sdpa"].max_rel_diff <= 1e-5 and by["sdpa"].backend


def test_measured_naive_peak_tracks_the_prediction():
    (naive,) = measure(2048, heads=4, head_dim=40, dtype="float32", device="cpu", implementations=("naive",), repeats=1)
    assert naive.predicted_bytes == 4 * 2048**2 * 4 + 4 * 4 * 2048 * 40 * 4
    assert 0.9 <= naive.peak_bytes / naive.predicted_bytes <= 1.15


def test_cli_scoretable(cli, tmp_path):
    code, out, _ = cli("scoretable", "--size", "512", "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["levels"][0]["tokens"], data["levels"][0]["entries_per_head"]) == (4096, 16_777_216)
    assert (data["pixel"]["tokens"], data["pixel"]["entries_per_head"]) == (262_144, 68_719_476_736)
    code, out, _ = cli("scoretable")
    assert code == 0 and "68,719,476,736" in out and "16,777,216" in out
    png = tmp_path / "plot.png"
    code, out, _ = cli("scoretable", "--measure", "--tokens", "256", "--heads", "1", "--repeats", "1", "--plot", png)
    assert code == 0 and "sdpa ran" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = cli("scoretable", "--size", "500")
    assert code == 2 and "multiples of 8" in err


@pytest.mark.slow  # the script's own logic, on the CPU; CI runs it with -m slow
def test_gpu_script_logic_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "gpu_scoretable.py"
    spec = importlib.util.spec_from_file_location("gpu_scoretable", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gpu.json"
    report = script.main(
        [
            "--device",
            "cpu",
            "--latent-tokens",
            "256",
            "--pixel-tokens",
            "1024",
            "--budget",
            "16MiB",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["latent"][0]["tokens"] == 256
    largest = report["largest_naive"][-1]
    assert largest["peak_bytes"] and largest["predicted_bytes"] <= 0.9 * 16 * 2**20
    assert {m["implementation"] for m in report["pixel"]} == {"sdpa", "chunked"}


def test_gpu_script_refuses_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    script = Path(__file__).parent.parent / "scripts" / "gpu_scoretable.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "no CUDA device" in run.stderr
