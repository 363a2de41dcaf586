#!/usr/bin/env bash
# Downloads into wheels/ (ignored by git, carried to the GPU machine with `carry: ["wheels"]`)
# tokamax 0.0.17 and the small pure-Python packages it needs that the GPU machine lacks
# (it has jax 0.11.2, flax, optax, numpy, torch and triton: ../shared/DEVICE.md), for
# Python 3.12 on x86_64. xprof, which tokamax imports for its own benchmarking only, is
# 100 MB: benchmarks/device_visit.sh stands a stub in for it where it is missing.
#   benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
  tokamax==0.0.17 jax-triton==0.4.1 immutabledict==4.3.1 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 qwix==0.1.8 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  einshape==1.0 tqdm==4.70.1
du -sh wheels && ls wheels
