"""Training over several processes (accelerate) against one process on the same global batch.

Two processes cannot give one process's weights bit for bit: each process sums its half of the
batch, then the all-reduce adds the halves, so the float sums run in another order (about 1e-7
relative per gradient element). Adam then amplifies that rounding wherever a gradient element is
near zero: its first update is lr x g / (|g| + eps), about lr x sign(g), so an element whose
gradient is rounding noise moves by +lr in one run and -lr in the other. Such elements are few, and
the rest of the update is the same. So the tests measure the distance between the two runs'
weights against a control, what a wrong split or a missing all-reduce would give: the same run
trained on one process's half of the batch alone:

    || weights(2 processes) - weights(1 process) || / || weights(half the batch) - weights(1 process) ||

Measured here (4 steps of the mini SD, float32): about 4e-5, while single elements differ by up to
8e-4 of their tensor's largest weight (the 1e-3 once seen). The tolerance, 1e-3, is 25x over float
order and still a thousandth of the control; -s prints the numbers.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TOLERANCE = 1e-3


def test_two_processes_split_every_batch_exactly(bert):
    """Two processes' shares of a step's batch are the one-process batch cut in two: the same images,
    captions, noise and timesteps (drawn per process, the noise was another batch's)."""
    from sdkit.minisd.data import all_captions
    from sdkit.minisd.train import TrainSettings, batch_at, encode_captions

    settings = TrainSettings(batch_size=8, context_length=bert.max_length)
    captions = encode_captions(bert, ["", *all_captions()], None, progress=False)
    for step in (0, 7):
        whole = batch_at(step, settings, captions)
        halves = [batch_at(step, settings, captions, process, 2) for process in (0, 1)]
        for k in ("pixels", "states", "noise", "timesteps", "masks"):
            assert torch.equal(getattr(whole, k), torch.cat([getattr(h, k) for h in halves]))
        assert whole.captions == halves[0].captions + halves[1].captions


def distance(first: dict, second: dict) -> float:
    return sum(float((first[k] - second[k]).pow(2).sum()) for k in first) ** 0.5


def launch(argv: list[str], processes: int) -> None:
    """sdkit on `processes` CPU processes, as torchrun starts them (accelerate launch --cpu runs one
    process unless MPI is there; on GPUs, accelerate launch --multi_gpu is the same torchrun)."""
    command = [sys.executable, "-m", "sdkit.cli", *argv]
    env = dict(ENV)
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--standalone",
            *command[1:],
        ]
        env["ACCELERATE_USE_CPU"] = "true"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_minisd_trains_on_two_processes_as_on_one(tmp_path):
    from safetensors.torch import load_file

    from sdkit.encoders import write_tiny_bert_encoder

    encoder = write_tiny_bert_encoder(tmp_path / "encoder", width=384)
    common = [
        "minisd",
        "train",
        "--text-encoder",
        str(encoder),
        "--steps",
        "4",
        "--precision",
        "fp32",
        "--no-compile",
        "--cache",
        str(tmp_path / "cache"),
        "--json",
    ]
    launch([*common, "--batch-size", "8", "--out", str(tmp_path / "one")], 1)
    launch([*common, "--batch-size", "8", "--out", str(tmp_path / "two")], 2)
    launch([*common, "--batch-size", "4", "--out", str(tmp_path / "half")], 1)  # the control: half the batch
    assert json.loads((tmp_path / "two" / "minisd.json").read_text())["training"]["processes"] == 2

    def weights(name):
        return load_file(tmp_path / name / "unet" / "diffusion_pytorch_model.safetensors")

    one, two, half = weights("one"), weights("two"), weights("half")
    split, control = distance(two, one), distance(half, one)
    largest = max(float((two[k] - one[k]).abs().max() / one[k].abs().max()) for k in one)
    print(
        f"\nmini SD, 4 steps: |2 processes - 1| {split:.3e}, |half the batch on 1 - 1| {control:.3e}, ratio "
        f"{split / control:.1e} (largest element difference over its tensor's largest weight {largest:.1e})"
    )
    assert split < TOLERANCE * control


@pytest.mark.slow
def test_adapter_trains_on_two_processes_as_on_one(tmp_path, tiny_pair):
    """The same for `sdkit adapter train`, read from its validation error after every epoch. The
    prompts give 2,156 training tokens, which 44 a step (22 a process) divide: an uneven last batch
    is padded by accelerate with repeated tokens, another batch than one process's."""
    new, old = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(
            f"a {c} {a} on a {p}"
            for c in ("red", "blue", "green", "white")
            for a in ("cat", "dog", "bird")
            for p in ("mat", "hill", "table")
        )
    )
    common = [
        "adapter",
        "train",
        "--new",
        new.source,
        "--old",
        old.source,
        "--corpus",
        str(prompts),
        "--kinds",
        "mlp",
        "--epochs",
        "3",
        "--judge",
        "0",
        "--json",
    ]
    launch([*common, "--batch-size", "44", "--out", str(tmp_path / "one")], 1)
    launch([*common, "--batch-size", "22", "--out", str(tmp_path / "two")], 2)  # a step: 2 processes x 22
    launch([*common, "--batch-size", "22", "--out", str(tmp_path / "half")], 1)  # the control
    reports = {name: json.loads((tmp_path / name / "report.json").read_text()) for name in ("one", "two", "half")}
    assert reports["one"]["tokens"]["train"] == 2156

    def curve(name, key):
        return torch.tensor([h[key] for h in reports[name]["histories"]["mlp"][1:]])

    def difference(name, key):
        return float(((curve(name, key) - curve("one", key)).abs() / curve("one", key)).max())

    split = max(difference("two", key) for key in ("val_rel_mse", "train_loss"))
    control = difference("half", "val_rel_mse")
    print(
        f"\nadapter, 3 epochs: 2 processes vs 1, largest relative difference of the loss curves {split:.2e}; "
        f"half the batch on 1: {control:.2e}"
    )
    assert split < TOLERANCE and control > 0.01
