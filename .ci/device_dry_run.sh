#!/usr/bin/env bash
# CI job: the dry run of the GPU visit (benchmarks/device_visit.sh --dry-run) on the CPU, in
# an environment like the GPU machine's (../shared/DEVICE.md): Python 3.12 (tokamax's wheels
# are for cp312) with its jax 0.11.2, flax 0.12.10, optax, pytest with xdist and
# pytest-benchmark, and matplotlib (for ops' plot); tokamax and its small dependencies from
# wheels/ (benchmarks/device_wheels.sh), installed by the visit itself with pip --no-index
# --no-deps --target, as there. The same steps in the same order at the smallest sizes: a
# script error that would lose a visit fails here. Then what came back is checked: the
# report, its plot, the log, and no folder of this machine in any of them; the same for the
# visit's second call (--tune: the Mosaic GPU kernels under each sizing, interpreted here).
# The environment lives in $RMSNORM_JAX_VISIT_VENV (default: a folder under $TMPDIR, outside
# the checkout) and is made anew by `install`; `test` runs the dry run (.ci/run installs
# while its first job tests, and runs this beside the other jobs).
#   .ci/device_dry_run.sh [install|test]
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv=${RMSNORM_JAX_VISIT_VENV:-${TMPDIR:-/tmp}/rmsnorm_jax-visit}
phase=${1:-all}
# As the GPU machine has them (DEVICE.md, 2026-11-25); pytest-benchmark is there too.
MACHINE=("jax==0.11.2" "jaxlib==0.11.2" "flax==0.12.10" optax pytest pytest-xdist
  pytest-benchmark matplotlib)

if [ "$phase" != test ]; then
  rm -rf "$venv"
  PYENV_VERSION=3.12.1 python3.12 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "${MACHINE[@]}"
  benchmarks/device_wheels.sh
  echo "=== installed in $((SECONDS - start)) s"
fi
if [ "$phase" != install ]; then
  out=$(mktemp -d)
  BENCHMARKS_COMMIT=${BENCHMARKS_COMMIT:-$(git rev-parse --short HEAD)} PYTHON="$venv/bin/python" \
    benchmarks/device_visit.sh --dry-run "$out"
  tuned=$(mktemp -d)
  BENCHMARKS_COMMIT=${BENCHMARKS_COMMIT:-$(git rev-parse --short HEAD)} PYTHON="$venv/bin/python" \
    benchmarks/device_visit.sh --dry-run --tune "$tuned"
  for name in log.txt cpu-measured.md cpu-measured.json cpu-measured.png; do
    [ -s "$out/$name" ] || { echo "the dry run wrote no $name"; exit 1; }
  done
  "$venv/bin/python" - "$out" "$tuned" << 'EOF'
import json, pathlib, re, sys

out, tuned = map(pathlib.Path, sys.argv[1:])
sections = json.loads((out / "cpu-measured.json").read_text())["sections"]
assert set(sections) == {"ops", "step", "gemma"}, set(sections)
rows = {(r["impl"], r["status"]) for r in sections["ops"]["results"]}
assert ("tokamax layer_norm [xla]", "ok") in rows, "tokamax's XLA path was not measured"
sweep = tuned / "kernel-sizes-mosaic_gpu-cpu-256.json"
for shape, timed in json.loads(sweep.read_text())["rows"].items():
    failed = {k: v.get("note") for k, v in timed.items() if "median_s" not in v}
    assert not failed and len(timed) == 6, (shape, failed, list(timed))
machine = re.compile(r"(?<![\w.])/(?:tmp|work|root|home|Users|opt|mnt|var|usr)/")
for path in [out / "log.txt", out / "cpu-measured.md", out / "cpu-measured.json",
             tuned / "log.txt", sweep]:
    found = machine.search(path.read_text())
    assert not found, f"{path.name} names a folder of this machine: {found.group()}"
print("the dry runs' reports, plot, sweep and logs: checked")
EOF
  rm -rf "$out" "$tuned"
  echo "=== the dry run and its checks took $((SECONDS - start)) s"
fi
