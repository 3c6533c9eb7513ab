"""Tests for trainer/data.py against the committed fixtures.

Expected values are computed independently of the code under test wherever
possible: documents by splitting corpus.txt by hand, tokens by reading the .bin
file with numpy, window orders from the documented (seed, epoch) contract.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from transformers import AutoTokenizer

from trainer.data import TokenDataset, eos_id, load_tokenizer, prepare_dataset, vocab_size

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CORPUS = FIXTURES / "corpus.txt"
TOKENIZER = FIXTURES / "tokenizer"
SEQ_LENGTH = 128
SEED = 1234


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    return prepare_dataset(CORPUS, TOKENIZER, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def raw_stream(prefix: str) -> np.ndarray:
    """All tokens straight from the .bin file, read without the code under test."""
    dtype = IndexedDataset(prefix).index.dtype
    return np.fromfile(prefix + ".bin", dtype=dtype).astype(np.int64)


def corpus_documents() -> list[str]:
    return CORPUS.read_text(encoding="utf-8").rstrip("\n").split("\n\n")


def write_small_corpus(path: Path, n_docs: int = 3) -> Path:
    path.write_text("\n\n".join(corpus_documents()[:n_docs]) + "\n", encoding="utf-8")
    return path


# --- tokenizer ---------------------------------------------------------------


def test_tokenizer_true_vocab_is_1000(tokenizer) -> None:
    assert vocab_size(tokenizer) == 1000
    assert vocab_size(tokenizer) % 128 != 0
    assert eos_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.bos_token == tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"


def test_tokenizer_round_trips_and_loads_via_auto(tokenizer) -> None:
    sentence = "Return a new list containing all items from the iterable in ascending order.\n  Indented: x = 1"
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    assert all(0 <= i < 1000 for i in ids)
    assert len(ids) < len(sentence)  # merges were actually learned
    assert tokenizer.decode(ids) == sentence
    auto = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    assert len(auto) == 1000
    assert auto.encode(sentence, add_special_tokens=False) == ids


def test_load_tokenizer_missing_dir_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make_fixtures"):
        load_tokenizer(tmp_path / "nope")


# --- prepare_dataset ---------------------------------------------------------


def test_prepare_dataset_writes_readable_indexed_dataset(prefix: str, tokenizer) -> None:
    documents = corpus_documents()
    assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    assert not [name for name in os.listdir(Path(prefix).parent) if ".tmp" in name]
    indexed = IndexedDataset(prefix)
    assert len(indexed) == len(documents)
    first = indexed[0].astype(np.int64)
    assert first[-1] == eos_id(tokenizer)
    assert eos_id(tokenizer) not in first[:-1]
    assert tokenizer.decode(first[:-1].tolist()) == documents[0]
    assert tokenizer.decode(indexed[len(indexed) - 1][:-1].tolist()) == documents[-1]


def test_prepare_dataset_is_cached(prefix: str) -> None:
    before = [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")]
    again = prepare_dataset(CORPUS, TOKENIZER, Path(prefix).parent)
    assert again == prefix
    assert [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")] == before


def test_changed_corpus_or_tokenizer_gives_new_prefix(tmp_path: Path, prefix: str) -> None:
    cache = tmp_path / "cache"
    corpus = write_small_corpus(tmp_path / "corpus.txt")
    first = prepare_dataset(corpus, TOKENIZER, cache)
    corpus.write_text(corpus.read_text(encoding="utf-8") + "\nOne more document.\n", encoding="utf-8")
    appended = prepare_dataset(corpus, TOKENIZER, cache)
    assert len(IndexedDataset(appended)) == len(IndexedDataset(first)) + 1
    text = corpus.read_text(encoding="utf-8")
    corpus.write_text(text.replace("One more", "One MORE"), encoding="utf-8")  # same length
    same_length = prepare_dataset(corpus, TOKENIZER, cache)
    tokenizer_copy = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, tokenizer_copy)
    config = json.loads((tokenizer_copy / "tokenizer.json").read_text(encoding="utf-8"))
    (tokenizer_copy / "tokenizer.json").write_text(json.dumps(config), encoding="utf-8")  # same model, new bytes
    other_tokenizer = prepare_dataset(corpus, tokenizer_copy, cache)
    assert len({prefix, first, appended, same_length, other_tokenizer}) == 5


def test_stale_temp_files_do_not_break_prepare(tmp_path: Path) -> None:
    corpus = write_small_corpus(tmp_path / "corpus.txt")
    cache = tmp_path / "cache"
    cache.mkdir()
    expected_name = Path(prepare_dataset(corpus, TOKENIZER, tmp_path / "probe")).name
    for suffix in (f".tmp{os.getpid()}.bin", f".tmp{os.getpid()}.idx", ".tmp1.bin", ".bin"):
        (cache / (expected_name + suffix)).write_bytes(b"garbage from a crashed run")
    result = prepare_dataset(corpus, TOKENIZER, cache)
    assert Path(result).name == expected_name
    assert len(IndexedDataset(result)) == 3


# --- TokenDataset ----------------------------------------------------------------


def test_windows_tile_the_raw_stream(prefix: str, raw_stream: np.ndarray) -> None:
    data = TokenDataset(prefix, SEQ_LENGTH, SEED)
    n = data.num_windows
    assert n == (raw_stream.size - 1) // SEQ_LENGTH
    order = np.random.default_rng([SEED, 0]).permutation(n)  # the documented contract
    for i in range(0, n, 7):
        k = int(order[i])
        sample = data.sample(i)
        assert sample.dtype == torch.int64 and sample.shape == (SEQ_LENGTH + 1,)
        expected = raw_stream[k * SEQ_LENGTH : (k + 1) * SEQ_LENGTH + 1]
        assert np.array_equal(sample.numpy(), expected)
        # labels (sample[1:]) are the inputs shifted by one; the last label is the
        # first token of the next contiguous window, so no target is skipped
        assert np.array_equal(sample[1:].numpy(), raw_stream[k * SEQ_LENGTH + 1 : (k + 1) * SEQ_LENGTH + 1])
        assert sample[-1].item() == raw_stream[(k + 1) * SEQ_LENGTH]


def sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def test_each_epoch_is_a_permutation_with_a_new_order(prefix: str, raw_stream: np.ndarray) -> None:
    data = TokenDataset(prefix, SEQ_LENGTH, SEED)
    n = data.num_windows
    all_windows = np.stack([raw_stream[k * SEQ_LENGTH : (k + 1) * SEQ_LENGTH + 1] for k in range(n)])
    epoch0 = data.batch(0, n).numpy()
    epoch1 = data.batch(n, n).numpy()
    assert epoch0.shape == (n, SEQ_LENGTH + 1)
    assert np.array_equal(sorted_rows(epoch0), sorted_rows(all_windows))
    assert np.array_equal(sorted_rows(epoch1), sorted_rows(all_windows))
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, all_windows)  # actually shuffled
    assert torch.equal(data.sample(5 * n + 3), data.sample(5 * n + 3))
    assert np.array_equal(data.sample(3 * n + 11).numpy(),
                          all_windows[np.random.default_rng([SEED, 3]).permutation(n)[11]])


def test_deterministic_across_instances_and_seed_sensitive(prefix: str) -> None:
    a = TokenDataset(prefix, SEQ_LENGTH, SEED)
    b = TokenDataset(prefix, SEQ_LENGTH, SEED)
    other = TokenDataset(prefix, SEQ_LENGTH, SEED + 1)
    start = a.num_windows - 5  # straddles an epoch boundary
    assert torch.equal(a.batch(start, 16), b.batch(start, 16))
    assert not torch.equal(a.batch(start, 16), other.batch(start, 16))


def test_too_small_corpus_raises_clear_error(tmp_path: Path) -> None:
    small = prepare_dataset(write_small_corpus(tmp_path / "tiny.txt", 1), TOKENIZER, tmp_path)
    indexed = IndexedDataset(small)  # keep alive: its views die with it (megatron unmaps in __del__)
    tokens = int(indexed.index.sequence_lengths.sum())
    with pytest.raises(ValueError, match=r"tiny-.*\.bin .*smaller seq_length"):
        TokenDataset(small, tokens, SEED)
    assert TokenDataset(small, tokens - 1, SEED).num_windows == 1
