"""A byte-level Transformer LM whose norms are rmsnorm_jax.RMSNorm (run by ../train_lm.py)."""
