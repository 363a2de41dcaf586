"""The benchmarks of rmsnorm_jax: one command, ``python -m benchmarks SECTION`` (``--help``).

One job per module:

- ``__main__``: the command line, and each section's run (what is measured, where it is
  written);
- ``peers``: what is compared: our norms, their peers, the baselines, and each section's
  programs;
- ``models``: the models whose train step is measured (a pre-norm stack, a Gemma-3-style
  decoder), each with a pluggable norm;
- ``timing``: device time (CUPTI on a GPU, a profiler trace on a TPU) or wall-clock on a
  CPU, in interleaved rounds; the train steps' memory;
- ``estimates``: deviceless compiles for a TPU or GPU target: temporary memory, kernels and
  the compiler's cost-model estimates;
- ``report``: the derived ratios, the markdown tables, JSON and plots.

Importing this package imports nothing else (``--target`` must set ``JAX_PLATFORMS`` before
jax is imported).
"""
