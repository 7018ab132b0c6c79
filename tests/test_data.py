"""Contract tests of p2pdiloco.data: corpus split and digest, sources, shards, resumable streams, eval."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os

import pytest
import torch

from p2pdiloco import data as data_mod
from p2pdiloco.sources import stdlib_files
from p2pdiloco.data import (
    BatchStream,
    DataConfig,
    clear_corpus_cache,
    evaluate,
    load_corpus,
    shard_for_peer,
)
from p2pdiloco.errors import CheckpointError, ConfigError
from p2pdiloco.model import ModelConfig, build_model

pytestmark = pytest.mark.timeout(60)


def test_public_names():
    assert set(data_mod.__all__) == {
        "STDLIB_SOURCE", "DataConfig", "Corpus", "load_corpus", "clear_corpus_cache",
        "shard_for_peer", "BatchStream", "evaluate",
    }


# ---------------------------------------------------------------- corpus


def test_stdlib_corpus_split_follows_the_documented_rule():
    cfg = DataConfig(max_bytes=2_000_000)
    corpus = load_corpus(cfg)
    assert corpus.train.dtype == torch.uint8 and corpus.val.dtype == torch.uint8
    assert corpus.train.dim() == 1 and corpus.val.numel() > 0
    assert corpus.train.numel() + corpus.val.numel() == 2_000_000
    # Recompute the split independently: sorted files, cut at max_bytes, val by sha256(path) % 1000.
    root, files = stdlib_files()
    assert files == sorted(files) and all(p.endswith(".py") for p, _ in files)
    assert not any(part in ("site-packages", "test", "tests", "idlelib", "lib2to3") for p, _ in files for part in p.split("/"))
    train, val, left = [], [], cfg.max_bytes
    for rel, full in files:
        if left <= 0:
            break
        with open(full, "rb") as f:
            content = f.read()[:left]
        left -= len(content)
        h = int.from_bytes(hashlib.sha256(rel.encode()).digest(), "big")
        (val if h % 1000 < 50 else train).append(content)
    assert len(val) >= 1
    assert bytes(corpus.val.numpy()) == b"".join(val)
    assert bytes(corpus.train.numpy()) == b"".join(train)


def test_digest_is_deterministic_across_loads_and_cache_is_used():
    cfg = DataConfig(max_bytes=1_000_000)
    a = load_corpus(cfg)
    assert load_corpus(dataclasses.replace(cfg, shard=3, seed=7)) is a  # shard/seed don't change the corpus
    clear_corpus_cache()
    b = load_corpus(cfg)
    assert b is not a
    assert a.digest == b.digest and len(a.digest) == 16
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert load_corpus(DataConfig(max_bytes=999_999)).digest != a.digest
    assert load_corpus(DataConfig(max_bytes=1_000_000, val_fraction=0.1)).digest != a.digest


def _write(path, content: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


def test_directory_source(tmp_path):
    # Many files with distinct contents: each must land wholly in exactly one split.
    contents = {f"sub{i % 3}/file{i:02d}.txt": (f"<file {i}>" * 20).encode() for i in range(40)}
    for rel, c in contents.items():
        _write(tmp_path / rel, c)
    _write(tmp_path / ".git" / "objects", b"hidden dir content")
    _write(tmp_path / ".hidden.txt", b"hidden file content")
    _write(tmp_path / "blob.bin", b"binary\x00content")
    clear_corpus_cache()
    corpus = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.2))
    train, val = bytes(corpus.train.numpy()), bytes(corpus.val.numpy())
    assert b"hidden" not in train + val and b"binary" not in train + val
    order = sorted(contents)
    in_val = [rel for rel in order if contents[rel] in val]
    in_train = [rel for rel in order if contents[rel] in train]
    assert set(in_val).isdisjoint(in_train) and set(in_val) | set(in_train) == set(order)
    assert in_val and in_train
    # sorted relative-path order within each split
    assert train == b"".join(contents[r] for r in in_train)
    assert val == b"".join(contents[r] for r in in_val)
    assert str(tmp_path) in corpus.description

    # the digest follows the bytes, not the location
    digest = corpus.digest
    _write(tmp_path / order[0], contents[order[0]].replace(b"0", b"9"))
    clear_corpus_cache()
    assert load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.2)).digest != digest


def test_directory_digest_is_location_independent(tmp_path):
    for where in ("a", "b"):
        for i in range(5):
            _write(tmp_path / where / f"f{i}.txt", f"text number {i}\n".encode() * 50)
    clear_corpus_cache()
    a = load_corpus(DataConfig(source=str(tmp_path / "a"), val_fraction=0.5))
    b = load_corpus(DataConfig(source=str(tmp_path / "b"), val_fraction=0.5))
    assert a.digest == b.digest


def test_single_file_source_holds_out_its_tail(tmp_path):
    text = bytes(range(256)) * 40  # 10240 bytes
    path = tmp_path / "corpus.txt"
    _write(path, text)
    corpus = load_corpus(DataConfig(source=str(path), val_fraction=0.1))
    train, val = bytes(corpus.train.numpy()), bytes(corpus.val.numpy())
    assert train + val == text
    assert len(val) == 1024
    capped = load_corpus(DataConfig(source=str(path), max_bytes=5000, val_fraction=0.1))
    assert bytes(capped.train.numpy()) + bytes(capped.val.numpy()) == text[:5000]


def test_missing_source_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as e:
        load_corpus(DataConfig(source=missing))
    assert missing in str(e.value) and "stdlib" in str(e.value)


def test_empty_directory_is_a_config_error(tmp_path):
    _write(tmp_path / "only.bin", b"\x00\x01\x02")
    with pytest.raises(ConfigError, match="no usable text"):
        load_corpus(DataConfig(source=str(tmp_path)))


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(val_fraction=0.0), "data.val_fraction"),
        (dict(val_fraction=0.6), "data.val_fraction"),
        (dict(num_shards=0), "data.num_shards"),
        (dict(shard=-2), "data.shard"),
        (dict(num_shards=4, shard=4), "data.shard"),
        (dict(max_bytes=0), "data.max_bytes"),
        (dict(max_bytes=1.5), "data.max_bytes"),
        (dict(seed=-1), "data.seed"),
        (dict(source=""), "data.source"),
    ],
)
def test_data_config_validate_rejects(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dataclasses.replace(DataConfig(), **change).validate()


def test_shard_for_peer_is_stable_and_spread():
    expected = int.from_bytes(hashlib.sha256(b"QmPeerA").digest()[:8], "big") % 16
    assert shard_for_peer("QmPeerA", 16) == expected
    assert {shard_for_peer(f"peer-{i}", 8) for i in range(200)} == set(range(8))
    assert DataConfig(shard=3).shard_for("QmPeerA") == 3
    assert DataConfig(shard=-1).shard_for("QmPeerA") == expected
    with pytest.raises(ConfigError):
        shard_for_peer("x", 0)


# ---------------------------------------------------------------- batch streams


def _stream(tokens, shard=0, num_shards=4, batch_size=8, seq_len=16, seed=0):
    return BatchStream(tokens, shard=shard, num_shards=num_shards, batch_size=batch_size, seq_len=seq_len, seed=seed)


def test_shards_sample_only_their_region():
    # Region s is filled with the value s, so any window crossing a boundary would show another value.
    tokens = torch.arange(4).repeat_interleave(50).to(torch.uint8)
    for s in range(4):
        stream = _stream(tokens, shard=s)
        assert stream.region == (50 * s, 50 * (s + 1))
        for _ in range(20):
            x, y = stream.next_batch("cpu")
            assert (x == s).all() and (y == s).all()


def test_regions_partition_uneven_tokens_and_windows_match_tokens():
    tokens = (torch.arange(1003) % 251).to(torch.uint8)
    regions = [_stream(tokens, shard=s, num_shards=3).region for s in range(3)]
    assert regions[0][0] == 0 and regions[-1][1] == 1003
    assert all(a[1] == b[0] for a, b in zip(regions, regions[1:]))
    probe, stream = _stream(tokens, shard=1, num_shards=3), _stream(tokens, shard=1, num_shards=3)
    lo, hi = stream.region
    for _ in range(20):
        starts = probe.next_starts()
        x, y = stream.next_batch("cpu")
        assert x.dtype == torch.long and x.shape == (8, 16) and y.shape == (8, 16)
        assert ((starts >= lo) & (starts + 17 <= hi)).all()
        for b, st in enumerate(starts.tolist()):
            assert torch.equal(x[b], tokens[st:st + 16].long())
            assert torch.equal(y[b], tokens[st + 1:st + 17].long())


def test_stream_is_deterministic_and_independent_of_global_rng():
    tokens = torch.randint(0, 256, (4000,), dtype=torch.uint8)
    a, b = _stream(tokens, seed=3), _stream(tokens, seed=3)
    other_seed, other_shard = _stream(tokens, seed=4), _stream(tokens, shard=1, seed=3)
    for i in range(5):
        torch.manual_seed(i)
        xa, ya = a.next_batch("cpu")
        torch.manual_seed(100 + i)
        xb, yb = b.next_batch("cpu")
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.batches_drawn == 5
    assert not torch.equal(_stream(tokens, seed=3).next_starts(), other_seed.next_starts())
    # the shard enters the seed: offsets relative to each region differ between shards
    assert not torch.equal(_stream(tokens, seed=3).next_starts() - 0, other_shard.next_starts() - other_shard.region[0])


def test_state_dict_resume_gives_identical_next_batches():
    tokens = torch.randint(0, 256, (4000,), dtype=torch.uint8)
    original = _stream(tokens, shard=2, seed=9)
    for _ in range(3):
        original.next_batch("cpu")
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    expected = [original.next_batch("cpu") for _ in range(3)]

    resumed = _stream(tokens, shard=2, seed=9)
    resumed.next_batch("cpu")  # its own position must be overwritten
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    assert resumed.batches_drawn == 3
    for x, y in expected:
        rx, ry = resumed.next_batch("cpu")
        assert torch.equal(rx, x) and torch.equal(ry, y)
    # a fresh stream is *not* at that position (the test above would catch a no-op load)
    assert not torch.equal(_stream(tokens, shard=2, seed=9).next_batch("cpu")[0], expected[0][0])


def test_load_state_dict_rejects_a_different_stream():
    tokens = torch.randint(0, 256, (4000,), dtype=torch.uint8)
    state = _stream(tokens, shard=2).state_dict()
    with pytest.raises(CheckpointError, match="shard: saved 2, now 1"):
        _stream(tokens, shard=1).load_state_dict(state)
    with pytest.raises(CheckpointError, match="malformed"):
        _stream(tokens, shard=2).load_state_dict({"generator": state["generator"]})


def test_short_region_is_a_config_error():
    tokens = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="fewer shards"):
        _stream(tokens, num_shards=8, seq_len=16)  # 12 tokens per shard < 17
    _stream(tokens, num_shards=5, seq_len=16)  # 20 tokens per shard: fine


# ---------------------------------------------------------------- evaluation


def _tiny_model(dropout=0.0):
    torch.manual_seed(0)
    return build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, dropout=dropout))


def test_evaluate_is_deterministic_and_restores_mode():
    val = torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    model = _tiny_model(dropout=0.5)
    model.train()
    first = evaluate(model, val, batch_size=4, seq_len=16, max_batches=3, device="cpu")
    torch.manual_seed(123)
    second = evaluate(model, val, batch_size=4, seq_len=16, max_batches=3, device="cpu")
    assert first == second and math.isfinite(first)
    assert model.training
    model.eval()
    evaluate(model, val, batch_size=4, seq_len=16, max_batches=3, device="cpu")
    assert not model.training


def test_evaluate_uses_fixed_windows_from_the_start():
    val = torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    model = _tiny_model().eval()
    got = evaluate(model, val, batch_size=4, seq_len=16, max_batches=3, device="cpu")
    # reference: the first 12 non-overlapping windows, per-token mean
    w = torch.stack([val[i * 16:i * 16 + 17] for i in range(12)]).long()
    with torch.no_grad():
        _, ref = model(w[:, :-1], w[:, 1:])
    assert abs(got - ref.item()) < 1e-5
    # the same windows cut into other batches give the same mean
    uneven = evaluate(model, val, batch_size=5, seq_len=16, max_batches=2, device="cpu")  # 10 windows: 5 + 5
    w10 = w[:10]
    with torch.no_grad():
        _, ref10 = model(w10[:, :-1], w10[:, 1:])
    assert abs(uneven - ref10.item()) < 1e-5
    # data beyond the evaluated windows does not matter
    tail_changed = val.clone()
    tail_changed[12 * 16 + 1:] = 0
    assert evaluate(model, tail_changed, batch_size=4, seq_len=16, max_batches=3, device="cpu") == got


def test_evaluate_partial_last_batch_weights_per_token():
    val = torch.randint(0, 256, (16 * 7 + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    model = _tiny_model().eval()
    got = evaluate(model, val, batch_size=4, seq_len=16, max_batches=8, device="cpu")  # 7 windows: 4 + 3
    w = torch.stack([val[i * 16:i * 16 + 17] for i in range(7)]).long()
    with torch.no_grad():
        _, ref = model(w[:, :-1], w[:, 1:])
    assert abs(got - ref.item()) < 1e-5


def test_evaluate_rejects_too_short_val():
    with pytest.raises(ConfigError, match="seq_len"):
        evaluate(_tiny_model(), torch.zeros(16, dtype=torch.uint8), batch_size=2, seq_len=16, device="cpu")


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest(), "big")


def test_val_split_is_never_empty_and_train_never_empty(tmp_path):
    # With val_fraction=0.001 only paths with hash % 1000 == 0 would be held out: pick names that are not.
    names = [n for n in (f"doc{i}.txt" for i in range(50)) if _path_hash(n) % 1000 >= 1][:4]
    for n in names:
        _write(tmp_path / "few" / n, f"contents of {n}\n".encode() * 10)
    corpus = load_corpus(DataConfig(source=str(tmp_path / "few"), val_fraction=0.001))
    smallest = min(names, key=_path_hash)
    assert bytes(corpus.val.numpy()) == f"contents of {smallest}\n".encode() * 10
    # Two files that would both be held out at 0.5: the larger hash goes back to training.
    both = [n for n in (f"doc{i}.txt" for i in range(50)) if _path_hash(n) % 1000 < 500][:2]
    for n in both:
        _write(tmp_path / "all" / n, f"contents of {n}\n".encode() * 10)
    corpus = load_corpus(DataConfig(source=str(tmp_path / "all"), val_fraction=0.5))
    largest = max(both, key=_path_hash)
    assert bytes(corpus.train.numpy()) == f"contents of {largest}\n".encode() * 10
    assert corpus.val.numel() > 0
