"""Prompt-to-Prompt editing (Hertz et al. 2022) on any diffusers Stable Diffusion pipeline, through
its attention-processor API: the source prompt and the edited prompt are sampled in one batch from
the same noise, and during the first part of sampling the edited branch reads the source's
cross-attention maps, so what the maps placed stays where it was.

    images = edit_sd(pipe, "a red circle at the top left", "a blue circle at the top left",
                     EditSettings(cross_replace=0.8), num_inference_steps=25, seed=0)
    # images[0]: the source; images[1]: the edit

The tokens of the two prompts are aligned (sdkit.editing.align): a swapped word takes the map of the
word it replaces (word swap), words added by the edit keep their own maps (refinement), and the
common words take the source's. `reweight` scales a word's attention in the edited branch (P2P's
equaliser; 1 changes nothing), and `self_replace` injects the source's self-attention at the coarse
levels for the first part of sampling. Only the conditional half of classifier-free guidance is
edited, as P2P does; a layer or step with nothing to edit runs its own processor, to the bit.

`local_blend` is P2P's local blending: a mask from the cross-attention of the words the edit
changed, and the edited branch is the source outside it. P2P blends the latents after each
scheduler step; here the U-Net's prediction is blended (a forward hook), which any pipeline's loop
then steps as it steps its own: for a fixed mask the two are the same, since a DDIM (or DPM)
step is linear in the sample and the prediction and both branches start from the same noise.
`share_latents` (not in P2P) uses the same hook with an empty mask: for the first part of sampling
the edited branch is the source, and it goes on from the source's x_t, as SDEdit goes on from a
noised image.

A real image is edited by null-text inversion (Mokady et al. 2022): `invert_sd` inverts it by DDIM
at guidance 1, then, step by step, tunes the unconditional (empty prompt's) states so that the
guided sampling retraces that trajectory; `edit_sd(..., inversion=...)` then starts from the
inverted noise and reads those states at each step, so the source branch redraws the image.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import torch

from .common import SdkitError


@dataclass
class EditSettings:
    """What Prompt-to-Prompt injects, and for how long (fractions of the denoising steps)."""

    cross_replace: float = 0.8  # the first this fraction of steps read the source's cross-attention
    self_replace: float = 0.0  # ... and the source's self-attention, at layers of at most self_max_cells
    self_max_cells: int = 256  # P2P's 16x16 on SD's 64x64 latent: the coarse levels only
    reweight: dict[str, float] = field(default_factory=dict)  # word of the edited prompt -> factor
    # P2P's local blending: the edited branch changes only where the words the edit changed (and
    # the reweighted ones) attend, their maps summed over layers and steps so far, each at most
    # blend_threshold of its peak left out; everywhere else it is the source, to the bit
    local_blend: bool = False
    blend_threshold: float = 0.3
    # The edited prompt's unchanged tokens read the source's token states (keys and values), at every
    # step. CLIP, SD's encoder, is causal: a swapped word changes its own state and those after it.
    # A bidirectional encoder (the mini SD's MiniLM) changes every token's, so the unchanged words'
    # values, which P2P's injected maps then mix, are no longer the source's. Not in P2P; off by default.
    source_states: bool = False
    # With classifier-free guidance, the unconditional half is edited too: for the same fractions of
    # steps, the edited branch's unconditional pass reads the source's unconditional weights (cross-
    # and self-attention; both read the empty prompt, so no alignment or reweighting there). P2P edits
    # the conditional half only, and the two unconditional passes part as the two latents part: a
    # difference the guided prediction takes with weight 1 - scale (-3 at the pixel mini SD's 4).
    # Not in P2P; off by default.
    unconditional: bool = False
    # The edited branch is the source for the first this fraction of steps: its prediction, so its
    # latents, are the source's, and it goes on from the source's x_t, where the first steps have laid
    # the objects out (as SDEdit starts from a noised image). Not in P2P; off by default.
    share_latents: float = 0.0

    def check(self) -> None:
        for name in ("cross_replace", "self_replace", "share_latents", "blend_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                what = "of the words' peak attention" if name == "blend_threshold" else "of the steps"
                raise SdkitError(f"{name} is a fraction {what}, 0 to 1, not {value!r}")
        for word, factor in self.reweight.items():
            if not (isinstance(factor, (int, float)) and 0 <= factor < float("inf")):
                raise SdkitError(f"the reweight of {word!r} must be a finite factor of 0 or more, not {factor!r}")

    def title(self) -> str:
        """What was injected and for how long, in a few words (for pictures and tables)."""
        parts = [f"source cross-attention for the first {self.cross_replace:.0%} of steps"]
        if self.share_latents:
            parts.insert(0, f"the source's latents for the first {self.share_latents:.0%} of steps")
        if self.self_replace:
            parts.append(f"self-attention for the first {self.self_replace:.0%}")
        parts += [f"{word} x{factor:g}" for word, factor in self.reweight.items()]
        if self.local_blend:
            parts.append(f"blended where the changed words attend (> {self.blend_threshold:g} of peak)")
        if self.source_states:
            parts.append("unchanged words' states from the source")
        if self.unconditional:
            parts.append("the unconditional half's too")
        return ", ".join(parts)


def align(source_ids: list[int], edited_ids: list[int]) -> list[int]:
    """For each token position of the edited prompt, the source position whose map it reads, or -1
    for a token the edit added (it keeps its own map). Equal runs map to each other; a run replaced
    by one of the same length maps position by position (word swap: the new word takes the old
    word's map); anything else is new (refinement)."""
    mapper = [-1] * len(edited_ids)
    matcher = difflib.SequenceMatcher(a=source_ids, b=edited_ids, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and a1 - a0 == b1 - b0):
            for offset in range(b1 - b0):
                mapper[b0 + offset] = a0 + offset
    return mapper


class EditProcessor:
    """An attention layer's processor during an edit: diffusers' AttnProcessor computation with the
    edited branch's weights replaced where the edit says, or the layer's own processor (to the
    bit) where it has nothing to do."""

    def __init__(self, edit: PromptEdit, name: str, original, cross: bool):
        self.edit, self.name, self.original, self.cross = edit, name, original, cross

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs
    ):
        cells = hidden_states.shape[-2] * hidden_states.shape[-1] if hidden_states.ndim == 4 else hidden_states.shape[1]
        if not self.edit.acts(self.cross, cells):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if not self.edit.cfg:
            return self._edited_attention(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        # Only the conditional half is edited: the unconditional half runs the layer's own
        # (fused) processor, so an edit pays for explicit weights on half the batch.
        half = len(hidden_states) // 2

        def split(tensor):
            same = tensor is not None and tensor.ndim and len(tensor) == len(hidden_states)
            return (tensor[:half], tensor[half:]) if same else (tensor, tensor)

        (h0, h1), (e0, e1), (m0, m1), (t0, t1) = map(
            split, (hidden_states, encoder_hidden_states, attention_mask, temb)
        )
        # injected where the conditional half is (past cross_replace a cross-attention layer is here only
        # for local blending, which reads the conditional half's maps)
        if self.edit.settings.unconditional and (not self.cross or self.edit.step < self.edit.cross_steps):
            unconditional = self._edited_attention(attn, h0, e0, m0, t0, conditional=False)
        else:
            unconditional = self.original(attn, h0, e0, m0, t0, *args, **kwargs)
        return torch.cat([unconditional, self._edited_attention(attn, h1, e1, m1, t1)])

    def _edited_attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb, conditional=True):
        """diffusers' AttnProcessor on the (source, edited) branches, their weights edited."""
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.head_to_batch_dim(attn.to_k(encoder_hidden_states))
        value = attn.head_to_batch_dim(attn.to_v(encoder_hidden_states))
        probs = attn.get_attention_scores(attn.head_to_batch_dim(query), key, attention_mask)
        if conditional:
            probs = self.edit.edited(self.name, probs, attn.heads, self.cross)
        else:
            probs = self.edit.unconditional_edited(probs, attn.heads)
        hidden_states = attn.batch_to_head_dim(torch.bmm(probs, value))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class PromptEdit:
    """Context manager: Prompt-to-Prompt on a U-Net called with the batch (source 1, edited 1,
    source 2, edited 2, ...), or with classifier-free guidance that batch unconditional, then
    conditional (as diffusers' pipelines and the mini SD's stack them).

    source_ids, edited_ids: each pair's token ids as the U-Net reads them (one list for one pair,
    or a list of lists); reweight: word -> (its token positions in the edited prompt, factor), or
    one such dict per pair; steps: the denoising steps of the call. With `record`, every edited
    layer's conditional weights of both branches are kept in `recorded[(layer, step)]` as
    (source, edited), each (pairs, heads, cells, tokens), the pair axis dropped for one pair.
    With settings.local_blend, `blended` holds, per pair, the cells (at the U-Net's input grid) that
    any step's mask let the edited branch change: (pairs, height, width), booleans.
    """

    def __init__(
        self, unet, source_ids, edited_ids, settings: EditSettings, steps: int, reweight=None, record: bool = False
    ):
        settings.check()
        one = bool(source_ids) and isinstance(source_ids[0], int)
        sources, edits = ([source_ids], [edited_ids]) if one else (list(source_ids), list(edited_ids))
        reweights = [reweight or {}] if one or reweight is None or isinstance(reweight, dict) else list(reweight)
        reweights = reweights * len(sources) if len(reweights) == 1 else reweights
        if not sources or len(sources) != len(edits) or len(reweights) != len(sources):
            raise SdkitError(
                f"{len(sources)} source prompts need as many edited prompts (and reweights), not {len(edits)}"
            )
        lengths = {len(ids) for ids in (*sources, *edits)}
        if len(lengths) != 1:
            raise SdkitError(f"the prompts are read at {sorted(lengths)} tokens; one length for all")
        self.unet, self.settings, self.steps, self.one = unet, settings, steps, one
        self.pairs = len(sources)
        self.mapper = torch.tensor([align(a, b) for a, b in zip(sources, edits)])  # (pairs, tokens)
        # tokens the edit left as they were: aligned to a source token of the same id
        self.unchanged = torch.tensor(
            [
                [m >= 0 and a[m] == t for m, t in zip(mapper, b)]
                for mapper, a, b in zip(self.mapper.tolist(), sources, edits)
            ]
        )
        self.equalizer = torch.ones(self.mapper.shape)
        for pair, words in enumerate(reweights):
            for positions, factor in words.values():
                self.equalizer[pair, positions] = factor
        self.cross_steps = round(settings.cross_replace * steps)
        self.self_steps = round(settings.self_replace * steps)
        self.shared_steps = round(settings.share_latents * steps)
        self.step, self.cfg, self.grid = -1, False, (0, 0)
        self.recorded: dict | None = {} if record else None
        self._original = None
        self._hooks: list = []
        if settings.local_blend:
            # the tokens whose maps mark the region: those the edit swapped, added or dropped, and
            # the reweighted ones; (pairs, tokens) weights for the source and the edited prompt
            self.blend_words = torch.zeros(2, *self.mapper.shape)
            for pair, (a, b) in enumerate(zip(sources, edits)):
                for position, origin in enumerate(self.mapper[pair].tolist()):
                    if origin < 0 or a[origin] != b[position]:
                        self.blend_words[1, pair, position] = 1
                kept = set(self.mapper[pair].tolist())
                for position in range(len(a)):
                    if position not in kept or self.blend_words[1, pair, self.mapper[pair] == position].any():
                        self.blend_words[0, pair, position] = 1
                for positions, _ in reweights[pair].values():
                    self.blend_words[1, pair, positions] = 1
            if not self.blend_words.any(0).any(-1).all():  # each pair needs a word in one prompt or the other
                raise SdkitError(
                    "local blending needs words that changed: a pair's prompts are the same and no word is "
                    "reweighted, so there is nothing to blend on"
                )
            self.blend_maps: torch.Tensor | None = None  # (pairs, 2 prompts, height, width), summed
            self.blended: torch.Tensor | None = None

    def __enter__(self) -> PromptEdit:
        self._original = self.unet.attn_processors
        replaced = {
            name: EditProcessor(self, name.removesuffix(".processor"), processor, name.endswith("attn2.processor"))
            for name, processor in self._original.items()
        }
        self.unet.set_attn_processor(replaced)
        self._hooks = [self.unet.register_forward_pre_hook(self._count, with_kwargs=True)]
        if self.settings.local_blend or self.shared_steps:
            self._hooks.append(self.unet.register_forward_hook(self._blend))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self.unet.set_attn_processor(dict(self._original))
        self._original = None

    def _count(self, module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        if len(sample) not in (2 * self.pairs, 4 * self.pairs):
            raise SdkitError(
                f"an edit of {self.pairs} pair(s) runs the batch (source, edited) per pair, with or without "
                f"guidance; the U-Net got {len(sample)}"
            )
        self.cfg = len(sample) == 4 * self.pairs
        self.grid = tuple(sample.shape[-2:])
        self.step += 1
        if not self.settings.source_states:
            return None
        if "encoder_hidden_states" in kwargs:
            return args, {**kwargs, "encoder_hidden_states": self._source_states(kwargs["encoder_hidden_states"])}
        return (*args[:2], self._source_states(args[2]), *args[3:]), kwargs

    def _source_states(self, states: torch.Tensor) -> torch.Tensor:
        """The conditional edited prompts' unchanged tokens given the source's states."""
        states = states.clone()
        first = 2 * self.pairs if self.cfg else 0
        sources = torch.arange(first, first + 2 * self.pairs, 2, device=states.device)
        mapper = self.mapper.to(states.device).clamp_min(0)[..., None].expand(-1, -1, states.shape[-1])
        from_source = torch.gather(states[sources], 1, mapper)
        unchanged = self.unchanged.to(states.device)[..., None]
        states[sources + 1] = torch.where(unchanged, from_source, states[sources + 1])
        return states

    def acts(self, cross: bool, cells: int) -> bool:
        """Whether this call of a layer has anything to edit (or, blending, any map to read)."""
        if cross:
            return self.step < self.cross_steps or self.settings.local_blend
        return self.step < self.self_steps and cells <= self.settings.self_max_cells

    def _gather_blend_maps(self, source: torch.Tensor, edited: torch.Tensor) -> None:
        """Add this layer's maps of the blend words (conditional weights, (pairs, heads, cells,
        tokens)) to the running sum, dilated by one cell at the layer's grid (as P2P does) and brought
        to the input grid."""
        import torch.nn.functional as F

        from .geometry import halved

        cells = source.shape[2]
        depth = next((d for d in range(16) if math.prod(halved(*self.grid, d)) == cells), None)
        if depth is None:
            return  # not a grid of this U-Net's input (no such layer in a U-Net that diffusers builds)
        words = self.blend_words.to(source.device, source.dtype)
        maps = torch.stack(
            [torch.einsum("phct,pt->pc", probs, w) / probs.shape[1] for probs, w in zip((source, edited), words)], 1
        ).float()
        maps = maps.view(*maps.shape[:2], *halved(*self.grid, depth))
        maps = F.max_pool2d(maps, 3, stride=1, padding=1)
        maps = F.interpolate(maps, size=self.grid, mode="nearest").cpu()
        self.blend_maps = maps if self.blend_maps is None else self.blend_maps + maps

    def _blend(self, module, args, output):
        """The edited branches' prediction is the source's (both guidance halves): everywhere during
        the shared steps, outside the mask when blending."""
        if self.step < self.shared_steps:
            mask = torch.zeros(self.pairs, *self.grid, dtype=torch.bool)
        elif self.settings.local_blend and self.blend_maps is not None:
            peak = self.blend_maps.amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            mask = (self.blend_maps / peak > self.settings.blend_threshold).any(1)  # (pairs, height, width)
            self.blended = mask if self.blended is None else self.blended | mask
        else:
            return output
        sample = output[0]
        mask = mask[:, None].to(sample.device)
        for first in (0, 2 * self.pairs) if self.cfg else (0,):
            sources = torch.arange(first, first + 2 * self.pairs, 2, device=sample.device)
            sample[sources + 1] = torch.where(mask, sample[sources + 1], sample[sources])
        return output

    def unconditional_edited(self, probs: torch.Tensor, heads: int) -> torch.Tensor:
        """The unconditional weights (batch * heads, cells, tokens or cells), the edited branches'
        the source's (settings.unconditional)."""
        probs = probs.view(probs.shape[0] // heads, heads, *probs.shape[1:])
        sources = torch.arange(0, 2 * self.pairs, 2, device=probs.device)
        probs[sources + 1] = probs[sources]
        return probs.view(-1, *probs.shape[2:])

    def edited(self, name: str, probs: torch.Tensor, heads: int, cross: bool) -> torch.Tensor:
        """The conditional weights (batch * heads, cells, tokens), the edited branches' replaced."""
        batch = probs.shape[0] // heads
        probs = probs.view(batch, heads, *probs.shape[1:])  # a fresh tensor of this call: edited in place
        sources = torch.arange(0, 2 * self.pairs, 2, device=probs.device)  # the conditional batch
        edits = sources + 1
        if cross and self.step < self.cross_steps:
            mapper = self.mapper.to(probs.device)  # (pairs, tokens)
            index = mapper.clamp_min(0)[:, None, None, :].expand(-1, heads, probs.shape[2], -1)
            from_source = torch.gather(probs[sources], -1, index)
            new = torch.where((mapper >= 0)[:, None, None, :], from_source, probs[edits])
            probs[edits] = new * self.equalizer.to(probs.device, probs.dtype)[:, None, None, :]
        elif not cross:
            probs[edits] = probs[sources]
        if cross and self.settings.local_blend:
            self._gather_blend_maps(probs[sources], probs[edits])
        if self.recorded is not None:
            pair = (probs[sources].detach().clone(), probs[edits].detach().clone())
            self.recorded[(name, self.step)] = tuple(t[0] for t in pair) if self.one else pair
        return probs.view(batch * heads, *probs.shape[2:])


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids a stock SD pipeline's text encoder reads for `prompt` (padded to the
    tokenizer's length; a longer prompt is refused, not cut)."""
    ids = tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, truncation=False)["input_ids"]
    if len(ids) > tokenizer.model_max_length:
        raise SdkitError(
            f"{prompt[:40]!r}... is {len(ids):,} tokens long; the text encoder reads "
            f"{tokenizer.model_max_length}: shorten it"
        )
    return ids


def word_positions(tokenizer, prompt: str, word: str) -> list[int]:
    """The token positions of `word` (its pieces, every occurrence) in `prompt`."""
    from .encoders import token_roles

    words = token_roles(tokenizer, prompt, tokenizer.model_max_length).words
    wanted = " ".join(word.lower().split())
    positions = [p for w, ps in words if w.lower() == wanted for p in ps]
    if not positions:
        raise SdkitError(f"{word!r} is not a word of {prompt!r}; its words: {', '.join(w for w, _ in words)}")
    return positions


@dataclass
class Inversion:
    """A real image as a pipeline's guided DDIM sampling redraws it (null-text inversion)."""

    prompt: str  # the image's caption: the source prompt of its edits
    latents: torch.Tensor  # (1, channels, height, width): the start, DDIM-inverted at guidance 1
    null_embeds: torch.Tensor  # (steps, tokens, width): the unconditional states each step reads
    num_inference_steps: int
    guidance_scale: float
    errors: list[float]  # per step: mean squared distance of the guided step from the inverted trajectory


def _check_ddim(pipe) -> None:
    from diffusers import DDIMScheduler

    if not isinstance(pipe.scheduler, DDIMScheduler):
        raise SdkitError(
            f"null-text inversion retraces DDIM's steps; the pipeline samples with {type(pipe.scheduler).__name__}: "
            "set pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)"
        )


def invert_sd(
    pipe,
    image,
    prompt: str,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    inner_steps: int = 10,
    lr: float = 1e-2,
    tolerance: float = 1e-5,
    progress=True,
) -> Inversion:
    """Null-text inversion of `image` (PIL, an array in [0, 1] or uint8, or a tensor, as the
    pipeline's image processor takes; resized to the model's size) under `prompt`, for edits at
    these steps and guidance. Each step tunes the empty prompt's states (Adam, at most
    `inner_steps`, stopping below `tolerance`) so that the guided step lands where DDIM inversion
    says it should; the first step starts from the empty prompt's states, each later one from the
    step before. `progress`: a bar of its own (True), none (False), or a caller's tqdm to move on
    by 2 * num_inference_steps."""
    import numpy as np
    import torch.nn.functional as F
    from diffusers import DDIMInverseScheduler
    from tqdm.auto import tqdm

    _check_ddim(pipe)
    if isinstance(image, np.ndarray):  # the image processor reads an array as floats in [0, 1], whatever its type
        if image.dtype == np.uint8:
            image = image.astype(np.float32) / 255
        elif image.size and not 0 <= image.min() <= image.max() <= 1:
            raise SdkitError(
                f"an image array holds pixels in [0, 1] (or uint8), not [{image.min():g}, {image.max():g}]"
            )
    device, dtype = pipe.device, pipe.unet.dtype
    height = width = pipe.unet.config.sample_size * pipe.vae_scale_factor
    pixels = pipe.image_processor.preprocess(image, height=height, width=width).to(device, pipe.vae.dtype)
    if len(pixels) != 1:
        raise SdkitError(f"one image at a time, not {len(pixels)}")
    with torch.no_grad():
        latents = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
        conditional_embeds, null = pipe.encode_prompt(prompt, device, 1, True, "")
    latents = latents.to(dtype)
    scheduler, inverse = pipe.scheduler, DDIMInverseScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(num_inference_steps, device=device)
    inverse.set_timesteps(num_inference_steps, device=device)
    if not torch.equal(inverse.timesteps.flip(0).cpu(), scheduler.timesteps.cpu()):
        raise SdkitError("the scheduler's inverse does not retrace its timesteps; use DDIM with its own spacing")
    own_bar = isinstance(progress, bool)
    bar = (
        tqdm(total=2 * num_inference_steps, desc="null-text inversion", disable=not progress, leave=False)
        if own_bar
        else progress
    )
    trajectory = [latents]  # DDIM inversion at guidance 1: from the image to the noise
    with torch.no_grad():
        for t in inverse.timesteps:
            predicted = pipe.unet(trajectory[-1], t, encoder_hidden_states=conditional_embeds).sample
            trajectory.append(inverse.step(predicted, t, trajectory[-1]).prev_sample)
            bar.update()
    trajectory.reverse()  # trajectory[i]: what sampling step i reads; trajectory[-1]: the image
    current, nulls, errors = trajectory[0], [], []

    def guided_step(t, unconditional_embeds, conditional):
        unconditional = pipe.unet(current, t, encoder_hidden_states=unconditional_embeds).sample
        guided = unconditional + guidance_scale * (conditional - unconditional)
        return scheduler.step(guided, t, current).prev_sample

    for i, t in enumerate(scheduler.timesteps):
        target = trajectory[i + 1]
        with torch.no_grad():
            conditional = pipe.unet(current, t, encoder_hidden_states=conditional_embeds).sample
        null = null.detach().to(torch.float32, copy=True).requires_grad_(True)  # float32 whatever the U-Net's dtype
        optimizer = torch.optim.Adam([null], lr=lr)
        for _ in range(inner_steps if guidance_scale > 1 else 0):  # unguided, the states are not read
            loss = F.mse_loss(guided_step(t, null.to(dtype), conditional).float(), target.float())
            if loss.item() < tolerance:
                break
            # the states' gradient only: the U-Net's weights get none (nor the memory they would take)
            (null.grad,) = torch.autograd.grad(loss, [null])
            optimizer.step()
        null = null.detach()
        with torch.no_grad():
            current = guided_step(t, null.to(dtype), conditional)
        nulls.append(null[0])
        errors.append(F.mse_loss(current.float(), target.float()).item())
        bar.update()
    if own_bar:
        bar.close()
    return Inversion(prompt, trajectory[0], torch.stack(nulls), num_inference_steps, guidance_scale, errors)


def edit_sd(
    pipe,
    source: str,
    edited: str | None,
    settings: EditSettings | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    seed: int = 0,
    output_type: str = "pil",
    inversion: Inversion | None = None,
    tuned_states_for: str = "source",
):
    """Prompt-to-Prompt on a stock diffusers StableDiffusionPipeline: the source and the edited
    prompt (the source itself when None: a reweight alone) in one batch from the same noise, the
    pipeline's own sampling loop. Returns the pipeline's images, [source, edited]. With an
    `inversion` (of a real image, by `invert_sd` under the source prompt at these steps and
    guidance), both branches start from its noise, `seed` is not used, and the source branch reads
    its tuned unconditional states: the source is the image redrawn. The edited branch reads the
    empty prompt's, as any sampling does (`tuned_states_for="source"`), or the tuned ones too, as
    the paper does (`"both"`): fitted to redraw the source, colours included, they hold the edited
    branch to the source (on the latent mini SD, colour swaps of single objects 56 % edited and kept
    where the source branch alone reads them: docs/commands/editing.md)."""
    settings = settings or EditSettings()
    edited = source if edited is None else edited
    ids = [prompt_ids(pipe.tokenizer, prompt) for prompt in (source, edited)]
    reweight = {word: (word_positions(pipe.tokenizer, edited, word), f) for word, f in settings.reweight.items()}
    height = width = pipe.unet.config.sample_size * pipe.vae_scale_factor
    shape = (1, pipe.unet.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    inverted = {}
    if inversion is None:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(pipe.device, pipe.unet.dtype)
    else:
        made = (inversion.prompt, inversion.num_inference_steps, inversion.guidance_scale)
        if made != (source, num_inference_steps, guidance_scale):
            raise SdkitError(
                f"the inversion was made for {made[0]!r} at {made[1]} steps and guidance {made[2]:g}; "
                f"edit that prompt at the same, not {source!r} at {num_inference_steps} and {guidance_scale:g}"
            )
        if tuned_states_for not in ("source", "both"):
            raise SdkitError(f"tuned_states_for is 'source' or 'both', not {tuned_states_for!r}")
        _check_ddim(pipe)
        noise = inversion.latents.to(pipe.device, pipe.unet.dtype)
        nulls = inversion.null_embeds.to(pipe.device, pipe.unet.dtype)
        tuned_rows = 2 if tuned_states_for == "both" else 1  # rows: source's, edited's unconditional

        def next_null(_pipe, step, _timestep, tensors):
            if step + 1 == len(nulls):
                return {}
            embeds = tensors["prompt_embeds"].clone()  # (unconditional, conditional) halves
            embeds[:tuned_rows] = nulls[step + 1]
            return {"prompt_embeds": embeds}

        if guidance_scale > 1:  # without guidance there is no unconditional half to feed
            _, empty = pipe.encode_prompt("", pipe.device, 1, True, "")
            inverted = {
                "negative_prompt_embeds": torch.cat([nulls[:1], nulls[:1] if tuned_rows == 2 else empty.to(nulls)]),
                "callback_on_step_end": next_null,
                "callback_on_step_end_tensor_inputs": ["prompt_embeds"],
            }
    with PromptEdit(pipe.unet, *ids, settings, num_inference_steps, reweight):
        out = pipe(
            [source, edited],
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            latents=noise.expand(2, *shape[1:]).clone(),
            output_type=output_type,
            **inverted,
        )
    return out.images
