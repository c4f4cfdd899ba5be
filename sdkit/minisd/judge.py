"""Read objects back from pixels alone: colour by hue, place by centroid, shape by box fill.

The judge knows the generator's rules (grey background, six hues, a 3x3 grid) and nothing else:
no model, no caption. `find_objects` lists what an image shows; `judge` compares that with the
scene a caption asked for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from .data import COLOURS, POSITIONS, Scene

MIN_SATURATION = 0.35  # the background has none, the objects 0.85
MIN_AREA = 0.004  # smallest object, as a fraction of the image (4 pixels at 32 x 32)
# A triangle (apex up) holds far less in the top half of its box than in the bottom half; a
# circle fills about 3/4 of its box, a square all of it.
TRIANGLE_TOP_BELOW, SQUARE_FILL_ABOVE = 0.65, 0.92


@dataclass
class FoundObject:
    colour: str
    shape: str
    row: int
    column: int
    centroid: tuple[float, float]  # (y, x) in pixels
    area: int
    fill: float  # area / bounding-box area
    top_ratio: float  # area in the top half of the box / area in the bottom half
    mask: np.ndarray

    @property
    def position(self) -> str:
        return POSITIONS[(self.row, self.column)]

    def to_json(self) -> dict:
        out = asdict(self)
        del out["mask"]
        return {**out, "position": self.position}


def hue_saturation(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel hue in degrees and HSV saturation, from (H, W, 3) in [0, 1]."""
    rgb = np.clip(image, 0, 1).astype(np.float64)
    high, low = rgb.max(-1), rgb.min(-1)
    spread = np.where(high > low, high - low, 1.0)
    r, g, b = (rgb[..., i] for i in range(3))
    hue = np.select([high == r, high == g], [(g - b) / spread, 2 + (b - r) / spread], 4 + (r - g) / spread)
    saturation = np.where(high > 0, (high - low) / np.where(high > 0, high, 1.0), 0.0)
    return (hue * 60) % 360, saturation


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a boolean mask, each as a boolean mask."""
    seen = np.zeros_like(mask)
    found = []
    height, width = mask.shape
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        component = np.zeros_like(mask)
        queue = deque([start])
        seen[start] = True
        while queue:
            y, x = queue.popleft()
            component[y, x] = True
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        found.append(component)
    return found


def _nearest_colour(hues: np.ndarray) -> str:
    # The circular mean of the object's hues, then the nearest of the six.
    angle = np.deg2rad(hues)
    mean = np.rad2deg(np.arctan2(np.sin(angle).mean(), np.cos(angle).mean())) % 360
    return min(COLOURS, key=lambda name: min(abs(mean - COLOURS[name]), 360 - abs(mean - COLOURS[name])))


def classify_shape(component: np.ndarray) -> tuple[str, float, float]:
    """(shape, fill of the bounding box, area of the top half over the bottom half)."""
    ys, xs = np.nonzero(component)
    top, bottom = ys.min(), ys.max() + 1
    box = component[top:bottom, xs.min() : xs.max() + 1]
    half = box.shape[0] / 2
    weights = np.clip(half - np.arange(box.shape[0]), 0, 1)  # a middle row split in half when odd
    rows = box.sum(1)
    upper, lower = (rows * weights).sum(), (rows * (1 - weights)).sum()
    fill, top_ratio = box.mean(), upper / max(lower, 1)
    shape = "triangle" if top_ratio < TRIANGLE_TOP_BELOW else "circle" if fill < SQUARE_FILL_ABOVE else "square"
    return shape, float(fill), float(top_ratio)


def find_objects(image: np.ndarray, max_objects: int = 2) -> list[FoundObject]:
    """The largest coloured regions of an image (H, W, 3) in [0, 1], largest first.

    A region is a 4-connected set of saturated pixels that share one of the six hues (so two
    touching objects of different colours stay two objects).
    """
    side = image.shape[0]
    hue, saturation = hue_saturation(image)
    coloured = saturation >= MIN_SATURATION
    names = list(COLOURS)
    centres = np.array([COLOURS[n] for n in names])
    distance = np.abs(hue[..., None] - centres)
    label = np.argmin(np.minimum(distance, 360 - distance), axis=-1)
    objects = []
    for index, name in enumerate(names):
        for component in _components(coloured & (label == index)):
            area = int(component.sum())
            if area < MIN_AREA * image.shape[0] * image.shape[1]:
                continue
            ys, xs = np.nonzero(component)
            shape, fill, top_ratio = classify_shape(component)
            cy, cx = ys.mean() + 0.5, xs.mean() + 0.5
            # The shape's box centre marks its cell: a triangle's centroid sits below its middle.
            my, mx = (ys.min() + ys.max() + 1) / 2, (xs.min() + xs.max() + 1) / 2
            row, column = (min(2, int(v * 3 / side)) for v in (my, mx))
            objects.append(FoundObject(_nearest_colour(hue[component]), shape, row, column, (float(cy), float(cx)),
                                       area, fill, top_ratio, component))  # fmt: skip
    objects.sort(key=lambda o: -o.area)
    return objects[:max_objects]


@dataclass
class Verdict:
    colour: bool
    position: bool  # single: the cell; pair: the relation (which is left of which)
    shape: bool
    found: list[dict]

    @property
    def all(self) -> bool:
        return self.colour and self.position and self.shape

    def to_json(self) -> dict:
        return {"colour": self.colour, "position": self.position, "shape": self.shape, "all": self.all,
                "found": self.found}  # fmt: skip


def judge(image: np.ndarray, scene: Scene) -> Verdict:
    """Does the image show what the scene asks for? Judged on the largest one or two regions.

    Single object: its colour, its cell and its shape. Pair: both colours and both shapes on the
    right objects (the assignment that matches best), and the relation between them. A missing
    object fails everything it should have shown.
    """
    found = find_objects(image, max_objects=len(scene.objects))
    shown = [o.to_json() for o in found]
    if len(scene.objects) == 1:
        if not found:
            return Verdict(False, False, False, shown)
        want, got = scene.objects[0], found[0]
        return Verdict(got.colour == want.colour, (got.row, got.column) == (want.row, want.column),
                       got.shape == want.shape, shown)  # fmt: skip
    if len(found) < 2:
        return Verdict(False, False, False, shown)
    a, b = scene.objects

    def score(pair):
        return sum((o.colour == w.colour) + (o.shape == w.shape) for o, w in zip(pair, (a, b)))

    first, second = max((found[0], found[1]), (found[1], found[0]), key=score)
    colour = first.colour == a.colour and second.colour == b.colour
    shape = first.shape == a.shape and second.shape == b.shape
    is_left = first.centroid[1] < second.centroid[1]
    position = is_left == (scene.relation == "left of")
    return Verdict(colour, position, shape, shown)


ATTRIBUTES = ("colour", "position", "shape", "all")


def accuracy(verdicts: list[Verdict]) -> dict[str, float]:
    """Fraction correct per attribute, and for all attributes at once."""
    n = max(len(verdicts), 1)
    return {k: sum(getattr(v, k) for v in verdicts) / n for k in ATTRIBUTES}


