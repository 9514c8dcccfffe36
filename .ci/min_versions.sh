#!/usr/bin/env bash
# The statistics path (scipy statistics, pandas tables, the sanity baselines) at the lowest
# versions pyproject.toml allows, so a floor that no longer works fails CI instead of a user.
# The floors below must equal pyproject.toml's; tests/test_packaging.py checks that they do.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/min
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "numpy==1.26.*" "scipy==1.15.*" "pandas==2.2.*" "zstandard==0.22.*" \
    "tabulate==0.9.*" "matplotlib==3.8.*" "statsmodels==0.14.5" "pytest>=8" "hypothesis>=6"
"$venv/bin/pip" install --quiet --no-deps -e .
# No conftest (it imports torch, which this path does not need) and no pytest-benchmark flags.
"$venv/bin/python" -m pytest -q --noconftest -o addopts="" -p no:cacheprovider tests/test_stats.py tests/test_effects.py
rm -rf "$(dirname "$venv")"
