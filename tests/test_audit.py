import json

import pytest
import torch
from conftest import original_state_dict
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

from sdkit.audit import ROLES, audit, audit_module, parameter_role, text_width_swap
from sdkit.checkpoints import (
    ORIGINAL_UNET_PREFIX,
    diffusers_to_original_names,
    index_checkpoint,
    original_to_diffusers_names,
)
from sdkit.loading import load_unet, module_index
from sdkit.presets import PRESETS, build_unet, preset_config

SD15_TOTAL = 859_520_964


def test_sd15_attention_blocks_are_mostly_mlp():
    a = audit("sd15")
    assert a.total == SD15_TOTAL
    b = a.attention_blocks
    assert b["count"] == 16
    assert b["total"] == 267_239_360
    assert b["mlp"] == 148_797_120
    assert b["self_attention"] == 49_574_080
    assert b["cross_attention"] == 43_962_560
    assert round(100 * b["mlp_share"], 1) == 55.7
    assert b["total"] == b["mlp"] + b["self_attention"] + b["cross_attention"] + b["norm"] + b["proj"]


@pytest.mark.parametrize("name", PRESETS)
def test_roles_and_levels_sum_to_the_total(name):
    a = audit(name)
    unet = build_unet(preset_config(name))
    assert a.total == sum(p.numel() for p in unet.parameters())
    assert sum(a.roles.values()) == a.total
    assert a.roles["other"] == 0
    assert sum(level["total"] for level in a.levels) == a.total
    for role in ROLES:
        assert sum(level["roles"][role] for level in a.levels) == a.roles[role]


def test_published_unet_sizes():
    # Published sizes of the real U-Nets: SD 2.x 865,910,724; SDXL base 2,567,463,684.
    assert audit("sd21").total == 865_910_724
    assert audit("sdxl").total == 2_567_463_684
    for name, published in [("sd21", 865_910_724), ("sdxl", 2_567_463_684)]:
        assert build_unet(preset_config(name)).num_parameters() == published
    assert audit("sdxl").roles["time_embedding"] > audit("sd15").roles["time_embedding"]  # add_embedding counted


def test_head_count_changes_no_parameter():
    one_head = {**preset_config("sd15"), "attention_head_dim": 1}
    unet = build_unet(one_head)
    attn = unet.down_blocks[2].attentions[0].transformer_blocks[0].attn1
    assert (attn.heads, attn.inner_dim // attn.heads) == (1, 1280)
    assert audit_module(unet).total == SD15_TOTAL
    assert audit_module(unet).roles == audit("sd15").roles


def test_text_width_1024_changes_only_attn2_key_value():
    wide = build_unet({**preset_config("sd15"), "cross_attention_dim": 1024})
    assert audit_module(wide).total == 865_910_724
    before, after = index_checkpoint("sd15").unet, module_index(wide)
    differ = {n for n in before if before[n].shape != after[n].shape}
    assert len(differ) == 32
    assert all(n.endswith(("attn2.to_k.weight", "attn2.to_v.weight")) for n in differ)
    swap = text_width_swap(before, 1024)
    assert {c["name"] for c in swap["changed"]} == differ
    assert swap["parameter_change"] == 6_389_760
    assert swap["total_after"] == 865_910_724
    assert swap["linear_adapter_parameters"] == 787_200
    assert all(after[c["name"]].shape == tuple(c["new_shape"]) for c in swap["changed"])


def test_cli_audit_json(cli):
    code, out, err = cli("audit", "sd15", "--json", "--context-dim", "1024")
    assert code == 0
    data = json.loads(out)
    assert data["total"] == SD15_TOTAL
    assert data["attention_blocks"]["mlp"] == 148_797_120
    assert data["text_width_swap"]["parameter_change"] == 6_389_760
    assert [lv["name"] for lv in data["levels"]] == [
        "stem",
        "down.0",
        "down.1",
        "down.2",
        "down.3",
        "mid",
        "up.0",
        "up.1",
        "up.2",
        "up.3",
    ]
    assert [lv["latent_side"] for lv in data["levels"]] == [64, 64, 32, 16, 8, 8, 8, 16, 32, 64]


def test_cli_audit_table(cli):
    code, out, _ = cli("audit", "sd15")
    assert code == 0
    assert "859,520,964" in out and "55.7 %" in out


@pytest.mark.parametrize(
    "name, role",
    [
        ("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight", "self_attention"),
        ("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_q.weight", "cross_attention.query"),
        ("up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_v.weight", "cross_attention.key_value"),
        ("mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.bias", "cross_attention.output"),
        ("mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight", "mlp"),
        ("mid_block.attentions.0.transformer_blocks.0.norm3.weight", "norm"),
        ("mid_block.attentions.0.norm.bias", "norm"),
        ("up_blocks.3.attentions.0.proj_out.weight", "proj"),
        ("mid_block.resnets.1.conv_shortcut.weight", "resnet"),
        ("up_blocks.0.upsamplers.0.conv.weight", "sampler"),
        ("add_embedding.linear_1.weight", "time_embedding"),
        ("conv_norm_out.weight", "io"),
    ],
)
def test_parameter_roles(name, role):
    assert parameter_role(name) == role


# --- checkpoints in both layouts, counted from the header and from the module ------------------


@pytest.mark.parametrize("preset", ["tiny", "sdxl"])
def test_original_names_match_diffusers_converter(preset):
    unet = build_unet(preset_config(preset))
    state = unet.state_dict()
    back = convert_ldm_unet_checkpoint(original_state_dict(unet, state), dict(unet.config))
    assert set(back) == set(state)
    assert all(back[k] is v for k, v in state.items())


@pytest.mark.parametrize("preset", PRESETS)
def test_our_original_layout_mapping_is_diffusers_converter(preset):
    config = preset_config(preset)
    names = module_index(build_unet(config))
    original = diffusers_to_original_names(names, config["layers_per_block"])
    ours = original_to_diffusers_names(original.values())
    theirs = convert_ldm_unet_checkpoint({ORIGINAL_UNET_PREFIX + o: o for o in original.values()}, config)
    assert ours == {d: o for d, o in theirs.items() if o is not None}
    assert set(ours) == set(names)


def test_header_audit_imports_neither_torch_nor_diffusers(tiny_files):
    import subprocess
    import sys

    code = (
        "import sys; from sdkit.cli import main; rc = main(['audit', sys.argv[1], '--json']); "
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'safetensors') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    for name in ("original.safetensors", "diffusers.safetensors", "pipeline"):
        run = subprocess.run([sys.executable, "-c", code, str(tiny_files / name)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["total"] == 4_494_500


def test_original_names_are_the_compvis_names():
    names = set(original_state_dict(build_unet(preset_config("sd15"))))
    for key in [
        "time_embed.0.weight",
        "input_blocks.0.0.weight",
        "input_blocks.1.0.in_layers.2.weight",
        "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
        "input_blocks.3.0.op.weight",
        "input_blocks.4.0.skip_connection.weight",
        "middle_block.1.proj_in.weight",
        "middle_block.2.emb_layers.1.weight",
        "output_blocks.2.1.conv.weight",
        "output_blocks.5.2.conv.weight",
        "output_blocks.11.1.transformer_blocks.0.ff.net.2.bias",
        "out.0.weight",
        "out.2.bias",
    ]:
        assert ORIGINAL_UNET_PREFIX + key in names


@pytest.mark.parametrize("name", ["original.safetensors", "diffusers.safetensors", "pipeline"])
def test_header_counts_equal_module_counts(tiny_files, tiny_unet, name):
    from_header = audit(tiny_files / name)
    from_module = audit_module(load_unet(tiny_files / name))
    weights = tiny_files / name
    if weights.is_dir():
        weights = weights / "unet" / "diffusion_pytorch_model.safetensors"
    with open(weights, "rb") as f:
        assert from_header.bytes_read == 8 + int.from_bytes(f.read(8), "little")  # the header, no more
    for a in (from_header, from_module):
        assert a.total == 4_494_500
        assert a.roles == audit_module(tiny_unet).roles
        assert a.levels == audit_module(tiny_unet).levels
        assert a.attention_blocks == audit_module(tiny_unet).attention_blocks


def test_single_file_components(tiny_files):
    a = audit(tiny_files / "original.safetensors")
    assert a.layout == "original"
    assert a.components["unet"] == {"params": 4_494_500, "bytes": 4 * 4_494_500, "dtypes": {"F32": 4_494_500}}
    assert a.components["vae"] == {"params": 288, "bytes": 576, "dtypes": {"F16": 288}}
    assert a.components["text_encoder"]["params"] == 768


@pytest.mark.parametrize("name", ["original.safetensors", "diffusers.safetensors", "pipeline", "original.ckpt"])
def test_loaded_unet_is_the_saved_one(tiny_files, tiny_unet, name):
    loaded = load_unet(tiny_files / name, allow_pickle=True)
    torch.manual_seed(0)
    x, text = torch.randn(1, 4, 16, 16), torch.randn(1, 5, 768)
    with torch.no_grad():
        assert torch.equal(loaded(x, 10, text).sample, tiny_unet(x, 10, text).sample)


def test_pickle_needs_the_flag(tiny_files, cli):
    code, _, err = cli("audit", tiny_files / "original.ckpt")
    assert code == 2 and "--allow-pickle" in err
    code, out, _ = cli("audit", tiny_files / "original.ckpt", "--allow-pickle", "--json")
    assert code == 0 and json.loads(out)["total"] == 4_494_500


def _bad_inputs(root, good):
    data = good.read_bytes()
    (root / "short.safetensors").write_bytes(data[:-100])
    (root / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    broken = bytearray(data)
    broken[8:30] = b"[" * 22
    (root / "corrupt.safetensors").write_bytes(bytes(broken))
    from safetensors.torch import save_file

    save_file({"first_stage_model.encoder.conv_in.weight": torch.zeros(2, 2)}, root / "vae_only.safetensors")
    return {
        "missing.safetensors": "no such file",
        "short.safetensors": "truncated",
        "garbage.safetensors": "corrupt safetensors header",
        "corrupt.safetensors": "corrupt safetensors header",
        "vae_only.safetensors": "no U-Net",
        "sd99": "no such file or folder",
    }


def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_files, cli):
    for name, message in _bad_inputs(tmp_path, tiny_files / "original.safetensors").items():
        target = name if name == "sd99" else tmp_path / name
        code, out, err = cli("audit", target)
        assert code == 2, name
        assert message in err, (name, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert str(target) in err
    code, _, err = cli("audit", "sd15", "--context-dim", "wide")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--context-dim" in err


def test_paper_table_columns_add_up_in_every_format():
    import csv
    import io

    from sdkit.audit import PAPER_COLUMNS, paper_rows, paper_table

    audits = [audit(name) for name in ("sd15", "sd21", "sdxl")]
    for row in paper_rows(audits):
        values = dict(zip(PAPER_COLUMNS, row))
        assert (
            values["MLP"] + values["self-attn"] + values["cross-attn"] + values["norm"] + values["proj"]
            == values["in blocks"]
        )
        assert values["% of U-Net"] == pytest.approx(100 * values["in blocks"] / values["U-Net params"])
    assert [r[1] for r in paper_rows(audits)] == [512, 768, 1024]  # each at its native size
    parsed = list(csv.reader(io.StringIO(paper_table(audits, "csv"))))
    assert parsed[0] == list(PAPER_COLUMNS) and parsed[1][2] == str(SD15_TOTAL) and parsed[1][6] == "148797120"
    latex = paper_table(audits, "latex")
    assert latex.count(r"\\") == 4 and "148{,}797{,}120" in latex and r"\toprule" in latex
    markdown = paper_table(audits).splitlines()
    assert len(markdown) == 5 and "859,520,964" in markdown[2]
