"""Read objects back from pixels alone: colour by hue, place by the centre of its box, shape by moments.

The judge knows the generator's rules (grey background, six hues, a 3x3 grid, three shapes) and
nothing else: no model, no caption. `find_objects` lists what an image shows; `judge` compares that
with the scene a caption asked for.

Shape is read from two moments of the object's chroma (colour mixes linearly with the grey
background, so a soft edge weighs what it covers): a fourth-order cumulant that is 0 for a circle
and negative for an axis-aligned square, and a third-order one (skew) that is negative for a
triangle with its apex up. Cumulants above the second are unchanged by a Gaussian blur, so the
verdict does not depend on how sharp the edges are, which a thresholded mask's box fill does: the
first judge (fill of the thresholded mask's box) fell to 64 % on generator images blurred by
0.8 pixels, calling soft squares circles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from .data import COLOURS, POSITIONS, RADIUS, SHAPES, Scene, shape_coverage

# A pixel half covered by an object has saturation 0.55 (the background has none, objects 0.85): the
# generator's masks are the pixels at least half covered. A little below that, for paler colours; a
# blur that bridges two objects of one colour still leaves them apart at this level.
MIN_SATURATION = 0.5
# A region counts as an object from half the area of the smallest shape the generator draws (the
# triangle: 18 pixels at 32 x 32); smaller specks, such as the few pixels of the opposite hue a model
# leaves at an edge, are not objects.
MIN_AREA_OF_SMALLEST = 0.5
SOFT_EDGE = 2  # pixels around an object's mask whose chroma still counts towards its shape


@dataclass
class FoundObject:
    colour: str
    shape: str
    row: int
    column: int
    centroid: tuple[float, float]  # (y, x) in pixels
    area: int
    four_fold: float  # 4th-order cumulant anisotropy / mass^2: 0 circle, -0.0167 square
    skew: float  # 3rd-order vertical cumulant / mass^1.5: 0 circle and square, -0.018 triangle
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


def shape_moments(weights: np.ndarray) -> tuple[float, float]:
    """(four_fold, skew) of a non-negative weight map: scale- and translation-free cumulants.

    four_fold = (k40 + k04 - 6 k22) / m^2, zero for any shape that looks the same turned by any
    angle; skew = k03 / m^1.5 with y pointing down. Both are sums of weights, so they hold for a
    blurred or anti-aliased shape as for a sharp one.
    """
    ys, xs = np.nonzero(weights)
    w = weights[ys, xs].astype(np.float64)
    mass = w.sum()
    if mass <= 0:
        return 0.0, 0.0
    dy, dx = ys - (w * ys).sum() / mass, xs - (w * xs).sum() / mass

    def mu(p: int, q: int) -> float:
        return float((w * dx**p * dy**q).sum() / mass)

    k40, k04 = mu(4, 0) - 3 * mu(2, 0) ** 2, mu(0, 4) - 3 * mu(0, 2) ** 2
    k22 = mu(2, 2) - mu(2, 0) * mu(0, 2) - 2 * mu(1, 1) ** 2
    return (k40 + k04 - 6 * k22) / mass**2, mu(0, 3) / mass**1.5


_PROTOTYPES: dict[str, tuple[float, float]] = {}
_AREAS: dict[str, float] = {}


def shape_prototypes() -> dict[str, tuple[float, float]]:
    """Each shape's (four_fold, skew) as the generator draws it, from a fine rendering."""
    if not _PROTOTYPES:
        side = 512
        y, x = np.meshgrid(np.arange(side) + 0.5, np.arange(side) + 0.5, indexing="ij")
        for shape in SHAPES:
            inside = shape_coverage(shape, x, y, side / 2, side / 2, side / 4).astype(float)
            _PROTOTYPES[shape] = shape_moments(inside)
            _AREAS[shape] = inside.mean() * (RADIUS * 4) ** 2  # as a fraction of an image, at the generator's size
    return _PROTOTYPES


def min_object_pixels(height: int, width: int) -> float:
    """The fewest pixels a region needs to count as an object, in an image of this size."""
    shape_prototypes()
    return MIN_AREA_OF_SMALLEST * min(_AREAS.values()) * height * width


def classify_shape(weights: np.ndarray) -> tuple[str, float, float]:
    """(the nearest shape by moments, four_fold, skew) of an object's weight map."""
    four_fold, skew = shape_moments(weights)
    prototypes = shape_prototypes()
    shape = min(SHAPES, key=lambda s: (prototypes[s][0] - four_fold) ** 2 + (prototypes[s][1] - skew) ** 2)
    return shape, four_fold, skew


def _grow(mask: np.ndarray, steps: int) -> np.ndarray:
    """The mask grown by `steps` pixels (4-neighbours)."""
    grown = mask.copy()
    for _ in range(steps):
        edge = grown.copy()
        edge[1:] |= grown[:-1]
        edge[:-1] |= grown[1:]
        edge[:, 1:] |= grown[:, :-1]
        edge[:, :-1] |= grown[:, 1:]
        grown = edge
    return grown


def find_objects(image: np.ndarray, max_objects: int | None = None) -> list[FoundObject]:
    """The coloured regions of an image (H, W, 3) in [0, 1], largest first (at most `max_objects`).

    A region is a 4-connected set of saturated pixels that share one of the six hues (so two
    touching objects of different colours stay two objects).
    """
    side = image.shape[0]
    hue, saturation = hue_saturation(image)
    coloured = saturation >= MIN_SATURATION
    rgb = np.clip(image, 0, 1)
    chroma = rgb.max(-1) - rgb.min(-1)  # a colour blended with grey by alpha has alpha times its chroma
    background = float(np.median(chroma[~coloured])) if (~coloured).any() else 0.0
    names = list(COLOURS)
    centres = np.array([COLOURS[n] for n in names])
    distance = np.abs(hue[..., None] - centres)
    label = np.argmin(np.minimum(distance, 360 - distance), axis=-1)
    objects, smallest = [], min_object_pixels(*image.shape[:2])
    for index in range(len(names)):
        for component in _components(coloured & (label == index)):
            area = int(component.sum())
            if area < smallest:
                continue
            ys, xs = np.nonzero(component)
            # Its soft edge: the pixels near it of its hue, weighted by chroma above the background's.
            peak = float(np.percentile(chroma[component], 90))
            weights = np.clip((chroma - background) / max(peak - background, 1e-6), 0, 1)
            shape, four_fold, skew = classify_shape(weights * (_grow(component, SOFT_EDGE) & (label == index)))
            cy, cx = ys.mean() + 0.5, xs.mean() + 0.5
            # The shape's box centre marks its cell: a triangle's centroid sits below its middle.
            my, mx = (ys.min() + ys.max() + 1) / 2, (xs.min() + xs.max() + 1) / 2
            row, column = (min(2, int(v * 3 / side)) for v in (my, mx))
            objects.append(
                FoundObject(
                    _nearest_colour(hue[component]),
                    shape,
                    row,
                    column,
                    (float(cy), float(cx)),
                    area,
                    four_fold,
                    skew,
                    component,
                )
            )
    objects.sort(key=lambda o: -o.area)
    return objects[:max_objects] if max_objects is not None else objects


@dataclass
class Verdict:
    colour: bool
    position: bool  # single: the cell; pair: the relation (which is left of which)
    shape: bool
    extra: bool  # more objects in the image than the caption names
    found: list[dict]

    @property
    def all(self) -> bool:
        return self.colour and self.position and self.shape and not self.extra

    @property
    def bound(self) -> bool:
        """Every named object is there with its own colour and shape (for a pair: binding right)."""
        return self.colour and self.shape

    def to_json(self) -> dict:
        return {
            "colour": self.colour,
            "position": self.position,
            "shape": self.shape,
            "extra": self.extra,
            "all": self.all,
            "found": self.found,
        }


def judge(image: np.ndarray, scene: Scene) -> Verdict:
    """Does the image show what the scene asks for, and nothing more?

    Attributes are read on the largest one or two regions. Single object: its colour, its cell
    and its shape. Pair: both colours and both shapes on the right objects (the assignment that
    matches best), and the relation between them. A missing object fails everything it should
    have shown; more objects than the caption names (`extra`) fail the image as a whole.
    """
    found = find_objects(image)
    shown = [o.to_json() for o in found]
    extra = len(found) > len(scene.objects)
    if len(scene.objects) == 1:
        if not found:
            return Verdict(False, False, False, extra, shown)
        want, got = scene.objects[0], found[0]
        return Verdict(
            got.colour == want.colour,
            (got.row, got.column) == (want.row, want.column),
            got.shape == want.shape,
            extra,
            shown,
        )
    if len(found) < 2:
        return Verdict(False, False, False, extra, shown)
    a, b = scene.objects

    def score(pair):
        return sum((o.colour == w.colour) + (o.shape == w.shape) for o, w in zip(pair, (a, b)))

    first, second = max((found[0], found[1]), (found[1], found[0]), key=score)
    colour = first.colour == a.colour and second.colour == b.colour
    shape = first.shape == a.shape and second.shape == b.shape
    is_left = first.centroid[1] < second.centroid[1]
    position = is_left == (scene.relation == "left of")
    return Verdict(colour, position, shape, extra, shown)


ATTRIBUTES = ("colour", "position", "shape", "all")  # right or wrong per image
# A judged table's columns: the attributes, the images showing more objects than named, and the
# position (for pairs: the relation) over the images whose named objects are there, bound right.
COLUMNS = ("colour", "position", "shape", "extra", "all", "position_if_bound")
HEADERS = ("colour", "position", "shape", "extra objects", "all", "position if bound")


def accuracy(verdicts: list[Verdict]) -> dict[str, float | None]:
    """Fraction right per attribute and for all at once; `extra`: the fraction of images with more
    objects than named; `bound`: with every named object there in its own colour and shape;
    `position_if_bound`: position over those (None when there are none)."""
    n = max(len(verdicts), 1)
    out: dict[str, float | None] = {
        k: sum(getattr(v, k) for v in verdicts) / n for k in (*ATTRIBUTES, "extra", "bound")
    }
    bound = [v for v in verdicts if v.bound]
    out["position_if_bound"] = sum(v.position for v in bound) / len(bound) if bound else None
    return out


def accuracy_cells(acc: dict) -> list[str]:
    """The COLUMNS of one judged row, as percentages ("-" where there is nothing to divide by)."""
    return ["-" if acc.get(k) is None else f"{100 * acc[k]:.1f} %" for k in COLUMNS]


def accuracy_intervals(
    verdicts: list[Verdict], samples: int = 2000, seed: int = 0, level: float = 0.95
) -> dict[str, list[float]]:
    """Percentile bootstrap intervals of `accuracy` over the images (prompts) drawn with replacement."""
    table = np.array([[getattr(v, k) for k in (*ATTRIBUTES, "extra", "bound")] for v in verdicts], dtype=float)
    position = np.array([v.position for v in verdicts], dtype=float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(verdicts), (samples, len(verdicts)))
    means = table[draws].mean(1)  # (samples, columns)
    bound = table[draws][..., -1]
    with np.errstate(invalid="ignore"):
        if_bound = (position[draws] * bound).sum(1) / bound.sum(1)  # NaN for a draw with nothing bound
    tail = 100 * (1 - level) / 2
    out = {
        k: [float(np.percentile(means[:, i], tail)), float(np.percentile(means[:, i], 100 - tail))]
        for i, k in enumerate((*ATTRIBUTES, "extra", "bound"))
    }
    finite = if_bound[np.isfinite(if_bound)]
    if len(finite):
        out["position_if_bound"] = [float(np.percentile(finite, tail)), float(np.percentile(finite, 100 - tail))]
    return out
