#!/usr/bin/env bash
# flax's own normalization tests with flax's RMSNorm swapped for ours (.ci/flax_swap.py),
# under flax's own pytest settings (warnings are errors), for the flax installed in the
# given virtual environment: its sdist's tests/ and pyproject.toml only, so the flax
# under test is the installed one.
#   .ci/flax_tests.sh VENV [MODES]   (MODES: "classes patch", the default, or one of them)
set -euo pipefail
venv=$(cd "$1" && pwd)
ci=$(cd "$(dirname "$0")" && pwd)
version=$("$venv/bin/python" -c "import flax; print(flax.__version__)")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" download --quiet --no-deps --no-binary :all: --dest "$work" "flax==$version"
tar -xzf "$work/flax-$version.tar.gz" -C "$work" \
  "flax-$version/pyproject.toml" "flax-$version/tests"
cd "$work/flax-$version"
for how in ${2:-classes patch}; do
  echo "+ flax $version's tests, RMSNorm swapped ($how)"
  RMSNORM_JAX_SWAP=$how PYTHONPATH="$ci" JAX_PLATFORMS=cpu "$venv/bin/python" -m pytest \
    -n auto -p flax_swap -p no:cacheprovider \
    tests/nnx/nn/linear_test.py tests/nnx/nn/normalization_test.py tests/linen/linen_test.py
done
