#!/usr/bin/env bash
# What tests/kernel/test_jupyterlab.py needs on a fresh Debian machine (run as root, from anywhere):
# Debian's chromium, and playwright + jupyterlab in the project's .venv. Idempotent and quiet.
# Playwright drives /usr/bin/chromium; `playwright install` (a browser download) is never needed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! [ -x /usr/bin/chromium ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi

PY=.venv/bin/python
[ -x "$PY" ] || { echo "install-browser.sh: $PY missing; create the venv first (.ci/run step 1)" >&2; exit 1; }
if ! "$PY" -c "import playwright, jupyterlab" 2>/dev/null; then
    "$PY" -m pip install -q -c .ci/constraints.txt playwright jupyterlab
fi
