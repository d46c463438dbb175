"""Tests of the example's byte-level data loader (examples/data.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "examples" / "data.py"
_spec = importlib.util.spec_from_file_location("fp8tensor_example_data", _PATH)
data = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = data
_spec.loader.exec_module(data)

SMALL = 300_000  # bytes: keeps the stdlib reads fast


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus(max_bytes=SMALL)


def test_stdlib_corpus_shape_dtype_and_cap(corpus):
    assert corpus.dtype == torch.uint8
    assert corpus.dim() == 1
    assert len(corpus) == SMALL  # the stdlib has far more than SMALL bytes
    assert data.VOCAB_SIZE == 256
    # Python source: mostly printable ASCII
    text = data.decode(corpus[:20_000])
    assert "def " in text or "class " in text or "import " in text


def test_stdlib_corpus_is_deterministic(corpus):
    assert torch.equal(corpus, data.load_corpus(max_bytes=SMALL))
    # a smaller cap is a prefix of a larger one
    assert torch.equal(data.load_corpus(max_bytes=1000), corpus[:1000])


def test_stdlib_file_list():
    files = data.stdlib_source_files()
    assert files == data.stdlib_source_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    assert len(set(files)) == len(files)
    unshuffled = data.stdlib_source_files(shuffle_seed=None)
    assert sorted(files) == sorted(unshuffled)
    assert [str(f) for f in unshuffled] == sorted(str(f) for f in unshuffled)


def test_split_is_disjoint_and_complete(corpus):
    train, val = data.split_corpus(corpus, val_fraction=0.05)
    assert len(train) + len(val) == len(corpus)
    assert len(val) == round(0.05 * len(corpus))
    # val is exactly the tail: the two parts tile the corpus without overlap
    assert torch.equal(torch.cat([train, val]), corpus)
    assert train.data_ptr() + len(train) == val.data_ptr()
    t2, v2 = data.split_corpus(corpus, val_fraction=0.05)
    assert torch.equal(train, t2) and torch.equal(val, v2)


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(corpus, frac):
    with pytest.raises(ValueError):
        data.split_corpus(corpus, val_fraction=frac)


def test_split_rejects_non_1d():
    with pytest.raises(ValueError):
        data.split_corpus(torch.zeros(4, 4, dtype=torch.uint8))


def test_windows_shapes_dtypes_and_shift(corpus):
    train, _ = data.split_corpus(corpus)
    it = data.RandomWindows(train, batch_size=5, seq_len=32, seed=0)
    for _ in range(3):
        x, y = next(it)
        assert x.shape == y.shape == (5, 32)
        assert x.dtype == y.dtype == torch.int64
        assert int(x.min()) >= 0 and int(x.max()) < 256
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_windows_are_contiguous_slices_of_the_split():
    train = torch.arange(200, dtype=torch.uint8)  # values == positions
    x, y = next(data.RandomWindows(train, batch_size=16, seq_len=10, seed=3))
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(10))
    assert torch.equal(y, starts[:, None] + 1 + torch.arange(10))
    assert int(y.max()) < 200  # never reads past the end of the split


def test_windows_cover_the_last_start():
    train = torch.arange(11, dtype=torch.uint8)  # exactly seq_len + 1 bytes: one window
    x, y = next(data.RandomWindows(train, batch_size=2, seq_len=10, seed=0))
    assert torch.equal(x[0], torch.arange(10)) and torch.equal(y[1], torch.arange(1, 11))
    with pytest.raises(ValueError):
        data.RandomWindows(train, batch_size=1, seq_len=11)


def test_windows_deterministic_given_seed(corpus):
    a = data.RandomWindows(corpus, 4, 16, seed=7)
    b = data.RandomWindows(corpus, 4, 16, seed=7)
    c = data.RandomWindows(corpus, 4, 16, seed=8)
    for _ in range(3):
        xa, ya = next(a)
        xb, yb = next(b)
        xc, _ = next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)


def test_windows_shards_partition_the_global_batch(corpus):
    full = data.RandomWindows(corpus, batch_size=6, seq_len=16, seed=1)
    shards = [data.RandomWindows(corpus, 2, 16, seed=1, shard=s, num_shards=3) for s in range(3)]
    for _ in range(2):
        x, y = next(full)
        parts = [next(s) for s in shards]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
    with pytest.raises(ValueError):
        data.RandomWindows(corpus, 2, 16, shard=3, num_shards=3)


def test_fixed_windows_match_iterator(corpus):
    batches = data.fixed_windows(corpus, 3, 2, 8, seed=5)
    it = data.RandomWindows(corpus, 2, 8, seed=5)
    assert len(batches) == 3
    for x, y in batches:
        ex, ey = next(it)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_data_file(tmp_path):
    text = "hello wörld\n" * 50
    f = tmp_path / "input.txt"
    f.write_text(text, encoding="utf-8")
    c = data.load_corpus(f)
    assert c.dtype == torch.uint8
    assert bytes(c.tolist()) == text.encode("utf-8")
    assert data.decode(c) == text
    assert len(data.load_corpus(f, max_bytes=7)) == 7
    assert len(data.load_corpus(f, max_bytes=0)) == len(text.encode())  # no cap


def test_data_directory_sorted_recursive_skips_binary_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"BBB")
    (tmp_path / "a.txt").write_bytes(b"AAA")
    (tmp_path / "c.md").write_bytes(b"CCC")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / ".hidden").write_bytes(b"HHH")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_bytes(b"GGG")
    c = data.load_corpus(tmp_path)
    assert bytes(c.tolist()) == b"AAA\nBBB\nCCC\n"
    assert torch.equal(c, data.load_corpus(tmp_path))
    assert bytes(data.load_corpus(tmp_path, max_bytes=6).tolist()) == b"AAA\nBB"


def test_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError):
        data.load_corpus(tmp_path / "empty")


def test_decode_roundtrip():
    s = "print('ünïcode')\n"
    t = torch.tensor(list(s.encode()), dtype=torch.int64)
    assert data.decode(t) == s
    assert data.decode([104, 105]) == "hi"
