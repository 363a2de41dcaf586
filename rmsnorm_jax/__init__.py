"""rmsnorm_jax: RMSNorm and partial RMSNorm for JAX and Flax.

``rms_norm`` is the pure function (analytic backward, forward mode too); ``RMSNorm`` the Flax linen
Module; ``rmsnorm_jax.nnx.RMSNorm`` its NNX twin.
"""

from . import integrations as integrations
from . import nnx as nnx
from ._config import partial_count as partial_count
from ._llm_layers import add_rms_norm as add_rms_norm
from ._llm_layers import gated_rms_norm as gated_rms_norm
from ._rms_norm import rms_norm as rms_norm
from ._version import __version__ as __version__
from .linen import RMSNorm as RMSNorm

__all__ = [
    "RMSNorm",
    "add_rms_norm",
    "gated_rms_norm",
    "integrations",
    "nnx",
    "partial_count",
    "rms_norm",
]
