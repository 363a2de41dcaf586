"""Run as a script by ``test_no_triton.py``: this library on a jax that ships no
Pallas-Triton (``jax.experimental.pallas.triton`` made unimportable before anything is
imported). Every implementation of the three functions, their gradients against the
float64 formula, and ``explain``, on the CPU; with ``--h100``, a deviceless H100 compile
of ``implementation="pallas"``. Prints one line per check and ``ok`` at the end.

    python tests/kernels/without_triton.py [--h100]
"""

import sys


def _block_triton() -> None:
    # An entry of None makes ``import`` raise ModuleNotFoundError, as for a module jax
    # no longer ships.
    sys.modules["jax.experimental.pallas.triton"] = None  # type: ignore[assignment]


def _close(got, want, tol=2e-5):
    import jax
    import numpy as np

    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, np.float64)
        scale = max(1.0, float(np.max(np.abs(w))))
        np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=tol * scale, rtol=tol)


def _check_function(name, ours, oracle, args) -> None:
    """Values and gradients (of every input) of ``ours`` under each implementation
    against ``oracle`` in float64, and ``explain``'s answer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rmsnorm_jax.kernels import explain

    def loss(fn):
        return lambda *a: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(fn(*a)))

    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        want = (oracle(*args64), jax.grad(loss(oracle), range(len(args)))(*args64))
        want = jax.tree.map(np.asarray, want)
    for impl in ("auto", "xla", "pallas"):
        fn = lambda *a, impl=impl: ours(*a, implementation=impl)
        got = (fn(*args), jax.jit(jax.grad(loss(fn), range(len(args))))(*args))
        _close(got, want)
        print(f"{name} {impl}: {explain(ours, *args, implementation=impl)}")


def main(argv: list[str]) -> None:
    _block_triton()
    import jax
    import jax.numpy as jnp

    from rmsnorm_jax import add_rms_norm, gated_rms_norm, rms_norm
    from rmsnorm_jax.kernels import explain
    from rmsnorm_jax.reference import (
        add_rms_norm_reference,
        gated_rms_norm_reference,
        rms_norm_reference,
    )

    keys = jax.random.split(jax.random.key(0), 4)
    x, other = (jax.random.normal(k, (2, 3, 64), jnp.float32) for k in keys[:2])
    scale = 1 + 0.2 * jax.random.normal(keys[2], (64,), jnp.float32)
    _check_function("rms_norm", rms_norm, rms_norm_reference, (x, scale))
    _check_function("add_rms_norm", add_rms_norm, add_rms_norm_reference, (x, other, scale))
    _check_function("gated_rms_norm", gated_rms_norm, gated_rms_norm_reference, (x, other, scale))
    said = explain(rms_norm, x, scale, implementation="pallas")
    assert "CPU: XLA (jax" in said and "has no jax.experimental.pallas.triton" in said, said
    assert "Triton" not in said.replace("pallas.triton", ""), said
    if "--h100" in argv:
        _compile_for_h100(rms_norm)
    loaded = sorted(m for m in sys.modules if m and "triton" in m and "rmsnorm_jax" in m)
    assert not loaded, loaded
    assert sys.modules["jax.experimental.pallas.triton"] is None
    print("ok")


def _compile_for_h100(rms_norm) -> None:
    """A deviceless H100 compile of the "pallas" gradient: Mosaic GPU's kernels where this
    jax has them, else XLA (no Triton to fall back on)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from rmsnorm_jax import aot
    from rmsnorm_jax.kernels import mosaic_gpu

    target = aot.get_target("h100")
    mesh = target.mesh((1,), ("data",))
    x = aot.struct((512, 1024), jnp.bfloat16, mesh, P())
    scale = aot.struct((1024,), jnp.float32, mesh, P())

    def grads(x, scale):
        return jax.grad(lambda x, s: jnp.sum(rms_norm(x, s, implementation="pallas")), (0, 1))(
            x, scale
        )

    text = target.compile(jax.jit(grads), x, scale).as_text()
    mosaic = text.count('custom_call_target="mosaic_gpu')
    assert "__gpu$xla.gpu.triton" not in text
    assert (mosaic >= 2) == mosaic_gpu.available(), mosaic
    print(f"h100 pallas: {mosaic} Mosaic GPU kernels, no Triton")


if __name__ == "__main__":
    main(sys.argv[1:])
