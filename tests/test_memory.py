import json
import math

import pytest
import torch

from sdkit.memory import (
    PUBLISHED,
    MemoryReport,
    Store,
    analytic_capacity,
    cosine_moment,
    crossing,
    exhaustive,
    format_report,
    measure_curve,
    memory_grid,
    real_key_capacity,
    sd_levels,
    streamed,
)


def test_published_figures_are_the_closed_forms_at_d_64():
    assert analytic_capacity("linear", 64) - 1 == PUBLISHED["linear"] == 64
    assert analytic_capacity("relu", 64) - 1 == PUBLISHED["relu"] == 128
    gaussian = analytic_capacity("softmax", 64, gaussian=True)
    assert gaussian == pytest.approx(1 + math.exp(14)) and abs(gaussian / PUBLISHED["softmax"] - 1) < 0.01
    assert 1.0 < analytic_capacity("softmax", 64) / gaussian < 1.25  # the sphere's lighter tails


def test_cosine_moment_against_sampling():
    generator = torch.Generator().manual_seed(0)
    for d, s in ((4, 2.0), (16, 8.0), (64, 16.0)):
        a = torch.nn.functional.normalize(torch.randn(400_000, d, generator=generator, dtype=torch.float64), dim=1)
        sampled = torch.exp(s * a[:, 0]).mean().item()
        assert cosine_moment(d, s) == pytest.approx(sampled, rel=0.03)


@pytest.mark.parametrize("phi,d", [("linear", 8), ("linear", 16), ("relu", 8), ("relu", 16), ("softmax", 8)])
def test_analytic_capacity_matches_exhaustive_measurement(phi, d):
    predicted = analytic_capacity(phi, d)
    memories = memory_grid(max(2, int(predicted / 4)), int(predicted * 4), per_octave=6)
    curve = measure_curve(phi, d, memories, trials=16)
    assert curve.capacity == pytest.approx(predicted, rel=0.25)
    assert not curve.extrapolated
    lo, hi = curve.interval
    assert lo <= curve.capacity <= hi and hi / lo < 1.5


def test_chunked_equals_unchunked():
    store = Store(16, seed=3)
    memories = [512, 3000, 9000]
    whole = streamed("softmax", store, memories, beta=4.0, queries=64, accuracy_queries=32, chunk=9000)
    chunked = streamed("softmax", Store(16, seed=3), memories, beta=4.0, queries=64, accuracy_queries=32, chunk=1000)
    for a, b in zip(whole[0], chunked[0]):
        assert a == pytest.approx(b, rel=1e-5)
    assert whole[1] == chunked[1]
    # and the streamed SIR at M agrees with the exhaustive one (same store, its first keys as queries)
    sir, _, powers = exhaustive("softmax", Store(16, seed=3), 512, beta=4.0)
    assert sir == pytest.approx(1 / float(powers.mean()) ** 0.5)
    assert whole[0][0] == pytest.approx(sir, rel=0.2)


def test_store_prefix_does_not_depend_on_how_it_is_read():
    store = Store(8, seed=1)
    whole = store.rows("keys", 0, 10000)
    parts = torch.cat([Store(8, seed=1).rows("keys", a, b) for a, b in ((0, 5), (5, 4100), (4100, 10000))])
    assert torch.equal(whole, parts)
    assert torch.allclose(whole.norm(dim=1), torch.ones(10000))


def test_real_keys_that_repeat_have_little_capacity():
    # 20 distinct directions, each stored many times: retrieval cannot tell the copies apart.
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(20, 32, generator=generator)
    keys = base[torch.randint(0, 20, (2000,), generator=generator)] + 0.01 * torch.randn(2000, 32, generator=generator)
    random_curve = measure_curve("softmax", 32, [64, 256, 1024], trials=2)
    real_curve = measure_curve("softmax", 32, [64, 256, 1024], keys=keys, key_source="clustered", trials=2)
    assert all(r < q for r, q in zip(real_curve.sir, random_curve.sir))
    assert real_curve.accuracy[-1] < 0.5 < random_curve.accuracy[-1]
    rows = real_key_capacity("clustered", keys[:512], [64, 256], source="20 directions, each stored many times")
    assert [r["keys"] for r in rows[:3]] == ["clustered raw", "clustered whitened", "random"]
    text = format_report(MemoryReport([], [], real_keys=rows, sd_levels=sd_levels()))
    assert "  clustered: 20 directions, each stored many times" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    # two directions: a linear memory is swamped at the smallest store tried, and says so
    twice = real_key_capacity("two", base[:2].repeat(100, 1), [8, 16], source="two directions")
    swamped = [r for r in twice if r["phi"] == "linear" and r["keys"] == "two raw"][0]
    assert swamped["measured"] is None and swamped["searched_from"] == 8
    assert "< 8" in format_report(MemoryReport([], [], real_keys=twice, sd_levels=sd_levels()))


def test_crossing_interpolates_and_extrapolates():
    assert crossing([10, 100], [10.0, 0.1])[0] == pytest.approx(31.62, rel=1e-3)
    value, extrapolated = crossing([10, 100], [4.0, 2.0])
    assert extrapolated and value == pytest.approx(400)


def test_cli_memory_quick(cli, tmp_path):
    code, out, err = cli("memory", "--quick", "--json", "--plot", tmp_path / "m.png")
    assert code == 0, err
    report = json.loads(out)
    for row in report["capacities"]:
        if row["measured"] and not row["extrapolated"]:
            assert row["measured"] == pytest.approx(row["analytic"], rel=0.25), row
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert len(report["sd_levels"]) == 4
    assert report["peak_memory_bytes"] > 50 * 2**20  # torch alone takes more


def test_stores_draw_the_same_keys_in_every_process():
    # The block seeds came from Python's hash() of a tuple with a str, which differs per process
    # (PYTHONHASHSEED): `sdkit memory` gave other capacities every run.
    import subprocess
    import sys

    code = "from sdkit.memory import Store; print(Store(16, seed=3).rows('keys', 0, 5).sum().item())"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
