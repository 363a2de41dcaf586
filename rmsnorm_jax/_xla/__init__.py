"""The XLA path: each norm as a jnp expression with its analytic backward and forward mode.

``passes.py`` holds the maths once; ``rms_norm.py``, ``add_rms_norm.py`` and
``gated_rms_norm.py`` the differentiable cores; ``per_compiler.py`` the forms chosen per
compiler when a program is lowered.
"""

from .add_rms_norm import AddConfig as AddConfig
from .add_rms_norm import add_rms_norm_core as add_rms_norm_core
from .gated_rms_norm import ACTIVATIONS as ACTIVATIONS
from .gated_rms_norm import GateConfig as GateConfig
from .gated_rms_norm import gated_rms_norm_core as gated_rms_norm_core
from .rms_norm import rms_norm_core as rms_norm_core
