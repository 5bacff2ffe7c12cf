"""Training data as numpy arrays, and the batches a seed picks from them. Pure numpy.

Two shapes of data: a token stream (language models: a batch is random windows of
`seq_len + 1` tokens, shifted by one for targets) and examples with labels (MLP, CNN:
a batch is random rows). Batches come from `numpy.random.default_rng(seed)`, never from
torch's generator, so the same seed picks the same batches on every machine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from idlegrid.training.flat import ContainerError

_TOKEN_DTYPES = (np.uint8, np.uint16, np.int32, np.int64)
_LABEL_DTYPES = (np.uint8, np.int32, np.int64)


@dataclass(frozen=True)
class TokenData:
    """A 1-D stream of token ids."""

    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.size)

    def batch(
        self, rng: np.random.Generator, batch_size: int, seq_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Random windows: inputs and next-token targets, both int64 (batch, seq_len)."""
        if self.tokens.size < seq_len + 1:
            raise ValueError(f"{self.tokens.size} tokens cannot fill a window of {seq_len + 1}")
        starts = rng.integers(0, self.tokens.size - seq_len, size=batch_size)
        return self.windows(starts, seq_len)

    def windows(self, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets of the windows that start at `starts`."""
        rows = np.stack([self.tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
        return rows[:, :-1], rows[:, 1:]


@dataclass(frozen=True)
class ExampleData:
    """Examples `x` (float32, first axis = example) with integer labels `y`."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.size)

    def batch(
        self, rng: np.random.Generator, batch_size: int, seq_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Random examples (with replacement) and their labels (int64)."""
        rows = rng.integers(0, self.y.size, size=batch_size)
        return self.x[rows], self.y[rows].astype(np.int64)


Dataset = TokenData | ExampleData


def batches(
    data: Dataset, *, seed: int, count: int, batch_size: int, seq_len: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`count` batches drawn by a generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield data.batch(rng, batch_size, seq_len)


def eval_batches(
    data: Dataset, *, count: int, batch_size: int, seq_len: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A fixed evaluation set: `count` batches at evenly spread positions, no randomness."""
    windows = count * batch_size
    if isinstance(data, TokenData):
        starts = np.linspace(0, len(data) - seq_len - 1, windows).astype(np.int64)
        for i in range(count):
            yield data.windows(starts[i * batch_size : (i + 1) * batch_size], seq_len)
        return
    rows = np.linspace(0, len(data) - 1, windows).astype(np.int64)
    for i in range(count):
        chosen = rows[i * batch_size : (i + 1) * batch_size]
        yield data.x[chosen], data.y[chosen].astype(np.int64)


def shard(data: Dataset, index: int, count: int) -> Dataset:
    """The `index`-th of `count` contiguous, near-equal parts of `data`."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}")
    bounds = np.linspace(0, len(data), count + 1).astype(np.int64)
    part = slice(int(bounds[index]), int(bounds[index + 1]))
    if isinstance(data, TokenData):
        return TokenData(data.tokens[part])
    return ExampleData(data.x[part], data.y[part])


# -- in containers ----------------------------------------------------------------------


def to_arrays(data: Dataset, prefix: str) -> dict[str, np.ndarray]:
    """Named arrays of a dataset, for a container."""
    if isinstance(data, TokenData):
        return {f"{prefix}tokens": data.tokens}
    return {f"{prefix}x": data.x, f"{prefix}y": data.y}


def from_arrays(arrays: Mapping[str, np.ndarray], prefix: str) -> Dataset:
    """The dataset `to_arrays` wrote, checked; ContainerError if it is not one."""
    if f"{prefix}tokens" in arrays:
        tokens = arrays[f"{prefix}tokens"]
        if tokens.ndim != 1 or tokens.dtype not in _TOKEN_DTYPES:
            raise ContainerError("tokens must be a 1-D array of unsigned 8/16 or int32/64 ids")
        return TokenData(tokens)
    if f"{prefix}x" in arrays and f"{prefix}y" in arrays:
        x, y = arrays[f"{prefix}x"], arrays[f"{prefix}y"]
        if x.dtype != np.float32 or x.ndim < 2:
            raise ContainerError("x must be a float32 array of shape (examples, ...)")
        if y.ndim != 1 or y.dtype not in _LABEL_DTYPES or y.size != x.shape[0]:
            raise ContainerError("y must be one integer label per example of x")
        if not np.all(np.isfinite(x)):
            raise ContainerError("x contains NaN or infinite values")
        return ExampleData(x, y)
    raise ContainerError("a dataset holds either 'tokens' or both 'x' and 'y'")
