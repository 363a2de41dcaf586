"""The input pipeline: a byte corpus, its train/validation split, and the batches of a step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import Config


def load_corpus(path: str | None) -> bytes:
    """The user's text file, or the pydoc topics that ship with Python."""
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data {path}: no such file")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"--data {path}: the file is empty")
    return data


def split_tokens(corpus: bytes, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The corpus's bytes as tokens: ``(train, validation)``, the last part validation."""
    tokens = np.frombuffer(corpus, np.uint8).astype(np.int32)
    n_val = max(int(len(tokens) * cfg.val_fraction), cfg.seq_len + 2)
    train, val = tokens[:-n_val], tokens[-n_val:]
    if len(train) < cfg.seq_len + 2:
        raise ValueError(
            f"the corpus has {len(tokens)} bytes; need more than {2 * (cfg.seq_len + 2)} "
            f"for seq_len={cfg.seq_len} and a validation split"
        )
    return train, val


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the byte distribution: the loss of the best context-free model."""
    counts = np.bincount(tokens, minlength=256)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def batch_at(tokens: np.ndarray, step: int, cfg: Config, seed: int) -> np.ndarray:
    """The batch for ``step``: a pure function of (seed, step), so a resumed run sees
    exactly the data order of an uninterrupted one."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, size=cfg.batch_size)
    return np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])


def eval_batches(tokens: np.ndarray, cfg: Config) -> list[np.ndarray]:
    """Fixed, evenly spaced validation windows."""
    count = cfg.eval_batches * cfg.batch_size
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 1, count).astype(int)
    windows = np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])
    return list(windows.reshape(cfg.eval_batches, cfg.batch_size, -1))
