"""One call puts another library's RMSNorm through :func:`rmsnorm_jax.rms_norm`.

=====================  ===================================================================
``patch_flax()``       ``flax.nnx.RMSNorm`` and ``flax.linen.RMSNorm``
``patch_maxtext()``    MaxText's ``RMSNorm`` (``maxtext.layers.normalizations``)
``patch_tunix()``      the norms of tunix's models (gemma, gemma3, gemma4, llama3, qwen2, qwen3)
``patch_gemma()``      the norms of Google DeepMind's ``gemma`` library (Gemma 2/3, 3n, 4)
``patch_equinox()``    ``equinox.nn.RMSNorm``
``patch_keras()``      the norms of KerasHub's models and ``keras.layers.RMSNormalization``
                       (Keras 3 on JAX; their ``call``)
=====================  ===================================================================

Each replaces the ``__call__`` of the library's norm classes and nothing else: the
library's constructors still build the parameters (names, shapes, dtypes, metadata), so
checkpoints load unchanged, and every model built from those classes, before or after the
call, computes its norms with ``rms_norm`` under the library's own semantics (eps, the
zero-centred ``1 + scale``, compute and output dtypes). Each first checks every class on a
probe input against the library's own method and refuses on a difference; each returns a
:class:`Patch` that counts the norm calls that reached it (``patch.calls``) and undoes
itself (``undo()``, or use it as a context manager).

Importing this package imports none of these libraries beyond flax; each ``patch_*``
imports its library when called.
"""

from ._equinox import patch_equinox as patch_equinox
from ._equinox import unpatch_equinox as unpatch_equinox
from ._flax import patch_flax as patch_flax
from ._flax import unpatch_flax as unpatch_flax
from ._gemma import patch_gemma as patch_gemma
from ._gemma import unpatch_gemma as unpatch_gemma
from ._keras import patch_keras as patch_keras
from ._keras import unpatch_keras as unpatch_keras
from ._maxtext import MAXTEXT_MODULES as MAXTEXT_MODULES
from ._maxtext import patch_maxtext as patch_maxtext
from ._maxtext import unpatch_maxtext as unpatch_maxtext
from ._patch import Patch as Patch
from ._tunix import patch_tunix as patch_tunix
from ._tunix import unpatch_tunix as unpatch_tunix

__all__ = [
    "MAXTEXT_MODULES",
    "Patch",
    "patch_equinox",
    "patch_flax",
    "patch_gemma",
    "patch_keras",
    "patch_maxtext",
    "patch_tunix",
    "unpatch_equinox",
    "unpatch_flax",
    "unpatch_gemma",
    "unpatch_keras",
    "unpatch_maxtext",
    "unpatch_tunix",
]
