"""Build hook: a wheel records the commit it was built from.

An installed wheel lives outside any git checkout, so ``modbench.track.provenance`` cannot ask git
which commit the code is; it reads ``modbench/BUILD_COMMIT``, written here at build time (the
commit, ``-dirty`` when tracked files had uncommitted changes). Everything else is in pyproject.toml.
"""

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_commit() -> str:
    """This source tree's commit, as ``provenance.git_sha`` writes it; ``unknown`` outside git
    (an sdist unpacked elsewhere)."""
    sha = _git("rev-parse", "HEAD")
    if not sha or _git("ls-files", "--error-unmatch", "pyproject.toml") is None:
        return "unknown"
    return sha + "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else sha


class BuildPyWithCommit(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "modbench" / "BUILD_COMMIT"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(build_commit() + "\n")


setup(cmdclass={"build_py": BuildPyWithCommit})
