#!/usr/bin/env bash
# Idempotent set-up in .venv, quiet when everything is there:
#   ./setup.sh          the demo's packages (requirements.txt: NumPy, ml_dtypes, tokenizers; about 150 MB)
#   ./setup.sh --tests  and the test suite's (requirements-test.txt: torch's CPU build, triton,
#                       transformers, hypothesis...; about 2 GB)
# Every version comes from constraints.txt (the lock). Then the bundled tiny checkpoints tiny-v32/ and
# tiny-v4/ (DeepSeek-V4-Flash), built deterministically (seed 0; the same bytes on any CPU).
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") want=requirements.txt ;;
  --tests) want=requirements-test.txt ;;
  *) echo "usage: ./setup.sh [--tests]" >&2; exit 2 ;;
esac
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "setup: needs Python 3.11 or newer as python3 (found $(python3 --version 2>&1))" >&2; exit 1; }

installed() {  # is $1 installed with today's requirements and lock? (--tests covers the demo too)
  for f in "$1" requirements-test.txt; do
    cat "$f" requirements.txt constraints.txt | cmp -s - ".venv/.installed-$f" && return 0
    [ "$1" = requirements-test.txt ] && return 1
  done
  return 1
}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment .venv" >&2
  python3 -m venv .venv
fi
if ! installed "$want"; then
  echo "setup: installing $want into .venv (exact versions from constraints.txt); pip's progress follows" >&2
  # pip's own lines show the progress; "already satisfied" lines are dropped
  set +o pipefail
  .venv/bin/pip install --disable-pip-version-check -r "$want" -c constraints.txt 2>&1 |
    grep --line-buffered -v -e '^Requirement already satisfied' -e 'neither a file nor a directory' >&2
  status=${PIPESTATUS[0]}
  set -o pipefail
  [ "$status" -eq 0 ] || { echo "setup: pip failed (exit $status); nothing was recorded as installed" >&2; exit "$status"; }
  cat "$want" requirements.txt constraints.txt > ".venv/.installed-$want"
  echo "setup: .venv is ready" >&2
fi
if [ ! -f tiny-v32/config.json ] || [ ! -f tiny-v32/.dsa-ref-checkpoint ]; then
  .venv/bin/python checkpoint.py tiny-v32           # built before the marker: other bf16 bytes, rebuilt
fi
if [ ! -f tiny-v4/config.json ] || [ ! -f tiny-v4/.dsa-ref-checkpoint ]; then
  .venv/bin/python checkpoint.py tiny-v4 --v4
fi
