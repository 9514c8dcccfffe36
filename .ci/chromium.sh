#!/usr/bin/env bash
# Install headless Chromium and its WebDriver from Debian's packages (if missing), for the
# MLflow UI browser test (tests/test_mlflow_ui.py), which fails rather than skips under CI.
# Selenium is given both paths, so it never downloads a driver. Used by .ci/run.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2
fi
echo "$(chromium --version 2>/dev/null | head -n 1); $(chromedriver --version | head -n 1)"
