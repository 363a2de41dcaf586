"""The benchmarks of rmsnorm_jax: ``python -m benchmarks SECTION`` (``--help``; README.md).

Importing this package imports nothing else (``--target`` sets ``JAX_PLATFORMS`` first).
"""
