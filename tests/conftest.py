import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from sdkit.checkpoints import ORIGINAL_UNET_PREFIX, diffusers_to_original_names  # noqa: E402
from sdkit.loading import save_single_file  # noqa: E402
from sdkit.presets import build_unet, preset_config  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def cache_folder(tmp_path_factory):
    """Commands cache into default_cache(): during tests, a folder of the run's own (subprocesses too)."""
    os.environ["SDKIT_CACHE"] = str(tmp_path_factory.mktemp("sdkit-cache"))


@pytest.fixture(scope="session")
def tiny_unet():
    """The tiny preset with diffusers' random initialisation (seed 0)."""
    return build_unet(preset_config("tiny"), weights="random", seed=0)


@pytest.fixture
def cli(capsys):
    """Run `sdkit ARGV` in-process; return (exit code, stdout, stderr)."""
    from sdkit.cli import main

    def run(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors exit
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """A CLIP-shaped text encoder of width 768 with the tiny tokenizer, as an SD pipeline folder."""
    from sdkit.encoders import write_tiny_clip_encoder

    return write_tiny_clip_encoder(tmp_path_factory.mktemp("enc768"), width=768, seed=0)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Tiny CLIP-shaped encoders sharing one tokenizer: new (1024 wide) and old (768 wide)."""
    from sdkit.encoders import load_text_encoder, write_tiny_clip_encoder

    root = tmp_path_factory.mktemp("pair")
    new = write_tiny_clip_encoder(root / "new1024", width=1024, seed=1, layers=1)
    old = write_tiny_clip_encoder(root / "old768", width=768, seed=0, layers=1)
    return load_text_encoder(new), load_text_encoder(old)


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory, tiny_unet):
    """The tiny U-Net as an original-layout single file with a VAE and text encoder beside it,
    as a bare diffusers-layout file, and as a diffusers pipeline folder."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(1)
    extra = {
        "first_stage_model.decoder.conv_in.weight": torch.randn(8, 4, 3, 3).half(),
        "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.randn(768),
    }
    save_single_file(tiny_unet, root / "original.safetensors", extra=extra)
    save_single_file(tiny_unet, root / "diffusers.safetensors", layout="diffusers")
    tiny_unet.save_pretrained(root / "pipeline" / "unet")
    torch.save({"state_dict": original_state_dict(tiny_unet)}, root / "original.ckpt")
    return root


def original_state_dict(unet, state=None):
    """A diffusers U-Net's state dict under the original (CompVis) single-file names."""
    state = state or unet.state_dict()
    names = diffusers_to_original_names(state, unet.config.layers_per_block)
    return {ORIGINAL_UNET_PREFIX + names[k]: v for k, v in state.items()}


def micro_config(width: int) -> dict:
    """A two-level mini SD U-Net, small enough to train in a second."""
    return {
        "_class_name": "UNet2DConditionModel",
        "in_channels": 3,
        "out_channels": 3,
        "sample_size": 32,
        "block_out_channels": [16, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 2,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": width,
    }


@pytest.fixture(scope="session")
def bert(tmp_path_factory):
    """A tiny BERT-style encoder (width 32), tokenizing as all-MiniLM-L6-v2 does."""
    from sdkit.encoders import load_text_encoder, write_tiny_bert_encoder

    return load_text_encoder(write_tiny_bert_encoder(tmp_path_factory.mktemp("bert"), width=32))


@pytest.fixture(scope="session")
def micro_minisd(bert, tmp_path_factory):
    """A mini SD folder on the micro config, trained two steps: (folder, its encoder's folder)."""
    from sdkit.minisd.train import TrainSettings, train

    out = tmp_path_factory.mktemp("micro-minisd") / "model"
    train(
        out,
        bert,
        TrainSettings(steps=2, batch_size=4, warmup_steps=1, compile=False),
        micro_config(bert.width),
        cache_dir=None,
        progress=False,
    )
    return out, bert.source


@pytest.fixture(scope="session")
def tiny_sd():
    """A tiny random Stable Diffusion pipeline (U-Net with cross-attention at 32x32 and 16x16), and
    its components by name."""
    from sdkit.presets import tiny_sd_pipeline

    pipe = tiny_sd_pipeline(seed=0)
    parts = ("vae", "text_encoder", "tokenizer", "unet", "scheduler", "safety_checker", "feature_extractor")
    return pipe, {**{name: pipe.components[name] for name in parts}, "requires_safety_checker": False}
