#!/usr/bin/env bash
# Build DeepSpeed's shared-memory op (the one it JIT-compiles for gloo on CPU) into this venv's own
# extension cache, where tests/kernel/test_ecosystem_torch.py and benchmarks/torch_train.py point
# TORCH_EXTENSIONS_DIR: part of setting up, like the install. Without it a fresh machine compiles the
# op inside the DeepSpeed test, 28 s alone and over 100 s beside the lane's other workers (issue 37).
# Idempotent: a built op is loaded from the cache in a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "build-deepspeed-op.sh: $PY missing; create the venv first (.ci/run step 1)" >&2; exit 1; }
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$("$PY" -c 'import os, sys; print(os.path.join(sys.prefix, "torch_extensions"))')}"
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
"$PY" -c "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None, 'DeepSpeed built no shm op'" \
    >/dev/null
