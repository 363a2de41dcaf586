#!/usr/bin/env bash
# CI job: rmsnorm_jax.integrations against the JAX libraries people train with, each at
# the pinned version in a virtual environment of its own, with this checkout installed
# editable:
#   - google-tunix 0.1.7 and equinox 0.13.8, the machine's python3 (3.11 here):
#     tests/integrations/test_clients_tunix.py and test_clients_equinox.py;
#   - gemma 4.0.1 (Google DeepMind; needs Python >= 3.12), pyenv's 3.12.1:
#     tests/integrations/test_clients_gemma.py;
#   - keras 3.15.1 and keras-hub 0.32.0 on Keras's JAX backend, the machine's python3:
#     tests/integrations/test_clients_keras.py (keras-hub with --no-deps: it requires
#     tensorflow-text, which KerasHub's models on JAX do not import); with jax's `tpu`
#     extra (libtpu) for the deviceless TPU compile of a Qwen3 attention's gradient.
# The tests are the ones marked `clients` (pyproject.toml's markers).
# The three environments install side by side, then the three test runs go side by side
# (each is mostly one compiling thread); the job prints its duration. The environments live in
# $RMSNORM_JAX_CLIENT_VENVS (default: a folder under $TMPDIR, outside the checkout) and
# are made anew each run. `install` or `test` runs only that half (.ci/run installs while
# its first job tests, and tests after it).
#   .ci/clients.sh [install|test]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
start=$SECONDS
venvs=${RMSNORM_JAX_CLIENT_VENVS:-${TMPDIR:-/tmp}/rmsnorm_jax-clients}
phase=${1:-all}
elapsed() { echo "$(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"; }

# The client libraries, pinned (issue 33), and the versions pip resolved for them when
# the tests were written (pinned too, so that a new jax or flax release does not change
# what this job tests; move them together, deliberately).
TUNIX=("google-tunix==0.1.7" "equinox==0.13.8" "jax==0.10.2" "jaxlib==0.10.2"
  "flax==0.12.8" "optax==0.2.8" "qwix==0.1.8")
# sentencepiece 0.2.3 is built for protobuf 7 and fails at `import gemma.gm.nn` next to
# the protobuf 6 that tensorflow brings in ("incompatible Protobuf Gencode/Runtime").
GEMMA=("gemma==4.0.1" "sentencepiece==0.2.1" "jax==0.12.0.1" "jaxlib==0.12.0.1"
  "flax==0.12.12" "kauldron==1.4.4" "protobuf==6.33.6")
KERAS=("keras==3.15.1" "tokenizers==0.23.3" "regex==2026.11.19" "jax[tpu]==0.10.2" "jaxlib==0.10.2"
  "flax==0.12.8" "optax==0.2.8")
KERAS_HUB="keras-hub==0.32.0"  # installed --no-deps after them

make_venv() {  # make_venv NAME PYTHON PACKAGE...
  local name=$1 venv="$venvs/$1" python=$2
  shift 2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # A current pip: the old resolver of Python 3.12's bundled pip backtracked over gemma's
  # dependencies for more than 25 minutes (CLIENTS.md); pip 26 resolves them in about 1.5.
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "$@" "pytest>=8"
  "$venv/bin/pip" install --quiet --no-deps -e "$root"
  "$venv/bin/python" -c "import jax, flax; print('$name: Python', __import__('sys').version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__)"
}

status=0
if [ "$phase" != test ]; then
  mkdir -p "$venvs"
  echo "=== installing into $venvs"
  make_venv tunix python3 "${TUNIX[@]}" > "$venvs/tunix-install.log" 2>&1 &
  tunix_install=$!
  PYENV_VERSION=3.12.1 make_venv gemma python3.12 "${GEMMA[@]}" > "$venvs/gemma-install.log" 2>&1 &
  gemma_install=$!
  (make_venv keras python3 "${KERAS[@]}" \
    && "$venvs/keras/bin/pip" install --quiet --no-deps "$KERAS_HUB" \
    && KERAS_BACKEND=jax JAX_PLATFORMS=cpu "$venvs/keras/bin/python" -c "import keras, keras_hub; \
print('keras', keras.__version__, 'keras-hub', keras_hub.__version__)") > "$venvs/keras-install.log" 2>&1 &
  keras_install=$!
  wait "$tunix_install" || status=$?
  tail -n 1 "$venvs/tunix-install.log"
  wait "$gemma_install" || status=$?
  tail -n 1 "$venvs/gemma-install.log"
  wait "$keras_install" || status=$?
  tail -n 1 "$venvs/keras-install.log"
  if [ "$status" != 0 ]; then
    cat "$venvs/tunix-install.log" "$venvs/gemma-install.log" "$venvs/keras-install.log"
    echo "=== clients: an install failed (after $(elapsed))"
    exit 1
  fi
  echo "=== installed (after $(elapsed))"
fi
[ "$phase" = install ] && exit 0

run_tests() {  # run_tests NAME LIBRARIES: the tests marked clients of LIBRARIES (-k), in NAME's environment
  local venv="$venvs/$1" record="$venvs/$1-record.jsonl" libraries=$2
  rm -f "$record"
  # -s: the tests print their float32 and bfloat16 differences against the library's own,
  # and append them to $record (.ci/clients_tables.py makes docs/results/clients-tests.md).
  RMSNORM_JAX_CLIENT_RECORD="$record" JAX_PLATFORMS=cpu KERAS_BACKEND=jax \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs -s -m clients -k "$libraries" \
    tests/integrations
}
run_tests tunix "tunix or equinox" > "$venvs/tunix-tests.log" 2>&1 &
tunix_tests=$!
run_tests gemma gemma > "$venvs/gemma-tests.log" 2>&1 &
gemma_tests=$!
run_tests keras keras > "$venvs/keras-tests.log" 2>&1 &
keras_tests=$!
wait "$tunix_tests" || status=$?
wait "$gemma_tests" || status=$?
wait "$keras_tests" || status=$?
echo "=== google-tunix 0.1.7, equinox 0.13.8"
cat "$venvs/tunix-tests.log"
echo "=== gemma 4.0.1"
cat "$venvs/gemma-tests.log"
echo "=== keras 3.15.1, keras-hub 0.32.0"
cat "$venvs/keras-tests.log"
echo "=== the differences (python .ci/clients_tables.py tests RECORDS > docs/results/clients-tests.md)"
python3 .ci/clients_tables.py tests "$venvs"/*-record.jsonl || status=$?
echo "=== clients: $([ "$status" = 0 ] && echo passed || echo FAILED) in $(elapsed) (CPU time: $(times | tail -n 1))"
exit "$status"
