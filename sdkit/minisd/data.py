"""Captioned images with known object masks: the answer key of the mini Stable Diffusion.

One or two flat objects on a plain grey background. Every attribute the caption names can be
read back from the pixels (colour by hue, place by centroid, shape by how much of its bounding box
it fills), and every sample carries each object's mask, so attention maps and generated images can
be scored against ground truth.

    scene = random_scene(random.Random(0))
    sample = render(scene, side=32)       # image (H, W, 3) in [0, 1], masks (objects, H, W)

Deterministic: `sample_at(seed, index)` is the same sample on every machine, so a training run
needs no stored data set and resumes at any step.
"""

from __future__ import annotations

import colorsys
import math
import random
from dataclasses import dataclass, replace

import numpy as np

# Six hues 60 degrees apart, so no two colours are neighbours a judge could confuse.
COLOURS = {"red": 0, "yellow": 60, "green": 120, "cyan": 180, "blue": 240, "magenta": 300}
SHAPES = ("circle", "square", "triangle")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
# The name of each cell of the 3x3 grid, as captions say it.
POSITIONS = {
    (0, 0): "top left",
    (0, 1): "top",
    (0, 2): "top right",
    (1, 0): "left",
    (1, 1): "center",
    (1, 2): "right",
    (2, 0): "bottom left",
    (2, 1): "bottom",
    (2, 2): "bottom right",
}
CELLS = {name: cell for cell, name in POSITIONS.items()}
RELATIONS = ("left of", "right of")
BACKGROUND = (0.5, 0.5, 0.5)  # grey: no saturation, so every coloured pixel belongs to an object
SATURATION, VALUE = 0.85, 0.9
RADIUS = 0.14  # object half-size, as a fraction of the image side
JITTER = 0.02  # largest shift of an object from its cell centre, as a fraction of the side
DEFAULT_SIDE = 32

# Combinations training never sees, for a compositional test: single objects of this colour and
# shape at this place (each colour, shape and place is seen otherwise), and pairs of these two
# objects (in either order and either relation).
HELD_OUT_SINGLES = (
    ("red", "triangle", "bottom right"),
    ("green", "circle", "top left"),
    ("blue", "square", "center"),
    ("yellow", "triangle", "left"),
    ("cyan", "square", "top right"),
    ("magenta", "circle", "bottom"),
)
HELD_OUT_PAIRS = (
    (("red", "square"), ("green", "circle")),
    (("blue", "triangle"), ("yellow", "square")),
    (("magenta", "circle"), ("cyan", "triangle")),
    (("yellow", "circle"), ("red", "triangle")),
)

SINGLE_TEMPLATES = (
    "a {c} {s} at the {p}",
    "a {c} {s} in the {p}",
    "{c} {s}, {p}",
    "there is a {c} {s} at the {p}",
    "the {p} has a {c} {s}",
    "a {s} colored {c} at the {p}",
)
PAIR_TEMPLATES = (
    "a {c1} {s1} to the {r} a {c2} {s2}",
    "a {c1} {s1} {r} a {c2} {s2}",
    "there is a {c1} {s1} to the {r} a {c2} {s2}",
    "{c1} {s1} {r} {c2} {s2}",
)


@dataclass(frozen=True)
class ObjectSpec:
    colour: str
    shape: str
    row: int
    column: int

    @property
    def position(self) -> str:
        return POSITIONS[(self.row, self.column)]


@dataclass(frozen=True)
class Scene:
    """One object, or two in one row with `relation` saying where objects[0] is from objects[1]."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    template: int = 0

    @property
    def caption(self) -> str:
        if len(self.objects) == 1:
            o = self.objects[0]
            return SINGLE_TEMPLATES[self.template].format(c=o.colour, s=o.shape, p=o.position)
        a, b = self.objects
        return PAIR_TEMPLATES[self.template].format(c1=a.colour, s1=a.shape, r=self.relation, c2=b.colour, s2=b.shape)

    @property
    def held_out(self) -> bool:
        if len(self.objects) == 1:
            o = self.objects[0]
            return (o.colour, o.shape, o.position) in HELD_OUT_SINGLES
        pair = {(o.colour, o.shape) for o in self.objects}
        return any(pair == set(held) for held in HELD_OUT_PAIRS)


@dataclass
class Sample:
    scene: Scene
    image: np.ndarray  # (H, W, 3) float32 in [0, 1]
    masks: np.ndarray  # (objects, H, W) bool: where each object covers at least half a pixel

    @property
    def caption(self) -> str:
        return self.scene.caption


def colour_rgb(name: str) -> tuple[float, float, float]:
    return colorsys.hsv_to_rgb(COLOURS[name] / 360, SATURATION, VALUE)


def single_scene(colour: str, shape: str, position: str, template: int = 0) -> Scene:
    row, column = CELLS[position]
    return Scene((ObjectSpec(colour, shape, row, column),), None, template)


def pair_scene(
    first: tuple[str, str],
    relation: str,
    second: tuple[str, str],
    row: int = 1,
    columns: tuple[int, int] | None = None,
    template: int = 0,
) -> Scene:
    """objects[0] = first, `relation` ("left of" / "right of") the second, in one row."""
    left, right = columns or (0, 2)
    a, b = (left, right) if relation == "left of" else (right, left)
    return Scene((ObjectSpec(*first, row, a), ObjectSpec(*second, row, b)), relation, template)


def random_scene(rng: random.Random, pair_fraction: float = 0.5, held_out: bool = False) -> Scene:
    """A random scene; held_out=False never returns a held-out combination, True only those."""
    while True:
        if rng.random() < pair_fraction:
            first = (rng.choice(list(COLOURS)), rng.choice(SHAPES))
            second = (rng.choice(list(COLOURS)), rng.choice(SHAPES))
            if first == second:  # "a red circle left of a red circle" names no object apart
                continue
            scene = pair_scene(
                first,
                rng.choice(RELATIONS),
                second,
                rng.randrange(3),
                tuple(sorted(rng.sample(range(3), 2))),
                rng.randrange(len(PAIR_TEMPLATES)),
            )
        else:
            scene = single_scene(
                rng.choice(list(COLOURS)),
                rng.choice(SHAPES),
                rng.choice(list(CELLS)),
                rng.randrange(len(SINGLE_TEMPLATES)),
            )
        if scene.held_out == held_out:
            return scene


def shape_coverage(shape: str, x: np.ndarray, y: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    """Whether each point (x, y) lies inside the shape centred at (cx, cy) with half-size r."""
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":  # a little smaller than the circle's box, so both hold about as many pixels
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
    if shape == "triangle":  # pointing up, apex at the top, base at the bottom
        top, bottom = -r, 0.8 * r
        half_width = r * (dy - top) / (bottom - top)
        return (dy >= top) & (dy <= bottom) & (np.abs(dx) <= half_width)
    raise ValueError(f"unknown shape {shape!r}")


def render(scene: Scene, side: int = DEFAULT_SIDE, rng: random.Random | None = None, supersample: int = 4) -> Sample:
    """Draw a scene, anti-aliased (each pixel averages supersample^2 points).

    With `rng`, each object is shifted from its cell centre by up to JITTER of the side.
    """
    if side < 12:
        raise ValueError(f"image side {side} is too small for a 3x3 grid of objects (at least 12)")
    cell, r = side / 3, RADIUS * side
    image = np.broadcast_to(np.array(BACKGROUND, np.float32), (side, side, 3)).copy()
    masks = []
    for obj in scene.objects:
        jx, jy = (rng.uniform(-JITTER, JITTER) * side, rng.uniform(-JITTER, JITTER) * side) if rng else (0.0, 0.0)
        cx, cy = (obj.column + 0.5) * cell + jx, (obj.row + 0.5) * cell + jy
        # Only the pixels of the object's box are sampled: every shape lies within r of its centre.
        top, left = max(0, math.floor(cy - r) - 1), max(0, math.floor(cx - r) - 1)
        bottom, right = min(side, math.ceil(cy + r) + 1), min(side, math.ceil(cx + r) + 1)
        y, x = np.meshgrid(
            (np.arange(top * supersample, bottom * supersample) + 0.5) / supersample,
            (np.arange(left * supersample, right * supersample) + 0.5) / supersample,
            indexing="ij",
        )
        inside = shape_coverage(obj.shape, x, y, cx, cy, r)
        alpha = np.zeros((side, side), np.float32)
        alpha[top:bottom, left:right] = inside.reshape(bottom - top, supersample, right - left, supersample).mean(
            axis=(1, 3)
        )
        image = image * (1 - alpha[..., None]) + np.array(colour_rgb(obj.colour), np.float32) * alpha[..., None]
        masks.append(alpha >= 0.5)
    return Sample(scene, image.astype(np.float32), np.stack(masks))


def swapped_objects(scene: Scene) -> Scene:
    """The scene with its two objects' colours and shapes exchanged, each cell kept (a pair's other order)."""
    a, b = scene.objects
    return replace(
        scene, objects=(replace(a, colour=b.colour, shape=b.shape), replace(b, colour=a.colour, shape=a.shape))
    )


def sample_at(
    seed: int,
    index: int,
    side: int = DEFAULT_SIDE,
    pair_fraction: float = 0.5,
    held_out: bool = False,
    swapped: bool = False,
) -> Sample:
    """The index-th sample of the stream `seed`: the same on every machine and in every run.

    swapped=True: a pair's sample drawn with its objects exchanged (swapped_objects), each object
    shifted from its cell as in the sample itself; a single object's sample as it is."""
    rng = random.Random(f"{seed}:{index}")
    scene = random_scene(rng, pair_fraction, held_out)
    return render(swapped_objects(scene) if swapped and len(scene.objects) == 2 else scene, side, rng)


_SCENES: dict[str, Scene] = {}


def parse_caption(caption: str) -> Scene | None:
    """The scene a caption the generator writes describes (one object at its cell; a pair in the
    middle row, in the columns its relation gives), or None for any other text."""
    if not _SCENES:
        objects = [(c, s) for c in COLOURS for s in SHAPES]
        for colour, shape in objects:
            for position in CELLS:
                for t in range(len(SINGLE_TEMPLATES)):
                    scene = single_scene(colour, shape, position, t)
                    _SCENES[scene.caption] = scene
        for first in objects:
            for second in objects:
                for relation in RELATIONS:
                    for t in range(len(PAIR_TEMPLATES)):
                        if first != second:
                            scene = pair_scene(first, relation, second, template=t)
                            _SCENES[scene.caption] = scene
    return _SCENES.get(" ".join(caption.split()))


def all_captions(held_out: bool = False) -> list[str]:
    """Every caption the generator can write (training ones, or only the held-out ones), sorted."""
    captions = set()
    for colour in COLOURS:
        for shape in SHAPES:
            for position in CELLS:
                for t in range(len(SINGLE_TEMPLATES)):
                    scene = single_scene(colour, shape, position, t)
                    if scene.held_out == held_out:
                        captions.add(scene.caption)
    objects = [(c, s) for c in COLOURS for s in SHAPES]
    for first in objects:
        for second in objects:
            for relation in RELATIONS:
                for t in range(len(PAIR_TEMPLATES)):
                    scene = pair_scene(first, relation, second, template=t)
                    if first != second and scene.held_out == held_out:
                        captions.add(scene.caption)
    return sorted(captions)


def to_model(image: np.ndarray) -> np.ndarray:
    """(H, W, 3) in [0, 1] -> (3, H, W) in [-1, 1], as the U-Net sees pixels."""
    return np.ascontiguousarray(image.transpose(2, 0, 1) * 2 - 1, dtype=np.float32)


def from_model(pixels) -> np.ndarray:
    """(3, H, W) in [-1, 1] (numpy or torch) -> (H, W, 3) in [0, 1], clipped."""
    array = pixels.detach().float().cpu().numpy() if hasattr(pixels, "detach") else np.asarray(pixels)
    return np.clip(array.transpose(1, 2, 0) / 2 + 0.5, 0, 1).astype(np.float32)
