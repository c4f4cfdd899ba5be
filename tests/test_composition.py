"""Composition: the text probe, and (below) where the U-Net loses binding and how steering restores it."""

import pytest
import torch

from sdkit.minisd.data import COLOURS, RELATIONS, SHAPES
from sdkit.minisd.probe import fit_probe, pair_captions, probe_accuracy, probe_examples, run_probe


def test_pair_captions_are_every_pair_the_generator_writes():
    scenes = pair_captions()
    objects = len(COLOURS) * len(SHAPES)
    assert len(scenes) == objects * (objects - 1) * len(RELATIONS) * 4
    assert len({s.caption for s in scenes}) == len(scenes)


def test_probe_reads_what_is_there_and_only_that(bert):
    report = run_probe(bert)
    rows = {(r["word"], r["target"]): r for r in report.rows}
    assert report.train_pairs + report.test_pairs == 153 and report.test_pairs == 46
    # The word itself names its colour: its embedding alone gives it, on pairs never trained on.
    assert rows[("colour", "colour")]["input embedding"] == 1.0
    # A context-free embedding cannot know which object is left: exactly the class balance.
    assert rows[("colour", "left")]["input embedding"] == rows[("colour", "left")]["chance"] == 0.5
    assert rows[("shape", "left")]["input embedding"] == 0.5
    # Nor can a shape word's own embedding know the colour bound to it.
    assert rows[("shape", "colour")]["input embedding"] <= rows[("shape", "colour")]["chance"] + 0.05
    assert all(r["test"] == 1472 and r["train"] == 3424 for r in report.rows)


def test_probe_fits_a_separable_problem():
    torch.manual_seed(0)
    x = torch.randn(400, 5)
    y = (x[:, 0] + 0.5 * x[:, 3] > 0).long()
    model = fit_probe(x[:300], y[:300], 2, weight_decay=1e-4)
    assert probe_accuracy(model, x[300:], y[300:]) >= 0.97
