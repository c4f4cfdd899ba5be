"""Ship a trained latent mini SD as weights/minisd-latent, its text encoder's weights a link.

    python scripts/ship_latent.py out/latent [--out weights/minisd-latent]

A stock StableDiffusionPipeline folder must hold its text encoder, and all-MiniLM-L6-v2's weights
are 90 MB that `scripts/get_real_encoders.py` already fetches into weights/encoders. The shipped
folder keeps the encoder's config (which says use_attention_mask) and tokenizer (24 positions),
and its text_encoder/model.safetensors is a relative link to the fetched weights, once they are
checked to be the same tensors. Fetch the encoders first; then diffusers loads the folder offline.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sdkit.encoders import load_text_encoder  # noqa: E402
from sdkit.minisd.pipeline import MiniSDPipeline  # noqa: E402

WEIGHTS = "model.safetensors"


def main() -> None:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a latent mini SD folder (sdkit minisd train --vae wrote it)")
    parser.add_argument("--out", default="weights/minisd-latent")
    parser.add_argument("--encoders-dir", default="weights/encoders")
    args = parser.parse_args()
    pipe = MiniSDPipeline.from_pretrained(args.model)
    if pipe.spec.space != "latents":
        sys.exit(f"{args.model}: not a latent mini SD")
    pipe.save_pretrained(args.out)
    fetched = Path(args.encoders_dir) / pipe.spec.text_encoder
    ours, theirs = load_text_encoder(args.out).model.state_dict(), load_text_encoder(fetched).model.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        sys.exit(f"{args.out}: its text encoder's weights are not {fetched}'s; not linked")
    link = Path(args.out) / "text_encoder" / WEIGHTS
    link.unlink()
    link.symlink_to(os.path.relpath(fetched / WEIGHTS, link.parent))
    linked = load_text_encoder(args.out).model.state_dict()
    assert all(torch.equal(linked[k], theirs[k]) for k in theirs)
    print(f"wrote {args.out}; {link} -> {os.readlink(link)}")


if __name__ == "__main__":
    main()
