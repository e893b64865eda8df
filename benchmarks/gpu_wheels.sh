#!/usr/bin/env bash
# Fetch the wheels in benchmarks/gpu_wheels.txt into .whl/ for the GPU machine (no network there).
# Run from the repo root:  bash benchmarks/gpu_wheels.sh      (PYVER=3.11 to rehearse on 3.11)
# Then call the device tool with carry [".whl"] and start its command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# (for dist_kernel itself add the repo root: export PYTHONPATH=/tmp/site:$PWD)
set -euo pipefail

PYVER="${PYVER:-3.12}"
PYTHON="${PYTHON:-python3}"
LIST="benchmarks/gpu_wheels.txt"
DEST=".whl"

[ -f "$LIST" ] || { echo "run from the repo root ($LIST not found)" >&2; exit 1; }

# keep the wheels out of git
mkdir -p .git/info
touch .git/info/exclude
grep -qxF '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude

mapfile -t REQS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
echo "downloading ${#REQS[@]} wheels for cp${PYVER/./} into $DEST/"

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
# extra manylinux_2_N tags if a wheel is not found: EXTRA_PLATFORMS="manylinux_2_31_x86_64 manylinux_2_34_x86_64"
for p in ${EXTRA_PLATFORMS:-}; do PLATFORMS+=("$p"); done
PLAT_ARGS=()
for p in "${PLATFORMS[@]}"; do PLAT_ARGS+=(--platform "$p"); done

"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLAT_ARGS[@]}" -d "$DEST" "${REQS[@]}"

# exactly one wheel per listed package, of the listed version, and nothing else in .whl/
"$PYTHON" - "$DEST" "${REQS[@]}" <<'PY'
import re, sys
from pathlib import Path
dest, reqs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
want = {norm(n): v for n, v in (r.split("==", 1) for r in reqs)}
have = {}
for w in sorted(dest.glob("*.whl")):
    name, ver = w.name.split("-")[:2]
    have.setdefault(norm(name), []).append((ver, w))
bad = []
for n, v in want.items():
    got = have.get(n, [])
    if len(got) != 1:
        bad.append(f"{n}: {len(got)} wheels {[g[1].name for g in got]}")
    elif got[0][0] != v:
        bad.append(f"{n}: wheel {got[0][1].name} is not version {v}")
bad += [f"not in the list: {g[1].name}" for n, gs in have.items() if n not in want for g in gs]
if [f for f in dest.iterdir() if f.suffix != ".whl"]:
    bad.append(f"non-wheel files in {dest}/")
if bad:
    sys.exit("gpu_wheels: " + "\n  ".join(["problems in " + str(dest) + "/:"] + bad))
total = sum(w.stat().st_size for w in dest.glob("*.whl"))
print(f"{len(want)} packages, one wheel each; total {total / 2**20:.1f} MiB in {dest}/")
PY
