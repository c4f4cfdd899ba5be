"""The latent mini SD: a VAE trained here, a U-Net on its latents, saved as a stock diffusers
StableDiffusionPipeline folder that diffusers loads and samples as sdkit does, to the bit."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sdkit.common import SdkitError
from sdkit.encoders import for_stock_pipeline
from sdkit.minisd.data import all_captions
from sdkit.minisd.pipeline import MiniSDPipeline, MiniSDSpec
from sdkit.minisd.train import TrainSettings, train
from sdkit.minisd.vae import VAE_CONFIG, VAESettings, judge_round_trips, measure_scaling_factor, train_vae

REPO = Path(__file__).resolve().parents[1]

# Four halvings' worth of levels, as SD's VAE, at widths that train in a second
MICRO_VAE = {**VAE_CONFIG, "block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4}


def micro_latent_unet(width: int) -> dict:
    return {
        "_class_name": "UNet2DConditionModel",
        "block_out_channels": [16, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 2,
        "cross_attention_dim": width,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    }


@pytest.fixture(scope="module")
def micro_vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae") / "vae"
    result = train_vae(folder, VAESettings(steps=3, batch_size=2, warmup_steps=1, image_size=32), config=MICRO_VAE)
    return folder, result


@pytest.fixture(scope="module")
def latent_minisd(bert, micro_vae, tmp_path_factory):
    from sdkit.minisd.pipeline import load_vae

    out = tmp_path_factory.mktemp("latent") / "model"
    settings = TrainSettings(
        steps=2, batch_size=4, warmup_steps=1, image_size=32, space="latents", place_embeddings=False, compile=False
    )
    train(
        out,
        for_stock_pipeline(bert, settings.context_length),
        settings,
        micro_latent_unet(bert.width),
        progress=False,
        vae=load_vae(micro_vae[0]),
    )
    return out


def test_vae_folder_is_diffusers_and_its_scaling_factor_is_measured(micro_vae):
    from diffusers import AutoencoderKL

    folder, result = micro_vae
    vae = AutoencoderKL.from_pretrained(folder)
    assert vae.config.scaling_factor == pytest.approx(result.scaling_factor)
    # SD's rule: latents times the factor have unit standard deviation on training images
    original = vae.config.scaling_factor
    vae.register_to_config(scaling_factor=1.0)
    assert measure_scaling_factor(vae, count=64) == pytest.approx(original, rel=0.05)
    assert json.loads((folder / "training.json").read_text())["settings"]["steps"] == 3


def test_vae_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    from safetensors.torch import load_file

    settings = VAESettings(steps=4, batch_size=2, warmup_steps=1, image_size=32)
    train_vae(tmp_path / "whole", settings, config=MICRO_VAE, progress=False)
    # a run that checkpoints at step 2 (and finishes); a second run on its checkpoint resumes there
    train_vae(tmp_path / "first", settings, tmp_path / "ck", checkpoint_every=2, progress=False, config=MICRO_VAE)
    resumed = train_vae(tmp_path / "resumed", settings, tmp_path / "ck", progress=False, config=MICRO_VAE)
    assert [h["step"] for h in resumed.history] == [4]  # its one log line, at the end
    name = "diffusion_pytorch_model.safetensors"
    whole, again = load_file(tmp_path / "whole" / name), load_file(tmp_path / "resumed" / name)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    with pytest.raises(SdkitError, match="already exists"):
        train_vae(tmp_path / "whole", settings, config=MICRO_VAE, progress=False)
    # another run's checkpoint (another lr) is refused, never resumed into this run
    other = VAESettings(**{**settings.__dict__, "lr": 5e-4})
    with pytest.raises(SdkitError, match="belongs to another VAE run"):
        train_vae(tmp_path / "other", other, tmp_path / "ck", progress=False, config=MICRO_VAE)


def test_round_trips_are_judged_against_the_originals(micro_vae):
    from diffusers import AutoencoderKL

    judged = judge_round_trips(AutoencoderKL.from_pretrained(micro_vae[0]), count=4)
    assert set(judged) == {"singles", "pairs"}
    for row in judged.values():
        assert row["originals"]["all"] == 1.0  # the judge reads the generator's own images right
        assert 0 <= row["round_trips"]["all"] <= 1 and np.isfinite(row["psnr_db"])


def test_latent_separation_is_measured_in_the_latents_the_u_net_reads():
    from sdkit.minisd.vae import build_vae, latent_separation

    vae = build_vae({**MICRO_VAE, "sample_size": 128}).eval()
    apart = latent_separation(vae)
    assert len(apart["colours"]) == 15 and len(apart["shapes"]) == 3
    assert min(apart["colours"].values()) > 0 and min(apart["shapes"].values()) > 0
    vae.register_to_config(scaling_factor=2.0)  # the U-Net reads the scaled latents: twice as far apart
    doubled = latent_separation(vae)
    assert doubled["colours"] == pytest.approx({k: 2 * v for k, v in apart["colours"].items()}, rel=1e-5)
    torch.nn.init.zeros_(vae.quant_conv.weight)  # an encoder blind to its input puts everything in one place
    assert max(latent_separation(vae)["colours"].values()) == 0


def test_a_latent_mini_sd_is_a_stock_pipeline_that_samples_as_sdkit_does(latent_minisd):
    from diffusers import StableDiffusionPipeline

    index = json.loads((latent_minisd / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["safety_checker"] == [None, None]
    assert MiniSDSpec.read(latent_minisd).space == "latents"
    stock = StableDiffusionPipeline.from_pretrained(latent_minisd)
    ours = MiniSDPipeline.from_pretrained(latent_minisd)
    prompt = "a red circle at the top left"
    image = stock(
        prompt, num_inference_steps=4, guidance_scale=4.0, generator=torch.Generator().manual_seed(3), output_type="np"
    ).images
    assert image.shape == (1, 32, 32, 3)
    assert np.array_equal(image, ours([prompt], num_inference_steps=4, guidance_scale=4.0, seeds=[3]).images)
    # what the U-Net was trained on is what diffusers' encode_prompt gives, the empty prompt too
    positive, negative = stock.encode_prompt([prompt], "cpu", 1, True, [""])
    assert torch.equal(positive, ours.encode([prompt])) and torch.equal(negative, ours.encode([""]))


def test_the_stock_encoder_is_a_copy(bert):
    stock = for_stock_pipeline(bert, 24)
    assert stock.pads_with_states and not bert.pads_with_states
    assert stock.tokenizer.model_max_length == 24 and bert.tokenizer.model_max_length != 24
    states = stock.encode(["a red circle"])
    assert states.shape == (1, 24, bert.width) and states[0, -1].abs().sum() > 0  # pads hold states
    assert bert.encode(["a red circle"])[0, 5:].abs().sum() == 0  # the original still zeros them


def test_latent_training_refuses_what_a_stock_pipeline_cannot_carry(bert, micro_vae, tmp_path):
    from sdkit.minisd.pipeline import load_vae

    vae = load_vae(micro_vae[0])
    with pytest.raises(SdkitError, match="no coordinate channels"):
        TrainSettings(space="latents", coordinates=True).check()
    settings = TrainSettings(steps=1, batch_size=2, image_size=32, space="latents", place_embeddings=False)
    with pytest.raises(SdkitError, match="for_stock_pipeline"):
        train(tmp_path / "a", bert, settings, micro_latent_unet(bert.width), progress=False, vae=vae)
    with pytest.raises(SdkitError, match="VAE made for 64"):
        train(
            tmp_path / "b",
            for_stock_pipeline(bert, 24),
            TrainSettings(steps=1, batch_size=2, image_size=64, space="latents", place_embeddings=False),
            micro_latent_unet(bert.width),
            progress=False,
            vae=vae,
        )
    with pytest.raises(SdkitError, match="a VAE is for space 'latents'"):
        train(tmp_path / "c", bert, TrainSettings(steps=1, batch_size=2), progress=False, vae=vae)


def test_latent_place_embeddings_are_an_sdkit_folder_a_stock_pipeline_cannot_load(bert, micro_vae, tmp_path):
    """The ablation's latent row with place embeddings: sdkit samples it with them; diffusers would
    sample it without them, so the folder has no model_index.json and stock_pipeline refuses."""
    from diffusers import StableDiffusionPipeline

    from sdkit.minisd.pipeline import load_vae

    settings = TrainSettings(
        steps=2, batch_size=4, warmup_steps=1, image_size=32, space="latents", place_embeddings=True, compile=False
    )
    out = tmp_path / "model"
    encoder = for_stock_pipeline(bert, settings.context_length)
    train(out, encoder, settings, micro_latent_unet(bert.width), progress=False, vae=load_vae(micro_vae[0]))
    assert not (out / "model_index.json").exists() and (out / "vae" / "config.json").is_file()
    with pytest.raises(Exception, match="model_index.json"):
        StableDiffusionPipeline.from_pretrained(out)
    pipe = MiniSDPipeline.from_pretrained(out)
    assert pipe.spec.place_embeddings and pipe.spec.space == "latents"
    with pytest.raises(SdkitError, match="place embeddings"):
        pipe.stock_pipeline()
    prompt = "a red circle at the top left"
    with_places = pipe([prompt], num_inference_steps=2, seeds=[3]).images
    for block in pipe.unet.modules():  # the same weights without the embeddings draw another image
        if getattr(block, "pos_embed", None) is not None:
            block.pos_embed = None
    assert not np.array_equal(with_places, pipe([prompt], num_inference_steps=2, seeds=[3]).images)


def test_a_latent_spec_with_a_pixel_unet_is_refused(latent_minisd, micro_minisd):
    from sdkit.loading import load_unet

    spec = MiniSDSpec.read(latent_minisd)
    with pytest.raises(SdkitError, match="16x16x4|4x4x4"):
        spec.check_unet(load_unet(micro_minisd[0]))


def test_cli_trains_and_judges_a_vae(cli, micro_vae, tmp_path):
    code, out, err = cli("minisd", "vae", "--judge", micro_vae[0], "--count", "2", "--json")
    assert code == 0, err
    judged = json.loads(out)
    assert set(judged["round_trips"]) == {"singles", "pairs"} and judged["training_seconds"] > 0
    out_dir = tmp_path / "vae"
    code, out, err = cli(
        "minisd", "vae", "--out", out_dir, "--steps", "1", "--batch-size", "2", "--kl-weight", "0.01", "--count", "2",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    trained = json.loads(out)
    assert trained["settings"]["steps"] == 1 and trained["settings"]["kl_weight"] == 0.01
    assert set(trained["latent_separation"]["shapes"]) == {"circle-square", "circle-triangle", "square-triangle"}
    assert trained["scaling_factor"] > 0
    assert json.loads((out_dir / "config.json").read_text())["scaling_factor"] == trained["scaling_factor"]
    code, out, err = cli("minisd", "vae", "--judge", micro_vae[0], "--steps", "3")
    assert code == 2 and "--steps does not apply with --judge" in err
    # a frozen encoder's KL term moves nothing: a weight given for it would be silently ignored
    code, out, err = cli(
        "minisd", "vae", "--start-from", micro_vae[0], "--decoder-only", "--kl-weight", "0.01", "--out", tmp_path / "d"
    )
    assert code == 2 and "--kl-weight does not apply with --decoder-only" in err and not (tmp_path / "d").exists()


def test_a_fine_tuned_decoder_goes_in_and_another_vae_is_refused(latent_minisd, micro_vae, tmp_path):
    import shutil

    from sdkit.minisd.pipeline import load_vae
    from sdkit.minisd.vae import install_vae, total_training_seconds

    model = tmp_path / "model"
    shutil.copytree(latent_minisd, model)
    settings = VAESettings(steps=2, batch_size=2, warmup_steps=1, image_size=32, decoder_only=True)
    tuned = train_vae(tmp_path / "tuned", settings, start_from=micro_vae[0], progress=False)
    assert tuned.scaling_factor == micro_vae[1].scaling_factor  # the encoder kept, so its scale
    before, after = load_vae(micro_vae[0]).state_dict(), load_vae(tmp_path / "tuned").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("encoder."))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    record = json.loads((tmp_path / "tuned" / "training.json").read_text())
    assert total_training_seconds(record) == pytest.approx(tuned.seconds + micro_vae[1].seconds, abs=0.2)
    install_vae(model, tmp_path / "tuned", record)
    decoder = load_vae(model).state_dict()
    assert all(torch.equal(decoder[k], after[k]) for k in after)
    assert MiniSDSpec.read(model).training["vae"]["settings"]["decoder_only"] is True
    # a VAE trained apart has another encoder: the U-Net's latents would mean nothing to it
    train_vae(tmp_path / "other", VAESettings(steps=1, batch_size=2, image_size=32, seed=1), config=MICRO_VAE)
    with pytest.raises(SdkitError, match="its encoder is not"):
        install_vae(model, tmp_path / "other")


SHIPPED = "weights/minisd-latent"


@pytest.mark.slow  # reads the real text encoder (the slow run fetches it) and samples 128-pixel images
@pytest.mark.parametrize("guidance", [7.5, 4.0, 2.0])  # diffusers' default, the pixel model's, the latent's
def test_the_shipped_latent_model_is_a_stable_diffusion_whose_image_the_judge_passes(guidance):
    from diffusers import StableDiffusionPipeline

    from sdkit.minisd.data import parse_caption
    from sdkit.minisd.judge import judge

    pipe = StableDiffusionPipeline.from_pretrained(SHIPPED)
    prompt = "a red circle at the top left"
    image = pipe(
        prompt, num_inference_steps=25, guidance_scale=guidance, generator=torch.Generator().manual_seed(0)
    ).images[0]
    assert image.size == (128, 128)
    assert judge(np.asarray(image, dtype=np.float32) / 255, parse_caption(prompt)).all


def test_the_minisd_commands_take_a_latent_model(cli, latent_minisd, tmp_path):
    """Sampling with overlays and steering, editing and judging: the pixel model's commands, on a
    latent model (its images decoded by its VAE)."""
    prompt = "a red circle to the left of a blue square"
    code, _, err = cli(
        "minisd", "sample", prompt, "--model", latent_minisd, "--seeds", "1", "--steps", "2",
        "--out", tmp_path / "s.png", "--overlays", tmp_path / "maps",
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "s.png").is_file() and any((tmp_path / "maps").glob("*.png"))
    code, _, err = cli(
        "minisd", "sample", prompt, "--model", latent_minisd, "--seeds", "1", "--steps", "2",
        "--out", tmp_path / "g.png", "--guide", "layout", "--guide-steps", "1", "--guide-resolution", "2",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = cli(
        "minisd", "edit", prompt, "--to", "a green circle to the left of a blue square", "--model", latent_minisd,
        "--seeds", "1", "--steps", "2", "--out", tmp_path / "e.png",
    )  # fmt: skip
    assert code == 0, err
    code, out, err = cli(
        "minisd", "eval", "--model", latent_minisd, "--count", "2", "--steps", "2", "--sets", "pairs", "--json"
    )
    assert code == 0, err
    results = json.loads(out)["results"]
    assert results["judge, VAE round trips"]["pairs"]["all"] >= 0 and "untrained" in results


def test_the_edit_command_edits_a_real_image_on_a_latent_model(cli, latent_minisd, micro_minisd, tmp_path):
    """--image: the image inverted (null-text) into the stock pipeline, redrawn, regenerated and
    edited; its JSON's last inversion error is the library's own inversion's. Random weights: the
    mechanics, not what a model does. What it cannot read is one error line."""
    from PIL import Image

    from sdkit.editing import EditSettings, edit_sd, invert_sd
    from sdkit.minisd.data import parse_caption, render

    prompt, edited = "a red circle to the left of a blue square", "a green circle to the left of a blue square"
    real = render(parse_caption(prompt), 32).image
    Image.fromarray((real * 255).round().astype(np.uint8)).save(tmp_path / "real.png")
    real = np.asarray(Image.open(tmp_path / "real.png"), dtype=np.float32) / 255  # as the file holds it
    run = ("minisd", "edit", prompt, "--to", edited, "--model", latent_minisd, "--steps", "2")
    code, out, err = cli(*run, "--image", tmp_path / "real.png", "--out", tmp_path / "e.png", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (tmp_path / "e.png").is_file() and result["tuned_states_for"] == "source" and "seeds" not in result
    stock = MiniSDPipeline.from_pretrained(latent_minisd).stock_pipeline()
    inversion = invert_sd(stock, Image.open(tmp_path / "real.png"), prompt, 2, result["guidance_scale"], progress=False)
    assert result["inversion_error"] == pytest.approx(inversion.errors[-1], rel=1e-5)
    redrawn = edit_sd(stock, prompt, edited, EditSettings(cross_replace=0.0), 2, result["guidance_scale"],
                      output_type="np", inversion=inversion)[0]  # fmt: skip
    assert result["redrawn_error"] == pytest.approx(float(np.abs(redrawn - real).mean()), rel=1e-4)
    (tmp_path / "not.png").write_text("not an image")
    pixel_folder, encoder = micro_minisd
    for extra, message in (
        (("--image", tmp_path / "none.png"), "none.png: no such file or folder (--image)"),
        (("--image", tmp_path / "not.png"), "not.png: not an image (--image)"),
        (("--image", tmp_path / "real.png", "--seeds", "2"), "--seeds does not apply with --image"),
        (("--tuned-states-for", "both"), "--tuned-states-for does not apply without --image"),
    ):
        code, _, err = cli(*run, *extra, "--out", tmp_path / "x.png")
        assert code == 2 and message in err, err
    code, _, err = cli(
        "minisd", "edit", prompt, "--to", edited, "--model", pixel_folder, "--text-encoder", encoder,
        "--image", tmp_path / "real.png", "--out", tmp_path / "x.png",
    )  # fmt: skip
    assert code == 2 and "denoises pixels; a real image is inverted into a latent mini SD" in err, err
    assert not (tmp_path / "x.png").exists()


def test_a_mini_sd_samples_at_its_own_guidance_unless_told(cli, latent_minisd, micro_minisd, tmp_path):
    """Pixels at 4, latents at 2 (SAMPLING_GUIDANCE): the library's calls and the commands alike,
    with the scale used recorded; a scale given is the scale used."""
    pixel_folder, encoder = micro_minisd
    pixel = MiniSDPipeline.from_pretrained(pixel_folder, encoder)
    latent = MiniSDPipeline.from_pretrained(latent_minisd)
    assert (pixel.spec.guidance_scale, latent.spec.guidance_scale) == (4.0, 2.0)
    for pipe, own in ((pixel, 4.0), (latent, 2.0)):
        unasked = pipe(["a red circle"], 2, seeds=[0]).images
        assert np.array_equal(unasked, pipe(["a red circle"], 2, own, seeds=[0]).images)
        assert not np.array_equal(unasked, pipe(["a red circle"], 2, own + 1, seeds=[0]).images)
    for folder, extra, own in ((pixel_folder, ("--text-encoder", encoder), 4.0), (latent_minisd, (), 2.0)):
        for given, used in (((), own), (("--guidance", "3"), 3.0)):
            code, out, err = cli(
                "minisd", "eval", "--model", folder, *extra, *given, "--count", "1", "--steps", "2",
                "--sets", "singles", "--no-floors", "--json",
            )  # fmt: skip
            assert code == 0, err
            assert json.loads(out)["guidance_scale"] == used
            code, out, err = cli(
                "minisd", "edit", "a red circle", "--to", "a blue circle", "--model", folder, *extra, *given,
                "--seeds", "1", "--steps", "2", "--out", tmp_path / f"{own:g}-{used:g}.png", "--json",
            )  # fmt: skip
            assert code == 0, err
            assert json.loads(out)["guidance_scale"] == used


# --- the tools of the other commands, on a latent mini SD and the stock pipeline that holds it -------------------


def test_the_audit_splits_a_pipeline_folder_and_the_pipeline_object_alike(cli, latent_minisd):
    from diffusers import StableDiffusionPipeline

    from sdkit.audit import audit, audit_module

    pipe = StableDiffusionPipeline.from_pretrained(latent_minisd)
    from_folder, from_object = audit(latent_minisd), audit_module(pipe)
    assert set(from_folder.components) == set(from_object.components) == {"unet", "vae", "text_encoder"}
    for name in ("unet", "vae", "text_encoder"):
        held = sum(p.numel() for p in getattr(pipe, name).parameters())
        assert from_folder.components[name]["params"] == from_object.components[name]["params"] == held
    assert from_folder.total == from_object.total == sum(p.numel() for p in pipe.unet.parameters())
    assert from_folder.roles == from_object.roles and from_folder.levels == from_object.levels
    code, out, err = cli("audit", latent_minisd, "--json")
    assert code == 0, err
    assert json.loads(out)["components"]["vae"]["params"] == sum(p.numel() for p in pipe.vae.parameters())


def test_score_tables_read_the_levels_and_token_count_of_a_pipeline_folder(cli, latent_minisd):
    from sdkit.scoretable import score_tables

    spec = MiniSDSpec.read(latent_minisd)
    tables = score_tables(model=str(latent_minisd))
    assert (tables.height, tables.width, tables.text_tokens) == (spec.image_size, spec.image_size, spec.max_length)
    # micro_latent_unet at 32 px: a 4x4 latent; cross-attention in down 0 (1 layer) and up 1 (2) at 4x4,
    # and the mid block's at 2x2
    assert [(c.name, c.layers, c.entries_per_head) for c in tables.cross] == [
        ("latent 4x4", 3, 16 * spec.max_length),
        ("latent 2x2", 1, 4 * spec.max_length),
        ("pixel 32x32", 0, 32 * 32 * spec.max_length),
    ]
    code, out, err = cli("scoretable", "--model", latent_minisd, "--size", "64", "--json")
    assert code == 0, err
    assert json.loads(out)["cross"][0]["grid"] == [8, 8]
    code, _, err = cli("scoretable", "--model", "no/such/folder")
    assert code == 2 and "no/such/folder" in err


def test_maps_against_masks_read_a_latent_model_through_its_vae(cli, latent_minisd):
    pipe = MiniSDPipeline.from_pretrained(latent_minisd)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        expected = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
    latents = pipe.encode_images(pixels)
    assert latents.shape == (2, 4, 4, 4)
    torch.testing.assert_close(latents, expected, rtol=0, atol=1e-5)  # scaled_latents encodes channels-last
    code, out, err = cli(
        "condition", "--unet", latent_minisd, "--masks", "--count", "2", "--timesteps", "500", "--json"
    )
    assert code == 0, err
    rows = json.loads(out)["localization"][0]["rows"]
    assert {r["resolution"] for r in rows} == {4, 2, "all layers"}
    assert all(0 <= r["word"]["auc"] <= 1 for r in rows)


def test_single_and_multi_token_conditioning_are_compared_on_a_latent_model(cli, latent_minisd):
    from sdkit.minisd.conditions import CONDITIONS

    code, out, err = cli("condition", "--unet", latent_minisd, "--generate", "--count", "1", "--steps", "2", "--json")
    assert code == 0, err
    assert set(json.loads(out)["results"]) == set(CONDITIONS)


def test_the_adapter_is_judged_at_a_latent_u_net(cli, latent_minisd, bert, tmp_path):
    from sdkit.encoders import write_tiny_bert_encoder

    wide = write_tiny_bert_encoder(tmp_path / "wide", 48, seed=1)
    code, out, err = cli(
        "adapter", "train", "--unet", latent_minisd, "--new", wide, "--old", bert.source, "--captions", "60",
        "--kinds", "linear", "--epochs", "1", "--judge", "1", "--out", tmp_path / "adapters", "--json",
    )  # fmt: skip
    assert code == 0, err
    judged = json.loads(out)["judged"]
    assert set(judged["results"]) >= {"native", "linear"} and judged["count"] == 1


def test_the_order_studies_read_a_latent_model_on_its_decoded_pixels(latent_minisd):
    """Caption against noise and relation by step read the order of colours in pixels: on a latent
    model, in its predictions decoded by its VAE (the U-Net noised and predicting on latents)."""
    from sdkit.minisd.trajectory import caption_against_noise, relation_by_step

    pipe = MiniSDPipeline.from_pretrained(latent_minisd)
    against = caption_against_noise(pipe, count=6, timesteps=(300, 900))
    assert against.pairs > 0 and all(len(shares) == 2 for shares in against.shares.values())
    by_step = relation_by_step(pipe, count=6, steps=2)
    assert len(by_step.timesteps) == 2 and all(0 <= s <= 1 for v in by_step.shares.values() for s in v)


def micro_latent_run(bert, micro_vae, out, monkeypatch, **settings) -> list[tuple[bool, bool]]:
    """Trains a micro latent mini SD 2 steps; for each VAE encode, (under bfloat16 autocast, drawn
    from the posterior rather than its mean)."""
    from sdkit.minisd import train as training
    from sdkit.minisd.pipeline import load_vae

    seen = []
    encode = training.scaled_latents

    def recording(vae, pixels, generator=None):
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        seen.append((bf16, generator is not None))
        return encode(vae, pixels, generator)

    monkeypatch.setattr(training, "scaled_latents", recording)
    settings = TrainSettings(
        steps=2,
        batch_size=2,
        warmup_steps=1,
        image_size=32,
        space="latents",
        place_embeddings=False,
        compile=False,
        **settings,
    )
    vae = load_vae(micro_vae[0])
    train(out, for_stock_pipeline(bert, 24), settings, micro_latent_unet(bert.width), progress=False, vae=vae)
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16-fp32-ends"])
def test_the_frozen_vae_encodes_in_the_runs_precision(bert, micro_vae, tmp_path, monkeypatch, precision):
    """Under bf16 the VAE's encodes run in bfloat16 autocast (as diffusers' script casts the VAE to
    the weight dtype); in fp32 they stay float32, so fp32 runs' latents are unchanged."""
    seen = micro_latent_run(bert, micro_vae, tmp_path / "m", monkeypatch, precision=precision)
    assert [bf16 for bf16, _ in seen] == [precision != "fp32"] * 2


@pytest.mark.parametrize("posterior", ["sample", "mean"])
def test_a_latent_run_denoises_posterior_draws_or_the_posterior_mean(bert, micro_vae, tmp_path, monkeypatch, posterior):
    """TrainSettings.posterior: the run encodes draws from the VAE's posterior or its mean, and
    records which."""
    seen = micro_latent_run(bert, micro_vae, tmp_path / "m", monkeypatch, posterior=posterior)
    assert [drawn for _, drawn in seen] == [posterior == "sample"] * 2
    recorded = json.loads((tmp_path / "m" / "minisd.json").read_text())["training"]["settings"]
    assert recorded["posterior"] == posterior
    assert latent_defaults("--posterior", posterior).posterior == posterior
    with pytest.raises(SdkitError, match="posterior is a latent run's"):
        TrainSettings(posterior="mean").check()


def test_a_latent_pool_is_the_streams_first_images_encoded_once(bert, micro_vae, tmp_path, monkeypatch):
    """TrainSettings.latent_pool: each pass shows every pooled image once, in its own order, with its
    own caption and mask; a batch's latents are the draw scaled_latents makes of its images; the pool
    is read back from the cache; a run with a pool encodes nothing at its steps."""
    from sdkit.minisd.data import sample_at, to_model
    from sdkit.minisd.pipeline import load_vae, scaled_latents
    from sdkit.minisd.train import batch_at, encode_captions, encode_pool

    vae = load_vae(micro_vae[0])
    settings = TrainSettings(batch_size=3, image_size=32, space="latents", latent_pool=6, empty_fraction=0)
    captions = encode_captions(for_stock_pipeline(bert, 24), ["", *all_captions()], None, progress=False)
    batches = [batch_at(step, settings, captions) for step in range(6)]
    images = torch.cat([b.images for b in batches]).tolist()
    passes = [images[0:6], images[6:12], images[12:18]]
    assert all(sorted(p) == list(range(6)) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # a new order each pass
    for batch in batches[:2]:
        for image, pixels, caption in zip(batch.images.tolist(), batch.pixels, batch.captions):
            sample = sample_at(settings.seed, image, 32, settings.pair_fraction)
            assert caption == sample.caption
            assert torch.equal(pixels, torch.from_numpy(to_model(sample.image)))

    pool = encode_pool(vae, settings, tmp_path, progress=False)
    assert pool.mean.shape == (6, 4, 4, 4) and pool.std.min() > 0
    for batch in batches[:2]:
        for seed in (None, 3):  # the posterior's mean, a draw
            expected = scaled_latents(vae, batch.pixels, seed and torch.Generator().manual_seed(seed))
            drawn = pool.draw(batch.images, seed and torch.Generator().manual_seed(seed))
            # to 1e-4 of latents whose deviation is 1: the pool was encoded in batches of another size,
            # whose convolutions sum in another order; another image's latents stand apart by 0.1s
            torch.testing.assert_close(drawn, expected, rtol=0, atol=1e-4)

    def refuse(*args, **kwargs):
        raise AssertionError("the VAE encoded again")

    monkeypatch.setattr(vae, "encode", refuse)
    cached = encode_pool(vae, settings, tmp_path, progress=False)
    assert torch.equal(cached.mean, pool.mean) and torch.equal(cached.std, pool.std)
    monkeypatch.undo()
    (written,) = tmp_path.glob("minisd-latents-*.safetensors")
    written.write_bytes(b"damaged")
    torch.testing.assert_close(encode_pool(vae, settings, tmp_path, progress=False).mean, pool.mean)

    seen = micro_latent_run(bert, micro_vae, tmp_path / "m", monkeypatch, latent_pool=4)
    assert seen == []  # the pool's encode is the VAE's only one
    training = json.loads((tmp_path / "m" / "minisd.json").read_text())["training"]
    assert training["settings"]["latent_pool"] == 4 and training["latent_pool_seconds"] >= 0
    assert latent_defaults("--latent-pool", "8").latent_pool == 8
    with pytest.raises(SdkitError, match="latent_pool is a latent run's"):
        TrainSettings(latent_pool=8).check()
    with pytest.raises(SdkitError, match="latent_pool must be 0"):
        TrainSettings(space="latents", place_embeddings=False, latent_pool=-1).check()


def test_scaled_latents_are_the_posterior_mean_or_a_draw_from_it(micro_vae):
    from sdkit.minisd.pipeline import load_vae, scaled_latents

    vae = load_vae(micro_vae[0])
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        plain = vae.encode(pixels).latent_dist
        dist = vae.encode(pixels.contiguous(memory_format=torch.channels_last)).latent_dist
    scale = vae.config.scaling_factor
    # to the bit, encoded as scaled_latents encodes (channels-last, for speed) ...
    torch.testing.assert_close(scaled_latents(vae, pixels), dist.mean * scale, rtol=0, atol=0)
    noise = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
    drawn = scaled_latents(vae, pixels, torch.Generator().manual_seed(3))
    torch.testing.assert_close(drawn, (dist.mean + dist.std * noise) * scale, rtol=0, atol=0)
    assert dist.std.min() > 0  # so the draw is not the mean in disguise
    # ... and to 1e-5 of the plain encode, whose convolutions sum in another order
    torch.testing.assert_close(dist.mean, plain.mean, rtol=0, atol=1e-5)
    torch.testing.assert_close(dist.std, plain.std, rtol=0, atol=1e-5)


def latent_defaults(*options):
    from types import SimpleNamespace

    from sdkit.cli import build_parser
    from sdkit.cli.common import given_options
    from sdkit.cli.minisd import train_settings

    argv = ["minisd", "train", "--vae", "some/vae", *options]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given_options(parser, argv)
    return train_settings(args, vae=SimpleNamespace(config=SimpleNamespace(sample_size=128)))


def test_a_vae_makes_the_latent_recipe_and_options_still_override_it():
    from sdkit.minisd import LATENT_STEPS

    latent = TrainSettings(space="latents", steps=LATENT_STEPS, image_size=128, place_embeddings=False)
    assert latent_defaults() == latent
    assert latent_defaults("--steps", "700", "--image-size", "64", "--place-embeddings") == TrainSettings(
        space="latents", steps=700, image_size=64, place_embeddings=True
    )


@pytest.mark.skipif(not (REPO / SHIPPED / "minisd.json").is_file(), reason="no shipped latent mini SD")
def test_the_shipped_latent_model_was_trained_by_the_latent_defaults():
    from dataclasses import asdict

    from sdkit.minisd.train import recorded_settings

    trained = json.loads((REPO / SHIPPED / "minisd.json").read_text())["training"]
    # one process, from scratch to the end, alone on a 2-core CPU, within the hour the issue allows
    assert trained["resumed_from_step"] == 0 and trained["processes"] == 1
    assert trained["total_seconds"] <= 3600
    assert recorded_settings(trained["settings"]) == {**asdict(latent_defaults()), "precision": "fp32"}
    assert trained["vae"]["settings"]["kl_weight"] == 0.01  # the VAE whose latents keep colours apart
