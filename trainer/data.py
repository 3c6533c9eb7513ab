"""Offline training data for the bundled trainer.

Three steps, top to bottom:

1. ``load_tokenizer`` -- the committed fixture tokenizer, never the network.
2. ``prepare_dataset`` -- tokenize a blank-line separated corpus once into
   megatron-core's indexed dataset format (``<prefix>.bin`` / ``<prefix>.idx``),
   cached under a name derived from the corpus and tokenizer contents.
3. ``TokenDataset`` -- deterministic fixed-length training windows over that
   token stream, addressed by a global sample counter, so every rank and every
   resumed run sees exactly the same batches for the same counter values.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
)
from transformers import PreTrainedTokenizerFast

from ckpt_tools.errors import ConfigError

HASH_LENGTH = 12
"""Hex digits of the content hash kept in a dataset prefix; plenty to avoid clashes."""

_DOCUMENT_SEPARATOR = re.compile(r"\n[ \t]*\n")


# --- tokenizer ---------------------------------------------------------------


def load_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with ``save_pretrained``, strictly from local files.

    ``local_files_only`` makes a missing or misspelt directory fail at once
    instead of being mistaken for a Hub model id and hanging on the network.
    """
    path = Path(tokenizer_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}; run `python fixtures/make_fixtures.py` or pass the right directory"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def vocab_size(tokenizer: PreTrainedTokenizerFast) -> int:
    """True vocabulary size including special tokens (before any model padding)."""
    return len(tokenizer)


def eos_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """Id of the end-of-document token appended after every document."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {tokenizer.name_or_path} defines no eos_token; set one in tokenizer_config.json")
    return int(tokenizer.eos_token_id)


# --- corpus -> indexed dataset ----------------------------------------------


def read_documents(corpus: str | Path) -> list[str]:
    """Split the corpus into documents: blocks separated by blank lines."""
    text = Path(corpus).read_text(encoding="utf-8")
    return [block.strip() for block in _DOCUMENT_SEPARATOR.split(text) if block.strip()]


def dataset_prefix(corpus: str | Path, tokenizer_dir: str | Path, cache_dir: str | Path) -> str:
    """Cache path prefix naming the exact (corpus, tokenizer) contents.

    Hashing contents rather than paths or mtimes means an edited corpus or a
    retrained tokenizer can never silently reuse stale tokens.
    """
    digest = hashlib.sha256()
    for path in (Path(corpus), Path(tokenizer_dir) / "tokenizer.json"):
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous concatenation
        digest.update(data)
    return str(Path(cache_dir) / f"{Path(corpus).stem}-{digest.hexdigest()[:HASH_LENGTH]}")


def _write_indexed_dataset(documents: list[list[int]], prefix: str, dtype: type[np.number]) -> None:
    """Write one megatron-core document (of one sequence) per token list."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in documents:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")


def prepare_dataset(corpus: str | Path, tokenizer_dir: str | Path, cache_dir: str | Path) -> str:
    """Tokenize ``corpus`` into ``<prefix>.bin``/``.idx`` once and return the prefix.

    Each document is followed by the EOS id so the model learns document
    boundaries.  Files are built under a per-process temporary name and moved
    into place with ``os.replace`` (.bin first, .idx last); since the existence
    check looks at the .idx, a reader never sees a half-written dataset, and a
    stale temporary file from a crashed run is simply ignored or overwritten.
    """
    prefix = dataset_prefix(corpus, tokenizer_dir, cache_dir)
    if os.path.exists(prefix + ".idx"):
        return prefix

    tokenizer = load_tokenizer(tokenizer_dir)
    texts = read_documents(corpus)
    if not texts:
        raise ConfigError(f"corpus {corpus} has no documents; fill it with blank-line separated text")
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    documents = [ids + [eos_id(tokenizer)] for ids in encoded]

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    try:
        _write_indexed_dataset(documents, tmp, DType.optimal_dtype(vocab_size(tokenizer)))
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for leftover in (tmp + ".bin", tmp + ".idx"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return prefix


# --- training windows ---------------------------------------------------------


class TokenDataset:
    """Non-overlapping ``seq_length + 1`` token windows over the whole corpus.

    All documents are read as one stream (EOS tokens already mark the
    boundaries).  Window ``k`` is ``stream[k*seq_length : k*seq_length + seq_length + 1]``,
    so neighbouring windows share one token: the last label of one window is
    the first input of the next, and no token is skipped as a target.

    ``sample(index)`` takes a global sample counter that keeps growing across
    epochs; the window order of each epoch is a permutation seeded by
    ``(seed, epoch)``, so any process can compute any sample independently.
    """

    def __init__(self, prefix: str, seq_length: int, seed: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy seeding requirement), got {seed}")
        self.prefix = prefix
        self.seq_length = seq_length
        self.seed = seed
        # Keep the IndexedDataset referenced: it unmaps its files in __del__,
        # which would leave self._stream pointing at freed memory.
        self._indexed = IndexedDataset(prefix, mmap=True)
        self._stream = self._read_stream(self._indexed)
        if self.num_windows < 1:
            raise ConfigError(
                f"dataset {prefix}.bin has {self._stream.size} tokens, fewer than seq_length + 1 = "
                f"{seq_length + 1}; use a larger corpus or a smaller seq_length"
            )
        self._epoch_order = functools.lru_cache(maxsize=4)(self._permutation)

    @staticmethod
    def _read_stream(indexed: IndexedDataset) -> np.ndarray:
        """Zero-copy view of every token in the .bin file, in document order.

        IndexedDatasetBuilder writes documents back to back, so the whole .bin
        already is the concatenated stream; it stays in its on-disk dtype.
        """
        total = int(indexed.index.sequence_lengths.sum(dtype=np.int64))
        return indexed.bin_reader.read(dtype=indexed.index.dtype, count=total, offset=0)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream, EOS separators included."""
        return int(self._stream.size)

    @property
    def num_windows(self) -> int:
        """Windows per epoch; the last ``seq_length + 1`` tokens must fit entirely."""
        return (self.num_tokens - 1) // self.seq_length

    def _permutation(self, epoch: int) -> np.ndarray:
        """Window order for one epoch, a pure function of (seed, epoch)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window(self, k: int) -> torch.Tensor:
        """Window ``k`` in stream order (no shuffling), as int64."""
        if not 0 <= k < self.num_windows:
            raise IndexError(f"window {k} out of range [0, {self.num_windows})")
        start = k * self.seq_length
        return torch.from_numpy(self._stream[start : start + self.seq_length + 1].astype(np.int64))

    def sample(self, index: int) -> torch.Tensor:
        """LongTensor[seq_length + 1] for global sample counter ``index``."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, position = divmod(index, self.num_windows)
        return self.window(int(self._epoch_order(epoch)[position]))

    def batch(self, start: int, count: int) -> torch.Tensor:
        """LongTensor[count, seq_length + 1] of samples ``start .. start + count - 1``."""
        if count < 1:
            raise ValueError(f"batch count must be >= 1, got {count}")
        return torch.stack([self.sample(index) for index in range(start, start + count)])
