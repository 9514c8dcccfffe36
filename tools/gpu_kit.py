"""Build the GPU study kit on a CPU machine: what a lent GPU machine lacks, in one folder that travels.

    python tools/gpu_kit.py KIT_DIR [--no-wheels]     # make gpu-kit

A lent GPU machine has Python 3.12, a CUDA torch, numpy, pandas, scipy, matplotlib, tqdm and rich,
no network, and neither Optuna nor SQLAlchemy. The kit folder holds:

- ``wheels/``: the wheels of the packages a study worker imports that the machine lacks
  (``PACKAGES``), at the versions installed here (so both machines run the same Optuna), for
  CPython 3.12 on manylinux x86-64, downloaded with ``pip download --only-binary=:all: --no-deps``
  (the dependencies the machine has are left out: the kit must stay far below the 64 MiB that
  travel). ``make gpu-study`` installs them there with ``pip install --no-index``.
- ``data/stdlib-<sha256>.bin``: this machine's ``stdlib`` corpus, named by its content's hash. A
  GPU machine's Python 3.12 library is other bytes; with ``$MODBENCH_STDLIB_FILE`` set to this
  file (``make gpu-study`` sets it) a GPU study and a CPU study of ``stdlib`` train and score on the
  same bytes, and the report's 4-gram bar is computed on the windows the arms were scored on.
- ``BUILD_COMMIT``: the commit (``-dirty`` when the tree has uncommitted changes) that the GPU copy
  reports as its git sha (the copy there is no git checkout).
- ``kit.json``: what is in the kit, with sizes and the corpus's sha256.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

# Imported by `modbench study run` (the runner, Optuna's SQLite storage) and absent on the GPU machine.
PACKAGES = ("optuna", "sqlalchemy", "alembic", "mako", "markupsafe", "colorlog", "pyyaml")
TARGET = ("--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform", "manylinux_2_28_x86_64",
          "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any")


def pins() -> list[str]:
    """``name==version`` of each package as installed in this environment."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]


def download_wheels(dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps", *TARGET,
               "-d", str(dest), *pins()]
    subprocess.run(command, check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def copy_corpus(dest: Path) -> dict[str, object]:
    from modbench.data import load_corpus, stdlib_file_name

    dest.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus("stdlib")
    source = Path(corpus.train.filename)  # the memmapped file the corpus was read from
    target = dest / stdlib_file_name(corpus.sha256)
    if not target.is_file():
        shutil.copyfile(source, target)
    return {"dataset": "stdlib", "file": target.name, "sha256": corpus.sha256, "bytes": target.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    from modbench.track.provenance import git_sha

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kit_dir", type=Path)
    parser.add_argument("--no-wheels", action="store_true", help="leave the wheels out (a CPU dry run has the packages)")
    args = parser.parse_args(argv)
    kit = args.kit_dir
    kit.mkdir(parents=True, exist_ok=True)
    wheels = [] if args.no_wheels else download_wheels(kit / "wheels")
    corpus = copy_corpus(kit / "data")
    commit = git_sha()
    (kit / "BUILD_COMMIT").write_text(commit + "\n")
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    info = {"commit": commit, "wheels": wheels, "pins": [] if args.no_wheels else pins(), "corpus": corpus,
            "bytes": size}
    (kit / "kit.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"gpu kit in {kit}: {len(wheels)} wheels, corpus {corpus['file']} ({corpus['bytes'] / 2**20:.1f} MiB), "
          f"commit {commit}, {size / 2**20:.1f} MiB in all")
    if commit.endswith("-dirty"):
        print("gpu kit: the tree has uncommitted changes: a report from this kit will say so; commit first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
