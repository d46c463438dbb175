"""Byte-level text data for the fp8tensor training example.

No download is needed: by default the corpus is the Python standard library's
own ``.py`` source files (found via ``sysconfig.get_paths()["stdlib"]``), read
in a fixed order (sorted paths, then a seeded permutation) so the corpus is
identical on every run and every rank.
Any other text file or directory can be used instead (``--data PATH``).

Tokenization is the identity on bytes: every byte is one token, so the
vocabulary size is :data:`VOCAB_SIZE` = 256 and no tokenizer is needed.

Typical use::

    corpus = load_corpus()                      # uint8 [N]
    train, val = split_corpus(corpus)           # last 5% of bytes -> val
    batches = RandomWindows(train, batch_size=8, seq_len=256, seed=0)
    x, y = next(batches)                        # int64 [8, 256] each

Everything is deterministic given the corpus and the seed.
"""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_MAX_BYTES",
    "stdlib_source_files",
    "list_text_files",
    "load_corpus",
    "split_corpus",
    "RandomWindows",
    "fixed_windows",
    "decode",
]

#: Number of distinct tokens (one per byte value).
VOCAB_SIZE = 256

#: Default cap on how many bytes are read into the corpus (4 MiB).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

# Directories under the stdlib root that hold third-party packages, not stdlib.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files(
    root: str | os.PathLike | None = None, shuffle_seed: int | None = 0
) -> list[Path]:
    """Return the standard library's ``.py`` files in a deterministic order.

    The files are sorted by relative path and then, unless ``shuffle_seed`` is
    ``None``, permuted by ``random.Random(shuffle_seed)``: with a byte cap the
    corpus (and its validation tail) is then a mix of the whole library rather
    than the alphabetically first packages (e.g. ``encodings``' codec tables).

    Args:
        root: stdlib directory; defaults to ``sysconfig.get_paths()["stdlib"]``.
        shuffle_seed: seed of the fixed permutation, or ``None`` for sorted order.

    Returns:
        List of paths. Third-party package directories
        (``site-packages``/``dist-packages``) and ``__pycache__`` are skipped.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(files)
    return files


def list_text_files(root: str | os.PathLike) -> list[Path]:
    """Return every regular file under directory ``root``, sorted by relative path.

    Hidden entries (names starting with ``.``) and ``__pycache__`` are skipped.
    Binary files are filtered later by :func:`load_corpus`.
    """
    root = Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _looks_binary(chunk: bytes) -> bool:
    return b"\x00" in chunk


def load_corpus(
    path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> torch.Tensor:
    """Read a byte corpus.

    Args:
        path: ``None`` for the Python stdlib sources (order: see
            :func:`stdlib_source_files`); a text file; or a
            directory, whose files are concatenated in sorted path order
            (files containing NUL bytes are treated as binary and skipped).
        max_bytes: read at most this many bytes in total (the corpus is the
            first ``max_bytes`` bytes of the concatenation). ``<= 0`` = no cap.

    Returns:
        ``torch.uint8`` tensor of shape ``[N]`` with ``N <= max_bytes``.
        Files in a directory are joined with a ``b"\\n"`` separator.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no bytes could be read.
    """
    if path is None:
        files: Sequence[Path] = stdlib_source_files()
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--data path does not exist: {p}")
        files = list_text_files(p) if p.is_dir() else [p]
    cap = max_bytes if max_bytes and max_bytes > 0 else None

    parts: list[bytes] = []
    total = 0
    for f in files:
        if cap is not None and total >= cap:
            break
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        if not raw or (len(files) > 1 and _looks_binary(raw)):
            continue
        if len(files) > 1:
            raw += b"\n"
        if cap is not None:
            raw = raw[: cap - total]
        parts.append(raw)
        total += len(raw)
    if total == 0:
        raise ValueError(f"no text could be read from {path or 'the stdlib'}")
    buf = bytearray(b"".join(parts))
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def split_corpus(
    data: torch.Tensor, val_fraction: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D corpus into disjoint train / validation parts.

    The last ``val_fraction`` of the bytes is the validation split (no
    shuffling, so the split is deterministic and the parts never overlap).

    Args:
        data: ``[N]`` tensor (any dtype).
        val_fraction: fraction in ``(0, 1)`` of bytes held out for validation.

    Returns:
        ``(train, val)``: views ``data[:n_train]`` and ``data[n_train:]``.
    """
    if data.dim() != 1:
        raise ValueError(f"expected a 1-D corpus, got shape {tuple(data.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(round(len(data) * val_fraction)))
    n_train = len(data) - n_val
    if n_train < 1:
        raise ValueError("corpus too small to split")
    return data[:n_train], data[n_train:]


def _gather_windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    win = data[idx].long()  # [B, T+1]
    return win[:, :-1], win[:, 1:]


class RandomWindows:
    """Infinite iterator of random ``(input, target)`` windows from a corpus.

    Each step draws ``global_batch = batch_size * num_shards`` window starts
    from a ``torch.Generator`` seeded with ``seed``; shard ``shard`` (e.g. the
    data-parallel rank) keeps rows ``[shard * batch_size, (shard+1) * batch_size)``.
    So all shards consume one global stream, and the union of shards'
    batches is independent of how many shards there are.

    Each window is ``seq_len + 1`` consecutive bytes; the input is the first
    ``seq_len`` and the target the last ``seq_len`` (shifted by one).

    Yields:
        ``(x, y)``: two ``torch.int64`` tensors of shape ``[batch_size, seq_len]``
        with values in ``[0, 256)``.
    """

    def __init__(
        self,
        data: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shard: int = 0,
        num_shards: int = 1,
    ):
        if data.dim() != 1:
            raise ValueError("data must be 1-D")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"corpus split has {len(data)} bytes, need at least seq_len+1={seq_len + 1}"
            )
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.shard = shard
        self.num_shards = num_shards
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_starts = len(self.data) - self.seq_len  # valid starts: [0, n_starts)
        starts = torch.randint(
            0, n_starts, (self.batch_size * self.num_shards,), generator=self.generator
        )
        lo = self.shard * self.batch_size
        return _gather_windows(self.data, starts[lo : lo + self.batch_size], self.seq_len)


def fixed_windows(
    data: torch.Tensor,
    num_batches: int,
    batch_size: int,
    seq_len: int,
    seed: int = 1234,
    shard: int = 0,
    num_shards: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, reproducible list of batches (e.g. for validation).

    Equivalent to taking the first ``num_batches`` items of
    ``RandomWindows(data, batch_size, seq_len, seed, shard, num_shards)``.

    Returns:
        List of ``num_batches`` ``(x, y)`` pairs, each ``int64 [batch_size, seq_len]``.
    """
    it = RandomWindows(data, batch_size, seq_len, seed, shard, num_shards)
    return [next(it) for _ in range(num_batches)]


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Turn byte tokens back into text (invalid UTF-8 is replaced)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
