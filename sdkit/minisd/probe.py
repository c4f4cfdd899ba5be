"""Is binding in the text? Linear probes of the token states a mini SD's U-Net reads.

For every pair caption the generator writes ("a red circle to the left of a blue square"), each
object's colour word and shape word are probed, with a linear classifier trained on some object
pairs and tested on others (no pair of objects in both), for

    colour:  the object's own colour (from its shape word, this is binding: "circle" knowing it is red)
    left:    whether the object is the left one (the relation word and the word order, composed)

and, from the whole caption rather than one word,

    layout:  which object is on the left and which on the right (both colours and both shapes), read
             by one cross-attention layer whose two queries are learnt constants, one per side: the
             U-Net's cross-attention with queries that know only where they are

Controls in the same table: chance (the commonest class of the test set), and the same probe on
the encoder's context-free input embeddings (the word's own embedding: no context, no position).
If the contextual states carry an answer the control does not, the text encoder hands it to the
U-Net; whatever the U-Net then draws wrong is lost on the U-Net's side.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..common import format_table
from ..encoders import TextEncoder, token_roles
from .data import COLOURS, RELATIONS, SHAPES, pair_scene

TARGETS = ("colour", "left")
WORDS = ("colour", "shape")
FEATURES = ("contextual", "input embedding")


@dataclass
class ProbeExamples:
    """One row per (caption, object, word kind): its features and labels, and the object pair."""

    contextual: torch.Tensor  # (rows, width): the word's state as the U-Net reads it (mean over pieces)
    embedding: torch.Tensor  # (rows, width): the word's context-free input embedding (mean over pieces)
    word: list[str]  # "colour" or "shape": which word of the object
    colour: torch.Tensor  # (rows,) the object's colour, an index into COLOURS
    left: torch.Tensor  # (rows,) 1 if the object is the left one
    pair: list[frozenset]  # the unordered pair of objects of the caption


def pair_captions() -> list:
    """Every pair scene the generator can caption: ordered objects x relation x template."""
    objects = [(c, s) for c in COLOURS for s in SHAPES]
    return [
        pair_scene(first, relation, second, template=t)
        for first in objects
        for second in objects
        if first != second
        for relation in RELATIONS
        for t in range(4)
    ]


def probe_examples(encoder: TextEncoder, scenes, batch_size: int = 256) -> ProbeExamples:
    from ..localization import object_words

    contextual, embedding, word, colour, left, pair = [], [], [], [], [], []
    table = encoder.model.get_input_embeddings().weight.detach().float()
    names = list(COLOURS)
    for start in range(0, len(scenes), batch_size):
        batch = scenes[start : start + batch_size]
        captions = [s.caption for s in batch]
        states = encoder.encode(captions).float()
        ids = encoder.tokenize(captions)["input_ids"]
        for b, scene in enumerate(batch):
            roles = token_roles(encoder.tokenizer, scene.caption, encoder.max_length)
            for found in object_words(roles, scene.objects):
                positions = found["positions"]
                obj = scene.objects[found["object"]]
                contextual.append(states[b, positions].mean(0))
                embedding.append(table[ids[b, positions]].mean(0))
                word.append(found["kind"])
                colour.append(names.index(obj.colour))
                is_first = found["object"] == 0
                left.append(int(is_first == (scene.relation == "left of")))
                pair.append(frozenset((o.colour, o.shape) for o in scene.objects))
    return ProbeExamples(
        torch.stack(contextual), torch.stack(embedding), word, torch.tensor(colour), torch.tensor(left), pair
    )


def fit_probe(x: torch.Tensor, y: torch.Tensor, classes: int, weight_decay: float = 1e-2, steps: int = 200) -> tuple:
    """A multinomial logistic regression on standardised features (L-BFGS, L2 on the weights)."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    weights = torch.zeros(x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weights + bias, y) + weight_decay * weights.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return mean, std, weights.detach(), bias.detach()


def probe_accuracy(model: tuple, x: torch.Tensor, y: torch.Tensor) -> float:
    mean, std, weights, bias = model
    return float((((x - mean) / std) @ weights + bias).argmax(1).eq(y).float().mean())


@dataclass
class ProbeReport:
    encoder: str
    layer: str
    train_pairs: int
    test_pairs: int
    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def run_probe(encoder: TextEncoder, test_fraction: float = 0.3, seed: int = 0, layout_steps: int = 1500) -> ProbeReport:
    """Every probe of the module docstring, trained and tested on disjoint object pairs (the layout
    reader trained for `layout_steps` Adam steps)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    scenes = pair_captions()
    data = probe_examples(encoder, scenes)
    pairs = sorted(set(data.pair), key=lambda p: sorted(p))
    random.Random(seed).shuffle(pairs)
    test_pairs = set(pairs[: round(len(pairs) * test_fraction)])
    report = ProbeReport(encoder.source, encoder.layer, len(pairs) - len(test_pairs), len(test_pairs))
    for word in WORDS:
        rows = torch.tensor([w == word for w in data.word])
        test = rows & torch.tensor([p in test_pairs for p in data.pair])
        train = rows & ~test
        for target in TARGETS:
            y = data.colour if target == "colour" else data.left
            classes = len(COLOURS) if target == "colour" else 2
            entry = {
                "word": word,
                "target": target,
                "train": int(train.sum()),
                "test": int(test.sum()),
                "chance": float(y[test].bincount(minlength=classes).max() / test.sum()),
            }
            for name, x in (("contextual", data.contextual), ("input embedding", data.embedding)):
                model = fit_probe(x[train], y[train], classes)
                entry[name] = probe_accuracy(model, x[test], y[test])
                entry[f"{name} (train)"] = probe_accuracy(model, x[train], y[train])
            report.rows.append(entry)
    report.rows.append(layout_probe(encoder, scenes, test_pairs, steps=layout_steps))
    report.seconds = time.perf_counter() - start
    return report


class LayoutReader(torch.nn.Module):
    """One cross-attention layer (no biases on keys and values, as in SD) from two learnt queries,
    one for the left object and one for the right, then a linear read of each one's colour and shape."""

    def __init__(self, width: int, inner: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.queries = torch.nn.Parameter(0.02 * torch.randn(2, inner))
        self.to_k = torch.nn.Linear(width, inner, bias=False)
        self.to_v = torch.nn.Linear(width, inner, bias=False)
        self.read = torch.nn.Linear(inner, len(COLOURS) + len(SHAPES))

    def forward(self, states: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(captions, 2 sides, colours + shapes) logits from (captions, tokens, width) states."""
        n, tokens, _ = states.shape
        keys = self.to_k(states).view(n, tokens, self.heads, -1)
        values = self.to_v(states).view(n, tokens, self.heads, -1)
        queries = self.queries.view(2, self.heads, -1)
        scores = torch.einsum("qhd,nthd->nhqt", queries, keys) / keys.shape[-1] ** 0.5
        weights = scores.masked_fill(~real[:, None, None, :], float("-inf")).softmax(-1)
        return self.read(torch.einsum("nhqt,nthd->nqhd", weights, values).reshape(n, 2, -1))


def layout_labels(scenes) -> torch.Tensor:
    """(captions, 4): the left object's colour and the right one's, then their shapes (indices)."""
    labels = []
    for scene in scenes:
        a, b = scene.objects
        left, right = (a, b) if scene.relation == "left of" else (b, a)
        labels.append(
            [
                list(COLOURS).index(left.colour),
                list(COLOURS).index(right.colour),
                SHAPES.index(left.shape),
                SHAPES.index(right.shape),
            ]
        )
    return torch.tensor(labels)


def layout_accuracy(reader: LayoutReader, states: torch.Tensor, real: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of captions whose two sides are both read right (colour and shape)."""
    with torch.no_grad():
        logits = reader(states, real)
    colours, shapes = logits[..., : len(COLOURS)].argmax(-1), logits[..., len(COLOURS) :].argmax(-1)
    return float((torch.cat([colours, shapes], 1) == labels).all(1).float().mean())


def fit_layout_reader(
    states: torch.Tensor,
    real: torch.Tensor,
    labels: torch.Tensor,
    steps: int = 1500,
    batch_size: int = 64,
    seed: int = 0,
) -> LayoutReader:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    reader = LayoutReader(states.shape[-1])
    optimizer = torch.optim.Adam(reader.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = torch.randint(0, len(states), (batch_size,), generator=generator)
        logits, y = reader(states[rows], real[rows]), labels[rows]
        loss = F.cross_entropy(
            logits[..., : len(COLOURS)].reshape(-1, len(COLOURS)), y[:, :2].reshape(-1)
        ) + F.cross_entropy(logits[..., len(COLOURS) :].reshape(-1, len(SHAPES)), y[:, 2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return reader


def layout_probe(encoder: TextEncoder, scenes, test_pairs: set, batch_size: int = 256, steps: int = 1500) -> dict:
    """The layout probe's row: trained on the captions of some object pairs, tested on the others'."""
    table = encoder.model.get_input_embeddings().weight.detach().float()
    captions = [s.caption for s in scenes]
    real = torch.cat([encoder.real_mask(captions[i : i + batch_size]) for i in range(0, len(captions), batch_size)])
    contextual = torch.cat(
        [encoder.encode(captions[i : i + batch_size]).float() for i in range(0, len(captions), batch_size)]
    )
    ids = encoder.tokenize(captions)["input_ids"]
    embedding = table[ids] * real[..., None]
    labels = layout_labels(scenes)
    test = torch.tensor([frozenset((o.colour, o.shape) for o in s.objects) in test_pairs for s in scenes])
    combos = labels[test].unique(dim=0, return_counts=True)[1]
    entry = {
        "word": "caption",
        "target": "layout",
        "train": int((~test).sum()),
        "test": int(test.sum()),
        "chance": float(combos.max() / test.sum()),
    }
    for name, x in (("contextual", contextual), ("input embedding", embedding)):
        reader = fit_layout_reader(x[~test], real[~test], labels[~test], steps=steps)
        entry[name] = layout_accuracy(reader, x[test], real[test], labels[test])
        entry[f"{name} (train)"] = layout_accuracy(reader, x[~test], real[~test], labels[~test])
    return entry


QUESTIONS = {
    ("colour", "colour"): "its own colour, from the colour word (the word itself)",
    ("shape", "colour"): "its own colour, from the shape word (binding)",
    ("colour", "left"): "whether it is the left one, from the colour word (the relation)",
    ("shape", "left"): "whether it is the left one, from the shape word (the relation)",
    ("caption", "layout"): "which object is left and which right, from the caption, by one "
    "cross-attention from two place queries (the layout)",
}


def format_probe(reports: list[ProbeReport]) -> str:
    rows = []
    for r in reports:
        for e in r.rows:
            rows.append(
                [
                    r.encoder.rstrip("/").split("/")[-1],
                    r.layer,
                    QUESTIONS[(e["word"], e["target"])],
                    f"{100 * e['contextual']:.1f} %",
                    f"{100 * e['input embedding']:.1f} %",
                    f"{100 * e['chance']:.1f} %",
                    e["test"],
                ]
            )
    first = reports[0]
    title = (
        f"Linear probes of the token states for pair captions: read off one object's word, tested on "
        f"{first.test_pairs} object pairs\nnever seen in training ({first.train_pairs} pairs train)"
    )
    return format_table(
        ["encoder", "layer", "what the probe reads", "states", "input embedding", "chance", "n"], rows, title=title
    )
