#!/usr/bin/env bash
# One visit to a lent GPU (../shared/DEVICE.md's runbook) in one call, from the repository
# root, with wheels/ (benchmarks/device_wheels.sh) carried:
#   BENCHMARKS_COMMIT=$(git rev-parse --short HEAD) benchmarks/device_visit.sh "$OUT"
# tokamax and its small dependencies installed beside the machine's jax (pip --no-index
# --no-deps --target, on PYTHONPATH), then: the kernel tests on the GPU, `ops` (ours against
# tokamax and every peer), `step`, `gemma`; each under its own timeout (under 9 minutes
# in all), all output in OUT/log.txt, the reports in OUT/<device>-measured.md and
# .json, written through a link named RESULTS so that each records `--out RESULTS`.
set -uo pipefail
out=$(cd "${1:?usage: benchmarks/device_visit.sh OUT}" && pwd)
python=${PYTHON:-python3}
site=$(mktemp -d)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=".:$site"
ln -sfn "$out" RESULTS
log=$out/log.txt
run() {  # run SECONDS COMMAND...: the command under a timeout, its output into the log
  local limit=$1
  shift
  echo "=== $* (timeout ${limit} s)"
  timeout "$limit" "$@" 2>&1
  echo "=== exit $? after $SECONDS s"
}
{
  echo "=== tree at ${BENCHMARKS_COMMIT:-$(git rev-parse --short HEAD)}, $($python --version)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $python -m pip install --quiet --no-index --no-deps --target "$site" wheels/*.whl
  # tokamax imports xprof (100 MB) for its own benchmarking only: a stub where it is missing.
  if ! $python -c "import xprof.cli.tools.get_kernel_stats_tool" 2> /dev/null; then
    mkdir -p "$site/xprof/cli/tools"
    echo "def get_kernel_stats(*a, **k): raise NotImplementedError('xprof stub')" \
      > "$site/xprof/cli/tools/get_kernel_stats_tool.py"
  fi
  $python -c "import jax, tokamax; print('jax', jax.__version__, 'tokamax', tokamax.__file__)"
  # The kernel tests first: the only check of the kernels' real GPU lowering.
  tests=$(find tests -name test_residual_rounding.py -o -name test_add_and_gated.py)
  run 90 $python -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 tests/kernels $tests
  run 200 $python -m benchmarks ops --rounds 3 --out RESULTS
  run 100 $python -m benchmarks step --rounds 3 --out RESULTS
  run 130 $python -m benchmarks gemma --rounds 3 --out RESULTS
} 2>&1 | tee "$log"
rm -f RESULTS
# Nothing that comes back names a folder of this machine.
prefix=$($python -c "import sys; print(sys.prefix)" | tail -n 1)
sed -i -e "s#$PWD/##g" -e "s#$site#SITE#g" -e "s#$out#RESULTS#g" -e "s#$prefix#PYTHON#g" "$log"
sed -i -E 's#/(tmp|root|home|opt|usr|work)/[^ :,"'"'"')]*#<path>#g' "$log"
