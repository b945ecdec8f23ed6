#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with requirements.txt, and the bundled tiny
# checkpoint in tiny-v32/ (built deterministically from seed 0). Quiet when everything is there.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ] || ! cmp -s requirements.txt .venv/.requirements; then
  echo "setup: creating .venv and installing requirements.txt" >&2
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  cp requirements.txt .venv/.requirements
fi
if [ ! -f tiny-v32/config.json ]; then
  .venv/bin/python checkpoint.py tiny-v32
fi
