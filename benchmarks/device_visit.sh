#!/usr/bin/env bash
# One visit to a lent GPU (../shared/DEVICE.md's runbook) in one call, from the repository
# root, with wheels/ (benchmarks/device_wheels.sh) carried:
#   BENCHMARKS_COMMIT=$(git rev-parse --short HEAD) benchmarks/device_visit.sh "$OUT"
# and its dry run on a CPU (CI: .ci/device_dry_run.sh), the same steps in the same order at
# the smallest sizes, which stops at the first step that fails:
#   PYTHON=VENV/bin/python benchmarks/device_visit.sh --dry-run OUT
# With --tune (a second call on the same GPU, at once after a visit whose kernel tests
# passed, where 4 minutes of device time are left): the Mosaic GPU kernels alone under each
# sizing choice (python -m benchmarks.kernel_sizes --backend mosaic_gpu), ending by 210 s;
# its reports are OUT/kernel-sizes-mosaic_gpu-<device>-<widths>.json.
# The steps: tokamax and its small dependencies installed beside the machine's jax (pip
# --no-index --no-deps --target, on PYTHONPATH; a stub for xprof), tokamax imported, the
# kernel tests (on the GPU the only check of the kernels' real lowering), then `ops` (ours
# against tokamax and every peer, and its plot where matplotlib is installed), `step` and
# `gemma`. Each step must end by its own time from the start (the first number of its `run`
# line; the dry run's are SCALE times later), so the visit ends by 490 s (+10 s to kill a
# step that ignores the timeout) whatever a step does. The visit goes on past a failed step,
# the log saying so, and exits 1 at the end if one failed. All output in OUT/log.txt, the
# reports in OUT/<device>-measured.md, .json and .png, written through a link named RESULTS
# so that each records `--out RESULTS`; nothing in OUT names a folder of the machine.
set -uo pipefail
dry=0 tune=0
while [ "${1:-}" = --dry-run ] || [ "${1:-}" = --tune ]; do
  [ "$1" = --dry-run ] && dry=1
  [ "$1" = --tune ] && tune=1
  shift
done
out=$(cd "${1:?usage: benchmarks/device_visit.sh [--dry-run] [--tune] OUT}" && pwd)
python=${PYTHON:-python3}
site=$(mktemp -d)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=".:$site"
log=$out/log.txt
norms="rms_norm,rms_norm [xla],rms_norm [pallas],gemma's own"
step_norms="rms_norm,rms_norm [xla],rms_norm [pallas],add_rms_norm [xla],add_rms_norm [pallas]"
mapfile -t tests < <(find tests -name test_residual_rounding.py -o -name test_add_and_gated.py)
tests=(tests/kernels "${tests[@]}")

# What the dry run changes: the sizes, the tests' selection, the clock; never the steps.
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu
  size=(--quick) ops_size=() widths=() workers=2 scale=6 mode=", dry run on the CPU"
  tests+=(-k "mosaic_gpu and (bad_arguments or 37-64-float32)")
else
  # ops at x of 32 MiB alone: both sizes (its default) take twice as long (README.md)
  size=(--rounds 3) ops_size=(--sizes 32) workers=8 scale=1 mode=""
  widths=(--widths 128 1024 2048 4096 8192 16384)
fi

failed=()
run() { # run ENDS_BY COMMAND...: the command, stopped ENDS_BY (x SCALE) s after the start
  local limit=$(($1 * scale - SECONDS)) status=0
  shift
  if [ "$limit" -lt 10 ]; then
    echo "=== $* skipped: out of time at $SECONDS s"
    status=124
  else
    echo "=== $* (timeout $limit s)"
    timeout -k 10 "$limit" "$@" 2>&1 || status=$?
    echo "=== exit $status after $SECONDS s"
  fi
  if [ "$status" != 0 ]; then
    failed+=("$(cut -c1-60 <<< "${*:2:3}") (exit $status)")
    if [ "$dry" = 1 ]; then
      echo "=== dry run: stopped at this failed step"
      exit "$status"
    fi
  fi
}
stub_xprof() { # tokamax imports xprof (100 MB) for its own benchmarking only
  if ! "$python" -c "import xprof.cli.tools.get_kernel_stats_tool" 2> /dev/null; then
    mkdir -p "$site/xprof/cli/tools"
    echo "def get_kernel_stats(*a, **k): raise NotImplementedError('xprof stub')" \
      > "$site/xprof/cli/tools/get_kernel_stats_tool.py"
    echo "=== xprof: a stub where it is missing"
  fi
}
visit() {
  echo "=== tree at ${BENCHMARKS_COMMIT:-$(git rev-parse --short HEAD)}," \
    "$("$python" --version 2>&1)$mode"
  timeout 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 ||
    echo "no nvidia-smi"
  if [ "$tune" = 1 ]; then
    run 210 "$python" -m benchmarks.kernel_sizes --backend mosaic_gpu "${size[@]}" \
      "${widths[@]}" --out RESULTS
    finish
    return
  fi
  run 30 "$python" -m pip install --quiet --no-index --no-deps --target "$site" wheels/*.whl
  stub_xprof
  run 45 "$python" -c "import jax, tokamax; print('jax', jax.__version__, \
jax.devices()[0].device_kind, 'tokamax', tokamax.__version__, tokamax.__file__)"
  run 120 "$python" -m pytest -q -p no:benchmark -p no:cacheprovider -n "$workers" "${tests[@]}"
  run 250 "$python" -m benchmarks ops "${size[@]}" "${ops_size[@]}" --out RESULTS
  run 370 "$python" -m benchmarks step "${size[@]}" --dtypes bfloat16 --norms "$step_norms" \
    --out RESULTS
  run 490 "$python" -m benchmarks gemma "${size[@]}" --modes scan,unrolled --norms "$norms" \
    --out RESULTS
  finish
}
finish() {
  if [ "${#failed[@]}" != 0 ]; then
    printf "=== failed: %s\n" "${failed[@]}"
    exit 1
  fi
  echo "=== every step passed, in $SECONDS s"
}

if [ -e RESULTS ] && [ ! -L RESULTS ]; then
  echo "RESULTS is in the way (the link this script makes to OUT): move it" >&2
  exit 2
fi
ln -sfn "$out" RESULTS
visit 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
rm -f RESULTS "$out"/*.part  # a report's half-written copy, left by a step's timeout
# Nothing that comes back names a folder of this machine.
prefix=$("$python" -c "import sys; print(sys.prefix)" 2> /dev/null | tail -n 1)
for file in "$log" "$out"/*.md "$out"/*.json; do
  [ -f "$file" ] || continue
  sed -i -e "s#$PWD/##g" -e "s#$site#SITE#g" -e "s#$out#RESULTS#g" "$file"
  [ -z "$prefix" ] || sed -i -e "s#$prefix#PYTHON#g" "$file"
  sed -i -E 's#/(tmp|root|home|opt|usr|work)/[^ :,"'"'"')]*#<path>#g' "$file"
done
rm -rf "$site"
exit "$status"
