#!/usr/bin/env bash
# Idempotent set-up in .venv, quiet when everything is there. Five levels, each including the ones above:
#   ./setup.sh          the demo: NumPy, ml_dtypes, tokenizers (requirements.txt; about 150 MB)
#   ./setup.sh --serve  the OpenAI-compatible server serve.py: Starlette, uvicorn (requirements-serve.txt; a few MB)
#   ./setup.sh --torch  the torch backend on the CPU: torch's CPU build, no CUDA wheels (requirements-torch.txt)
#   ./setup.sh --views  the teaching views: matplotlib (requirements-views.txt)
#   ./setup.sh --tests  the test suite: Triton, transformers, hypothesis... (requirements-test.txt; about 2 GB;
#                       torch as pip finds it: on a CUDA machine its CUDA build)
# Every version comes from constraints.txt (the lock). Then the bundled tiny checkpoints tiny-v32/ and
# tiny-v4/ (DeepSeek-V4-Flash), built deterministically (seed 0; the same bytes on any CPU).
set -euo pipefail
cd "$(dirname "$0")"
levels=(requirements.txt requirements-serve.txt requirements-torch.txt requirements-views.txt requirements-test.txt)
case "${1:-}" in
  "") level=0 ;;
  --serve) level=1 ;;
  --torch) level=2 ;;
  --views) level=3 ;;
  --tests) level=4 ;;
  *) echo "usage: ./setup.sh [--serve | --torch | --views | --tests]" >&2; exit 2 ;;
esac
want=${levels[$level]}
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "setup: needs Python 3.11 or newer as python3 (found $(python3 --version 2>&1))" >&2; exit 1; }

stamp() { cat "${levels[@]:0:$(($1 + 1))}" constraints.txt; }   # what level $1 installs, as text
installed() {  # is level $1, or a level above it, installed with today's requirements and lock?
  for ((i = $1; i < ${#levels[@]}; i++)); do
    stamp "$i" | cmp -s - ".venv/.installed-${levels[$i]}" && return 0
  done
  return 1
}
pip_quiet() {  # pip's own lines show the progress; "already satisfied" lines are dropped
  set +o pipefail
  .venv/bin/pip install --disable-pip-version-check "$@" 2>&1 |
    grep --line-buffered -v -e '^Requirement already satisfied' -e 'neither a file nor a directory' >&2
  local status=${PIPESTATUS[0]}
  set -o pipefail
  [ "$status" -eq 0 ] || { echo "setup: pip failed (exit $status); nothing was recorded as installed" >&2; exit "$status"; }
}
torch_cpu() {  # torch's CPU build, pinned: where pip's sources offer only a CUDA build, PyTorch's CPU index
  local version url
  version=$(grep -E '^torch==' constraints.txt | cut -d= -f3)
  .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null && return 0
  url=$(.venv/bin/pip install --disable-pip-version-check --dry-run --no-deps --quiet --report - "torch==$version" \
        2>/dev/null | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])' \
        2>/dev/null || true)
  if [[ "$url" == *cpu* ]]; then
    echo "setup: installing torch $version (CPU build)" >&2
    pip_quiet --no-deps "torch==$version"
  else
    echo "setup: installing torch $version's CPU build from PyTorch's CPU index (pip's own sources offer a CUDA build)" >&2
    pip_quiet --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==$version+cpu"
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment .venv" >&2
  python3 -m venv .venv
fi
if ! installed "$level"; then
  echo "setup: installing $want into .venv (exact versions from constraints.txt); pip's progress follows" >&2
  if [ "$want" = requirements-torch.txt ] || [ "$want" = requirements-views.txt ]; then torch_cpu; fi
  pip_quiet -r "$want" -c constraints.txt
  stamp "$level" > ".venv/.installed-$want"
  echo "setup: .venv is ready" >&2
fi
if [ ! -f tiny-v32/config.json ] || [ ! -f tiny-v32/.dsa-ref-checkpoint ]; then
  .venv/bin/python checkpoint.py tiny-v32           # built before the marker: other bf16 bytes, rebuilt
fi
if [ ! -f tiny-v4/config.json ] || [ ! -f tiny-v4/.dsa-ref-checkpoint ]; then
  .venv/bin/python checkpoint.py tiny-v4 --v4
fi
