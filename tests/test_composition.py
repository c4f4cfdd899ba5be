"""Composition: the text probe, and (below) where the U-Net loses binding and how steering restores it."""

import numpy as np
import pytest
import torch

from sdkit.minisd.data import COLOURS, RELATIONS, SHAPES
from sdkit.minisd.pipeline import MiniSDPipeline
from sdkit.minisd.probe import fit_probe, pair_captions, probe_accuracy, run_probe


def test_pair_captions_are_every_pair_the_generator_writes():
    scenes = pair_captions()
    objects = len(COLOURS) * len(SHAPES)
    assert len(scenes) == objects * (objects - 1) * len(RELATIONS) * 4
    assert len({s.caption for s in scenes}) == len(scenes)


def test_probe_reads_what_is_there_and_only_that(bert):
    report = run_probe(bert, layout_steps=300)  # the layout rows' bounds hold however long the reader trains
    rows = {(r["word"], r["target"]): r for r in report.rows}
    assert report.train_pairs + report.test_pairs == 153 and report.test_pairs == 46
    # The word itself names its colour: its embedding alone gives it, on pairs never trained on.
    assert rows[("colour", "colour")]["input embedding"] == 1.0
    # A context-free embedding cannot know which object is left: exactly the class balance.
    assert rows[("colour", "left")]["input embedding"] == rows[("colour", "left")]["chance"] == 0.5
    assert rows[("shape", "left")]["input embedding"] == 0.5
    # Nor can a shape word's own embedding know the colour bound to it.
    assert rows[("shape", "colour")]["input embedding"] <= rows[("shape", "colour")]["chance"] + 0.05
    assert all(r["test"] == 1472 and r["train"] == 3424 for r in report.rows if r["word"] != "caption")
    # The layout, one row per caption: input embeddings hold the words but not their order, so they
    # cannot say which object is left (at most half), let alone bind each colour to its shape.
    layout = rows[("caption", "layout")]
    assert (layout["train"], layout["test"]) == (1712, 736) and layout["chance"] < 0.02
    assert layout["input embedding"] < 0.5


def test_layout_reader_reads_each_side_from_where_it_is_written():
    from sdkit.minisd.probe import fit_layout_reader, layout_accuracy

    # tokens 0 and 1 hold the left object's colour and shape one-hot and a "left" mark, tokens 2 and 3
    # the right's with a "right" mark: each query must find its own side's tokens to read them
    generator = torch.Generator().manual_seed(0)
    labels = torch.stack(
        [
            torch.randint(0, 6, (600,), generator=generator),
            torch.randint(0, 6, (600,), generator=generator),
            torch.randint(0, 3, (600,), generator=generator),
            torch.randint(0, 3, (600,), generator=generator),
        ],
        1,
    )
    states = torch.zeros(600, 5, 20)
    for i, (c1, c2, s1, s2) in enumerate(labels.tolist()):
        states[i, 0, c1], states[i, 0, 18] = 1, 1  # a left-side colour token
        states[i, 1, 6 + s1], states[i, 1, 18] = 1, 1
        states[i, 2, 9 + c2], states[i, 2, 19] = 1, 1  # right side: its own colour features
        states[i, 3, 15 + s2], states[i, 3, 19] = 1, 1
    real = torch.tensor([True] * 4 + [False]).expand(600, 5)
    reader = fit_layout_reader(states[:500], real[:500], labels[:500], steps=600)
    assert layout_accuracy(reader, states[500:], real[500:], labels[500:]) > 0.95
    shuffled = labels[500:].roll(1, 0)
    assert layout_accuracy(reader, states[500:], real[500:], shuffled) < 0.1


def test_probe_fits_a_separable_problem():
    torch.manual_seed(0)
    x = torch.randn(400, 5)
    y = (x[:, 0] + 0.5 * x[:, 3] > 0).long()
    model = fit_probe(x[:300], y[:300], 2, weight_decay=1e-4)
    assert probe_accuracy(model, x[300:], y[300:]) >= 0.97


# --- steering ------------------------------------------------------------------------------------------


PROMPT = "a red cat and a blue dog"  # tokens: 1 a, 2 red, 3 cat, 4 and, 5 a, 6 blue, 7 dog


def test_excite_is_diffusers_attend_and_excite(tiny_sd):
    import copy

    from diffusers import StableDiffusionAttendAndExcitePipeline

    from sdkit.steering import Guide, SteeringSettings, steered_sd

    pipe, parts = tiny_sd
    reference = StableDiffusionAttendAndExcitePipeline(**{**parts, "unet": copy.deepcopy(parts["unet"])})
    reference.set_progress_bar_config(disable=True)
    thresholds = {0: 0.05, 2: 0.8}  # refinement at two of the steps, as A&E does at 0, 10 and 20 of 50
    theirs = reference(
        PROMPT,
        token_indices=[3, 7],
        num_inference_steps=4,
        guidance_scale=7.5,
        max_iter_to_alter=3,
        thresholds=thresholds,
        scale_factor=20,
        attn_res=(16, 16),
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images
    settings = SteeringSettings(("excite",), scale=20, steps=3, resolution=16, thresholds=thresholds)
    ours = steered_sd(
        pipe,
        PROMPT,
        Guide(excite=[[3], [7]]),
        settings,
        num_inference_steps=4,
        guidance_scale=7.5,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    plain = steered_sd(
        pipe,
        PROMPT,
        Guide(),
        settings,
        num_inference_steps=4,
        guidance_scale=7.5,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    assert float((ours - plain).norm() / plain.norm()) > 1e-3  # steering moved the sample
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("objective", ["excite", "bind", "layout"])
def test_each_objective_falls_under_its_own_guidance(tiny_sd, objective):
    from sdkit.steering import Guide, Steerer, SteeringSettings
    from sdkit.trace import CrossAttentionTrace

    pipe, _ = tiny_sd
    left = torch.zeros(16, 16)
    left[:, :8] = 1
    guide = Guide(
        excite=[[3], [7]], bind=[([2], [3], [[7]]), ([6], [7], [[3]])], layout=[([2, 3], left), ([6, 7], 1 - left)]
    )
    settings = SteeringSettings((objective,), scale=5 if objective == "excite" else 200, steps=1, thresholds={})
    embeds, _ = pipe.encode_prompt(PROMPT, "cpu", 1, False)
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    t = pipe.scheduler.timesteps[0] if len(pipe.scheduler.timesteps) else torch.tensor(999)
    steerer = Steerer(pipe.unet, settings)

    def loss(x):
        with torch.no_grad(), CrossAttentionTrace(pipe.unet, keep_graph=True) as trace:
            return float(steerer._losses(trace, x, t, embeds, guide)[0])

    before = loss(latents)
    after = loss(steerer.step(latents, t, embeds, [guide], 0, 10))
    assert after < before, (before, after)
    assert len(steerer.losses) == 1 and steerer.losses[0][2] == pytest.approx(before, rel=1e-5)


def test_layout_loss_is_the_share_outside_squared():
    from sdkit.steering import layout_loss

    maps = torch.zeros(12, 12, 3)
    maps[0:4, 0:4, 1] = 1.0  # token 1: a blob at the top left
    maps[0:4, 0:4, 2] = 1.0  # token 2: half there, half in a blob at the bottom right
    maps[8:12, 8:12, 2] = 1.0
    left = torch.zeros(12, 12)
    left[:, :6] = 1
    assert float(layout_loss(maps, [([1], left)])) == pytest.approx(0.0, abs=1e-6)
    assert float(layout_loss(maps, [([2], left)])) == pytest.approx(0.25, abs=1e-6)
    assert float(layout_loss(maps, [([2], 1 - left)])) == pytest.approx(0.25, abs=1e-6)


def test_processors_are_restored_after_steering_and_after_an_error(tiny_sd):
    from sdkit.steering import Guide, Steerer, SteeringSettings

    pipe, _ = tiny_sd
    before = dict(pipe.unet.attn_processors)
    embeds, _ = pipe.encode_prompt(PROMPT, "cpu", 1, False)
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    steerer = Steerer(pipe.unet, SteeringSettings(("excite", "bind"), steps=1, thresholds={}))
    steerer.step(latents, torch.tensor(500), embeds, [Guide(excite=[[3]])], 0, 10)
    assert all(pipe.unet.attn_processors[k] is v for k, v in before.items())
    with pytest.raises(IndexError):  # a position past the 77 tokens fails inside the pass
        steerer.step(latents, torch.tensor(500), embeds, [Guide(excite=[[3]], bind=[([500], [3], [])])], 0, 10)
    assert all(pipe.unet.attn_processors[k] is v for k, v in before.items())


def test_steering_refuses_what_cannot_be(tiny_sd):
    from sdkit.common import SdkitError
    from sdkit.steering import Guide, SteeringSettings, check_guides, steered_sd

    pipe, _ = tiny_sd
    with pytest.raises(SdkitError, match="finite"):
        SteeringSettings(scale=float("nan")).check()
    with pytest.raises(SdkitError, match="unknown steering objective 'repel'"):
        SteeringSettings(("repel",)).check()
    with pytest.raises(SdkitError, match="outside its 77 tokens"):
        check_guides([Guide(excite=[[80]])], 77)
    with pytest.raises(SdkitError, match="no cross-attention layer 'mid_block.nothing'"):
        steered_sd(
            pipe,
            PROMPT,
            Guide(excite=[[3]]),
            SteeringSettings(layers=("mid_block.nothing",), steps=1),
            num_inference_steps=2,
            output_type="latent",
        )
    with pytest.raises(SdkitError, match="works at 64x64"):
        steered_sd(
            pipe,
            PROMPT,
            Guide(excite=[[3]]),
            SteeringSettings(resolution=64, steps=1),
            num_inference_steps=2,
            output_type="latent",
        )


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_predicted_clean_inverts_the_noising(prediction_type):
    from diffusers import DDPMScheduler

    from sdkit.minisd.pipeline import SCHEDULER_CONFIG
    from sdkit.minisd.trajectory import predicted_clean

    scheduler = DDPMScheduler.from_config({**SCHEDULER_CONFIG, "prediction_type": prediction_type})
    generator = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 3, 8, 8, generator=generator), torch.randn(2, 3, 8, 8, generator=generator)
    for t in (0, 500, 999):
        timesteps = torch.tensor([t, t])
        sample = scheduler.add_noise(clean, noise, timesteps)
        prediction = noise if prediction_type == "epsilon" else scheduler.get_velocity(clean, noise, timesteps)
        torch.testing.assert_close(predicted_clean(scheduler, sample, prediction, t), clean, rtol=0, atol=2e-4)


def test_order_moment_reads_which_colour_is_left():
    from sdkit.minisd.data import pair_scene, render, to_model
    from sdkit.minisd.trajectory import horizontal_moment, order_moment

    weights = torch.zeros(1, 4, 6)
    weights[0, 2, 5] = 1.0
    assert horizontal_moment(weights).item() == 2.5  # column 5 of 6, about the centre line at 2.5
    image = torch.from_numpy(to_model(render(pair_scene(("red", "circle"), "left of", ("blue", "square")), 32).image))
    images = torch.stack([image, image.flip(-1)])
    moment = order_moment(images, ["red", "red"], ["blue", "blue"])
    assert moment[0] < 0 and moment[1] > 0
    torch.testing.assert_close(moment[1], -moment[0])
    torch.testing.assert_close(order_moment(images, ["blue", "blue"], ["red", "red"]), -moment)


class DenoisingPipe:
    """Stands in for a model in caption_against_noise: its prediction implies the very image under the
    noise (it knows the noise: the measurement's own generator), or the generator's image of the
    caption it is given (the best denoiser of the training images, up to where in its row the pair
    lies)."""

    def __init__(self, reads_caption: bool):
        from diffusers import DDPMScheduler

        from sdkit.minisd.pipeline import SCHEDULER_CONFIG, MiniSDSpec

        self.spec, self.scheduler_config = MiniSDSpec(image_size=32), SCHEDULER_CONFIG
        self.captions: list[str] = []
        self.unet = StandInUNet(
            self.captions, DDPMScheduler.from_config(SCHEDULER_CONFIG).alphas_cumprod, reads_caption
        )

    def encode(self, prompts):  # the states name each prompt by its index
        self.unet.pairs = self.unet.pairs or len(prompts)  # the captions come first
        self.captions += [p for p in prompts if p not in self.captions]
        return torch.tensor([float(self.captions.index(p)) for p in prompts]).view(-1, 1, 1)

    vae = None  # a pixel model: it denoises the images themselves

    guidance = MiniSDPipeline.guidance  # the model's own scale (its spec's) when given none

    def encode_images(self, pixels):
        return pixels

    def model_input(self, sample):
        return sample

    def guided_prediction(self, *args):
        from sdkit.minisd.pipeline import MiniSDPipeline

        return MiniSDPipeline.guided_prediction(self, *args)


class StandInUNet(torch.nn.Module):
    def __init__(self, captions, alphas_cumprod, reads_caption):
        super().__init__()
        self.captions, self.alphas_cumprod, self.reads_caption = captions, alphas_cumprod, reads_caption
        self.pairs = 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the measurement reads device and dtype

    def forward(self, sample, t, encoder_hidden_states):
        from types import SimpleNamespace

        from sdkit.minisd.data import parse_caption, render, to_model

        # the measurement's noise for each of its pairs, in each half of a guided batch
        noise = torch.randn((self.pairs, *sample.shape[1:]), generator=torch.Generator().manual_seed(0))
        noise = noise.repeat(len(sample) // self.pairs, 1, 1, 1)
        if self.reads_caption:
            alpha_bar = self.alphas_cumprod[t].view(-1, 1, 1, 1)
            images = torch.stack(
                [
                    torch.from_numpy(to_model(render(parse_caption(self.captions[int(i)]), 32).image))
                    for i in encoder_hidden_states[:, 0, 0]
                ]
            )
            noise = (sample - alpha_bar.sqrt() * images) / (1 - alpha_bar).sqrt()
        return SimpleNamespace(sample=noise)


def test_caption_against_noise_tells_a_model_that_reads_the_caption_from_one_that_copies_the_noise():
    from sdkit.minisd.evaluate import prompt_set
    from sdkit.minisd.trajectory import SOURCES, caption_against_noise

    copies = caption_against_noise(DenoisingPipe(reads_caption=False), count=16, timesteps=(999, 500, 100))
    assert copies.pairs == sum(s.objects[0].colour != s.objects[1].colour for s in prompt_set("pairs", 16))
    assert copies.shares == {SOURCES[0]: [1.0] * 3, SOURCES[1]: [0.0] * 3} and copies.timesteps == [999, 500, 100]
    assert copies.intervals[SOURCES[1]][0] == [0.0, 0.0]
    reads = caption_against_noise(
        DenoisingPipe(reads_caption=True), count=16, timesteps=(999, 500, 100), guidance_scale=1.0
    )
    assert reads.shares == {SOURCES[0]: [1.0] * 3, SOURCES[1]: [1.0] * 3}


class DrawingPipe:
    """Stands in for a model: at every step its prediction implies the generator's own image of the
    caption (epsilon 0 on a schedule without noise), or of the caption with "left of" always."""

    vae = None  # draws pixels

    def __init__(self, reads_relation: bool):
        from types import SimpleNamespace

        from sdkit.minisd.pipeline import MiniSDSpec

        self.spec = MiniSDSpec(image_size=32)
        self.reads_relation = reads_relation
        self._scheduler = SimpleNamespace(
            alphas_cumprod=torch.ones(1000), config=SimpleNamespace(prediction_type="epsilon")
        )

    def scheduler(self):
        return self._scheduler

    guidance = MiniSDPipeline.guidance  # the model's own scale (its spec's) when given none

    def __call__(self, captions, steps, guidance_scale, seeds, progress=None, callback_on_step_end=None):
        from sdkit.minisd.data import parse_caption, render, to_model

        if not self.reads_relation:
            captions = [c.replace("right of", "left of") for c in captions]
        images = torch.stack([torch.from_numpy(to_model(render(parse_caption(c), 32).image)) for c in captions])
        for i, t in enumerate(999 - k * (1000 // steps) for k in range(steps)):
            callback_on_step_end(i, t, 0, images, torch.zeros_like(images))


def test_relation_by_step_tells_a_model_that_reads_the_relation_from_one_that_does_not():
    from sdkit.minisd.evaluate import prompt_set
    from sdkit.minisd.trajectory import MEASURES, relation_by_step

    two_colours = sum(s.objects[0].colour != s.objects[1].colour for s in prompt_set("pairs", 16))
    reads = relation_by_step(DrawingPipe(reads_relation=True), count=16, steps=3)
    assert reads.pairs == two_colours < 16 and reads.timesteps == [999, 666, 333]
    assert reads.shares["in order"] == reads.shares["the word orders"] == [1.0, 1.0, 1.0]
    ignores = relation_by_step(DrawingPipe(reads_relation=False), count=16, steps=3)
    assert ignores.shares["in order"] == [0.5] * 3  # right for every "left of", wrong for every "right of"
    assert ignores.shares["the word orders"] == ignores.shares["the word moves colour"] == [0.0] * 3
    assert set(reads.intervals) == set(MEASURES) and reads.intervals["in order"][0] == [1.0, 1.0]


def test_steering_a_pipeline_at_another_size_and_by_words(tiny_sd):
    """steered_sd takes height and width (any multiple of the VAE's factor) and guides given by words."""
    from sdkit.common import SdkitError
    from sdkit.steering import Guide, SteeringSettings, steered_sd

    pipe, _ = tiny_sd
    prompt = "a red cat on a blue chair"
    guide = Guide.from_words(pipe.tokenizer, prompt, excite=["cat", "chair"])
    settings = SteeringSettings(objectives=("excite",), steps=1, resolution=16)
    images = steered_sd(
        pipe,
        prompt,
        guide,
        settings,
        num_inference_steps=2,
        height=64,
        width=96,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    assert images.shape == (1, 64, 96, 3) and np.isfinite(images).all()
    with pytest.raises(SdkitError, match="width must be a positive multiple of 2 pixels"):
        steered_sd(pipe, prompt, guide, settings, num_inference_steps=2, width=63)
