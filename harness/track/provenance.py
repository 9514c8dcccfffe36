"""Where a run came from: the git commit of this checkout and the software it ran on.

Logged as MLflow tags on every run and printed at the bottom of every report, so a number can
always be traced to the code that produced it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import subprocess
import sys
from pathlib import Path

from modbench import __version__

_PKG_DIR = Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args],
            cwd=_PKG_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_sha() -> str:
    """Commit of the repository containing this package, ``-dirty`` when tracked files
    have uncommitted changes. Outside a git checkout (a wheel installed into a virtualenv, which
    may even sit inside some other repository) the commit the wheel was built from, which the
    build wrote into ``BUILD_COMMIT`` (setup.py); ``unknown`` when neither says."""
    sha = _git("rev-parse", "HEAD")
    if not sha or _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return build_commit()
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha + "-dirty" if status else sha


def build_commit() -> str:
    """The commit an installed wheel was built from (``modbench/BUILD_COMMIT``), else ``unknown``."""
    try:
        return (_PKG_DIR.parent / "BUILD_COMMIT").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def environment_tags() -> dict[str, str]:
    """Tags describing where a run came from: git sha, torch/python/modbench versions,
    platform and hostname."""
    return {
        "git_sha": git_sha(),
        "torch_version": torch_version(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "modbench_version": __version__,
        "hostname": socket.gethostname(),
    }


def torch_version() -> str:
    """``torch.__version__`` (``2.13.0+cpu``), read from the installed distribution when torch is
    not imported yet: importing it takes seconds, which the tracker process must not spend."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - torch is a hard dependency
        return "unavailable"
