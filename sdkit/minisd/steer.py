"""Steering the mini SD: a guide from each caption it was trained on (which words name which object,
and where the caption puts it), for sdkit.steering.

    excite  each object's shape word (its noun)
    bind    each colour word onto its own shape word, away from the other object's
    layout  each object's words into its part of the image: a pair's left and right halves, as its
            relation says; a single object's grid cell
"""

from __future__ import annotations

import torch

from ..common import SdkitError
from ..encoders import TextEncoder, token_roles
from ..localization import object_words
from ..steering import Guide
from .data import Scene, parse_caption


def region(scene: Scene, index: int, side: int) -> torch.Tensor:
    """(side, side) in {0, 1}: where object `index` of the scene belongs."""
    mask = torch.zeros(side, side)
    obj = scene.objects[index]
    if len(scene.objects) == 1:
        rows, columns = (
            slice(obj.row * side // 3, (obj.row + 1) * side // 3),
            slice(obj.column * side // 3, (obj.column + 1) * side // 3),
        )
        mask[rows, columns] = 1
        return mask
    is_left = (index == 0) == (scene.relation == "left of")
    mask[:, : side // 2] = float(is_left)
    mask[:, side // 2 :] = float(not is_left)
    return mask


def caption_guide(encoder: TextEncoder, scene: Scene, side: int) -> Guide:
    roles = token_roles(encoder.tokenizer, scene.caption, encoder.max_length)
    words = object_words(roles, scene.objects)
    colour = {w["object"]: w["positions"] for w in words if w["kind"] == "colour"}
    shape = {w["object"]: w["positions"] for w in words if w["kind"] == "shape"}
    objects = range(len(scene.objects))
    last = max(i for i, role in enumerate(roles.roles) if role == "word")
    return Guide(
        excite=[shape[k] for k in objects],
        bind=[(colour[k], shape[k], [shape[j] for j in objects if j != k]) for k in objects],
        layout=[(colour[k] + shape[k], region(scene, k, side)) for k in objects],
        text=slice(1, last + 1),
    )


def caption_guides(encoder: TextEncoder, captions: list[str], side: int) -> list[Guide]:
    """A guide per caption; every caption must be one the generator writes (it is the answer key)."""
    guides = []
    for caption in captions:
        scene = parse_caption(caption)
        if scene is None:
            raise SdkitError(
                f"steering the mini SD needs captions its generator writes (e.g. 'a red circle to the "
                f"left of a blue square'), not {caption!r}"
            )
        guides.append(caption_guide(encoder, scene, side))
    return guides
