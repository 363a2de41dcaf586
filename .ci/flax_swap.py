"""A pytest plugin that makes flax's ``RMSNorm`` rmsnorm_jax's for a whole test run.

.ci/flax_tests.sh runs flax's own normalization tests with it, under flax's own pytest
settings (every warning an error), once per way a user swaps:

- ``RMSNORM_JAX_SWAP=classes``: ``flax.linen.RMSNorm`` and ``flax.nnx.RMSNorm`` are
  rmsnorm_jax's classes (the one-line import swap of the README);
- ``RMSNORM_JAX_SWAP=patch``: ``rmsnorm_jax.integrations.patch_flax()`` routes flax's
  own classes through ``rms_norm``.

The swap happens when pytest loads the plugin, before it collects flax's tests, so
parametrized test lists that name ``nnx.RMSNorm`` get the swapped class too.
"""

import os

import flax.linen
from flax import nnx

import rmsnorm_jax.linen
import rmsnorm_jax.nnx
from rmsnorm_jax.integrations import patch_flax

HOW = os.environ.get("RMSNORM_JAX_SWAP", "classes")
if HOW == "classes":
    flax.linen.RMSNorm = rmsnorm_jax.linen.RMSNorm
    nnx.RMSNorm = rmsnorm_jax.nnx.RMSNorm
elif HOW == "patch":
    patch_flax()
else:
    raise ValueError(f"RMSNORM_JAX_SWAP={HOW!r}: use 'classes' or 'patch'")


def pytest_report_header(config):
    return [
        f"RMSNorm swap ({HOW}): flax.linen.RMSNorm.__call__ from "
        f"{flax.linen.RMSNorm.__call__.__module__}, flax.nnx.RMSNorm.__call__ from "
        f"{nnx.RMSNorm.__call__.__module__}"
    ]
