"""Wire codecs: sizes, error bounds, determinism, the owner-reduce pattern, error feedback."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from p2pdiloco.compression import CODECS, codec_by_id, get_codec
from p2pdiloco.compression.feedback import ErrorFeedback
from p2pdiloco.compression.quant4 import BLOCK_SIZE
from p2pdiloco.errors import WireError

pytestmark = pytest.mark.timeout(60)

QUANT4 = ["e3m0", "nf4", "fp4"]
#: absmax-per-64 codecs: the 4-bit ones and the 2-bit q2
ABSMAX = QUANT4 + ["q2"]
#: every codec with a scale per 64 values: those and the 1-bit q1 (its scale is the mean magnitude)
BLOCKWISE = ABSMAX + ["q1"]
ALL = ["fp32", "fp16"] + BLOCKWISE
SIZES = [1, 2, 5, 63, 64, 65, 127, 128, 1001, 4099]


def _inputs(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=g)
    if kind == "student2":  # Student-t, df = 2: heavy tails
        z = torch.randn(n, generator=g)
        chi2 = torch.randn(n, 2, generator=g).pow(2).sum(1)
        return z / (chi2 / 2).sqrt()
    if kind == "cauchy":
        return torch.tan(math.pi * (torch.rand(n, generator=g) - 0.5)).clamp(-1e6, 1e6)
    raise ValueError(kind)


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of the element's block (the quantity error bounds are relative to)."""
    n = x.numel()
    nb = -(-n // BLOCK_SIZE)
    xb = F.pad(x.abs(), (0, nb * BLOCK_SIZE - n)).view(nb, BLOCK_SIZE)
    return xb.amax(1, keepdim=True).expand(nb, BLOCK_SIZE).reshape(-1)[:n]


def test_registry_ids_are_stable():
    assert {n: c.codec_id for n, c in CODECS.items()} == {"fp32": 0, "fp16": 1, "e3m0": 2, "nf4": 3, "fp4": 4,
                                                          "q2": 5, "q1": 6, "sparse": 8}
    assert codec_by_id(2) is get_codec("e3m0")


@pytest.mark.parametrize("name", QUANT4)
def test_encoded_size_formula(name):
    c = get_codec(name)
    for n in [0] + SIZES:
        assert c.encoded_size(n) == 4 * math.ceil(n / 64) + math.ceil(n / 2)
        assert len(c.encode(torch.randn(n))) == c.encoded_size(n)


def test_stated_bounds():
    assert get_codec("e3m0").relative_error_bound == pytest.approx(0.25, abs=2e-6)
    assert get_codec("nf4").relative_error_bound == pytest.approx((1 - 0.6961928009986877) / 2, abs=2e-6)
    assert get_codec("fp4").relative_error_bound == pytest.approx(1 / 6, abs=2e-6)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kind", ["gauss", "student2", "cauchy"])
def test_roundtrip_within_bound(name, kind):
    c = get_codec(name)
    worst = 0.0
    for n in SIZES:
        x = _inputs(kind, n, seed=n) * 3.0
        y = c.decode(c.encode(x), n)
        assert y.dtype == torch.float32 and y.shape == (n,)
        if name == "fp16":  # fp16's bound is relative to each value, not to the block
            assert ((y - x).abs() <= c.relative_error_bound * x.abs() + 6e-8).all()
            continue
        ratio = ((y - x).abs() / _block_absmax(x)).max().item()
        worst = max(worst, ratio)
        assert ratio <= c.relative_error_bound
    if name in BLOCKWISE and kind == "gauss":
        assert worst > 0.5 * c.relative_error_bound  # the bound is not vacuous


@pytest.mark.parametrize("name", ABSMAX)
def test_bound_is_attained_near_widest_gap(name):
    """Values just past the midpoint of the widest gap err by about the bound."""
    c = get_codec(name)
    bound = c.relative_error_bound
    vals = sorted(set(float(v) for v in c.codebook))
    gaps = [(b - a, a, b) for a, b in zip(vals, vals[1:])]
    _, a, b = max(gaps)
    mid = (a + b) / 2
    x = torch.tensor([1.0, mid, mid - 1e-6, mid + 1e-6] + [0.0] * 60)
    y = c.roundtrip(x)
    err = (y - x).abs().max().item()
    assert bound - 1e-5 <= err <= bound


def test_q2_layout_size_and_codebook():
    """q2: fp32 scales, then four 2-bit codes per byte, first value in the highest bits; the codebook's
    inner magnitude 1/4 has a lower error than 1/3 or a ternary -1, 0, 1 on Gaussian blocks."""
    c = get_codec("q2")
    for n in [0] + SIZES:
        assert c.encoded_size(n) == 4 * math.ceil(n / 64) + math.ceil(n / 4)
        assert len(c.encode(torch.randn(n))) == c.encoded_size(n)
    # scale 2.0; -2 -> code 0, -0.6 -> -1/4 (code 1), 0.6 -> 1/4 (code 2), 2 -> code 3; 1.3 -> 1 (code 3,
    # past the midpoint 0.625 of 1/4 and 1), then three padding codes (1)
    data = c.encode(torch.tensor([-2.0, -0.6, 0.6, 2.0, 1.3]))
    assert data[:4] == torch.tensor([2.0]).numpy().tobytes() and data[4:] == bytes([0b00011011, 0b11010101])
    assert c.decode(data, 5).tolist() == [-2.0, -0.5, 0.5, 2.0, 2.0]
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(3))
    xn = x / x.abs().amax(1, keepdim=True)

    def mse(book):
        book = torch.tensor(book)
        return (book[(xn[..., None] - book).abs().argmin(-1)] - xn).pow(2).mean().item()

    ours = (c.roundtrip(x.reshape(-1)).view(2000, 64) / x.abs().amax(1, keepdim=True) - xn).pow(2).mean().item()
    assert ours == pytest.approx(mse([-1, -0.25, 0.25, 1]), rel=1e-4)
    assert ours < mse([-1, -1 / 3, 1 / 3, 1]) and ours < mse([-1, -0.2, 0.2, 1]) and ours < 0.5 * mse([-1, 0, 1])


def test_q1_layout_size_and_scale():
    """q1: fp32 scales (each block's mean magnitude), then eight sign bits per byte, first value in the
    highest bit, zero encoded as +; the mean magnitude has the lowest squared error of any ±s."""
    c = get_codec("q1")
    for n in [0] + SIZES:
        assert c.encoded_size(n) == 4 * math.ceil(n / 64) + math.ceil(n / 8)
        assert len(c.encode(torch.randn(n))) == c.encoded_size(n)
    x = torch.tensor([-2.0, 1.0, 0.0, -1.0, 4.0, -0.5, 0.5, 1.0, -3.0])  # mean magnitude 13/9
    data = c.encode(x)
    scale = torch.tensor([13.0 / 9.0]).numpy().tobytes()
    assert data[:4] == scale and data[4:] == bytes([0b01101011, 0b01111111])  # padding bits are 1
    s = torch.tensor([13.0 / 9.0]).item()
    assert c.decode(data, 9).tolist() == [-s, s, s, -s, s, -s, s, s, -s]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g) * torch.rand(64, generator=g)
    err = (c.roundtrip(x) - x).pow(2).sum().item()
    for f in (0.8, 0.95, 1.05, 1.25):
        assert err < (x.sign() * x.abs().mean() * f - x).pow(2).sum().item()


def test_e3m0_grid_and_value_domain_rounding():
    c = get_codec("e3m0")
    grid = torch.tensor([0.0] + [2.0 ** (e - 7) for e in range(1, 8)])
    x = torch.cat([grid, -grid])
    assert torch.equal(c.roundtrip(x), x)  # every grid point is exact (absmax 1)
    # value-domain rounding beats log-domain rounding in worst case and in MSE
    x = torch.cat([torch.tensor([1.0]), torch.rand(100_000, generator=torch.Generator().manual_seed(0))])
    x = x[: (x.numel() // 64) * 64]
    y = c.roundtrip(x)
    scale = x.view(-1, 64).abs().amax(1, keepdim=True)
    xn = (x.view(-1, 64) / scale).clamp(min=2.0**-30)
    e = torch.round(torch.log2(xn)).clamp(-6, 0)
    log_q = torch.where(xn < 2.0**-7, torch.zeros_like(xn), 2.0**e) * scale  # log-domain nearest
    err_val = (y.view(-1, 64) - x.view(-1, 64)).abs()
    err_log = (log_q - x.view(-1, 64)).abs()
    assert (err_val.pow(2).mean() < err_log.pow(2).mean()) and (err_val.max() < err_log.max())
    assert (err_log / scale).max() > 0.28  # 1 - sqrt(1/2) = 0.293


@pytest.mark.parametrize("name", BLOCKWISE)
def test_zeros_and_partial_blocks(name):
    c = get_codec(name)
    for n in [1, 7, 64, 130]:
        z = torch.zeros(n)
        data = c.encode(z)
        assert torch.equal(c.decode(data, n), z)
    # a zero block next to a non-zero block
    x = torch.cat([torch.zeros(64), torch.randn(10)])
    y = c.roundtrip(x)
    assert torch.equal(y[:64], torch.zeros(64))


@pytest.mark.parametrize("name", ALL)
def test_decode_rejects_wrong_length(name):
    c = get_codec(name)
    data = c.encode(torch.randn(101))
    for bad in (data[:-1], data + b"\0"):
        with pytest.raises(WireError):
            c.decode(bad, 101, sender="peerX")
    with pytest.raises(WireError):
        c.decode(data, 93)  # a count whose encoding is shorter for every codec (q1's 100 would still fit 101's bytes)


@pytest.mark.parametrize("name", BLOCKWISE)
def test_decode_rejects_bad_scales(name):
    c = get_codec(name)
    data = bytearray(c.encode(torch.ones(64)))
    data[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(WireError):
        c.decode(bytes(data), 64)
    data[0:4] = torch.tensor([float("inf")]).numpy().tobytes()
    with pytest.raises(WireError):
        c.decode(bytes(data), 64)
    data[0:4] = torch.tensor([-1.0]).numpy().tobytes()
    with pytest.raises(WireError):
        c.decode(bytes(data), 64)


@pytest.mark.parametrize("name", BLOCKWISE)
def test_encode_rejects_non_finite(name):
    with pytest.raises(ValueError):
        get_codec(name).encode(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("name", ALL)
def test_deterministic_and_thread_independent(name):
    c = get_codec(name)
    x = _inputs("student2", 10_007)
    data = c.encode(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert c.encode(x) == data
        one = c.decode(data, x.numel())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(c.decode(data, x.numel()), one)
    assert torch.equal(c.decode(data, x.numel()), c.decode(bytes(data), x.numel()))


@pytest.mark.parametrize("name", BLOCKWISE)
def test_owner_reduce_three_peers(name):
    """Owner decodes each peer's part, means in fp32, encodes once; everyone decodes the same bytes.

    Bound per element: b * (mean_i A_i + A_mean), where b is the codec's relative bound, A_i the
    block absmax of peer i's part and A_mean the block absmax of the mean of the decoded parts:
    each part errs by at most b*A_i (so their mean by the mean of those), then the mean once more.
    """
    c = get_codec(name)
    n = 1000
    parts = [_inputs(k, n, seed=s) * (s + 1) for s, k in enumerate(["gauss", "student2", "cauchy"])]
    decoded = [c.decode(c.encode(p), n) for p in parts]
    mean = torch.stack(decoded).mean(0)
    wire = c.encode(mean)
    results = [c.decode(bytes(wire), n) for _ in parts]
    assert all(torch.equal(r, results[0]) for r in results)
    true_mean = torch.stack(parts).mean(0)
    bound = c.relative_error_bound * (torch.stack([_block_absmax(p) for p in parts]).mean(0) + _block_absmax(mean))
    assert ((results[0] - true_mean).abs() <= bound).all()


@pytest.mark.timeout(300)  # importing bitsandbytes takes ~10 s idle, over a minute on a loaded 2-core box
@pytest.mark.parametrize("name", ["nf4", "fp4"])  # bitsandbytes has no E3M0
def test_matches_bitsandbytes_codebook(name):
    """Our codes mean what bitsandbytes' codes mean (nf4/fp4), and dequantized values mostly agree."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    x = torch.randn(64 * 257, generator=torch.Generator().manual_seed(1))
    try:
        q, state = bnbf.quantize_4bit(x, blocksize=64, quant_type=name)
    except Exception as e:  # pragma: no cover - depends on the installed backend
        pytest.skip(f"bitsandbytes cannot quantize on this device: {e}")
    assert torch.allclose(state.code.float().cpu(), torch.tensor(get_codec(name).codebook), atol=1e-6)
    theirs = bnbf.dequantize_4bit(q, state).reshape(-1).float()
    ours = get_codec(name).roundtrip(x)
    assert (ours == theirs).float().mean() > 0.999 or (ours - theirs).abs().max() < 1e-6 * x.abs().max()


def test_error_feedback_invariant_with_codec():
    c = get_codec("e3m0")
    ef = ErrorFeedback()
    g = torch.Generator().manual_seed(0)
    true_sum = torch.zeros(300)
    applied_sum = torch.zeros(300)
    plain_sum = torch.zeros(300)
    for _ in range(20):
        x = torch.randn(300, generator=g) + 0.3  # a persistent bias that plain rounding distorts
        sent = ef.compensate("w", x)
        applied = c.roundtrip(sent)
        ef.update("w", sent, applied)
        true_sum += x
        applied_sum += applied
        plain_sum += c.roundtrip(x)
    assert torch.allclose(applied_sum + ef.residual("w"), true_sum, atol=1e-5)
    # with feedback the accumulated error stays one round's error; without it, it grows
    assert (applied_sum - true_sum).norm() < 0.5 * (plain_sum - true_sum).norm()
    state = ef.state_dict()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(state)
    assert torch.equal(ef2.residual("w"), ef.residual("w"))
    with pytest.raises(ValueError):
        ef.compensate("w", torch.zeros(3))
    ef.reset("w")
    assert "w" not in ef and len(ef) == 0


@pytest.mark.parametrize("name", QUANT4)
def test_fast_encoder_equals_bucketize(name):
    """The bin-table encoder picks exactly the codes of a sorted-midpoint search, edges included."""
    c = get_codec(name)
    assert c._bins is not None
    mids = c._midpoints
    edges = (torch.arange(0, 1026, dtype=torch.float64) - 0.5) / 512 - 1
    edges = edges[(edges >= -1) & (edges <= 1)].float()
    pts = torch.cat([mids, edges, torch.tensor([-1.0, 1.0, 0.0, -0.0])])
    x = torch.cat([
        torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1,
        pts, torch.nextafter(pts, torch.tensor(2.0)), torch.nextafter(pts, torch.tensor(-2.0)),
    ]).clamp(-1, 1)
    expected = c._sorted_codes[torch.bucketize(x, mids)]
    assert torch.equal(c._codes(x), expected)


@pytest.mark.parametrize("name", QUANT4)
def test_chunked_path_gives_identical_bytes(name, monkeypatch):
    import p2pdiloco.compression.quant4 as q4

    c = get_codec(name)
    for n in [1000, 1001, 4096, 4097]:
        x = _inputs("student2", n, seed=n)
        monkeypatch.setattr(q4, "_CPU_CHUNK", 1 << 40)
        whole = c.encode(x)
        whole_dec = c.decode(whole, n)
        monkeypatch.setattr(q4, "_CPU_CHUNK", 128)
        assert c.encode(x) == whole
        assert torch.equal(c.decode(whole, n), whole_dec)


def _fused_or_torch(monkeypatch, fused_on: bool) -> None:
    import p2pdiloco.compression.quant4 as q4

    monkeypatch.setattr(q4, "_FUSED_MIN", 0 if fused_on else 1 << 62)


@pytest.mark.parametrize("name", QUANT4)
def test_fused_kernels_give_the_torch_paths_bytes_and_values(name, monkeypatch):
    """The one-pass CPU kernels (compression/fused.py, numba; E3M0 from the exponent bits, the others by
    the bin tables) encode to the very bytes of the torch path and decode to its very values: midpoints and bin edges hit exactly, ±0, subnormals, whole-zero
    blocks, heavy tails, odd tails; and they are the path taken (counted)."""
    from p2pdiloco.compression import fused

    assert fused.kernels() is not None, "numba is a dependency: the fused kernels must compile here"
    c = get_codec(name)
    mids = c._midpoints
    edges = ((torch.arange(0, 1026, dtype=torch.float64) - 0.5) / 512 - 1).float()
    pts = torch.cat([mids, edges[(edges >= -1) & (edges <= 1)], torch.tensor([-1.0, 1.0, 0.0, -0.0])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(2.0)), torch.nextafter(pts, torch.tensor(-2.0))]).clamp(-1, 1)
    # blocks of 63 points plus an exact 1.0, so that x / absmax is the point itself
    blocks = torch.cat([F.pad(pts, (0, (-pts.numel()) % 63)).view(-1, 63), torch.ones(-(-pts.numel() // 63), 1)], 1)
    tiny = torch.full((64,), 1e-40)  # subnormal block
    tiny[::3] = -1e-41
    inputs = [blocks.reshape(-1) * 3.0, torch.zeros(130), tiny] + [
        _inputs(kind, n, seed=n) for kind in ("gauss", "student2", "cauchy") for n in (1, 63, 65, 1001, 20_001)]
    calls = {"encode": 0, "decode": 0}
    enc, enc_e, dec = fused.encode_into, fused.encode_e3m0_into, fused.decode_into
    monkeypatch.setattr(fused, "encode_into", lambda *a: calls.__setitem__("encode", calls["encode"] + 1) or enc(*a))
    monkeypatch.setattr(fused, "encode_e3m0_into",  # E3M0's own kernel: the code from the exponent bits
                        lambda *a: calls.__setitem__("encode", calls["encode"] + 1) or enc_e(*a))
    monkeypatch.setattr(fused, "decode_into", lambda *a: calls.__setitem__("decode", calls["decode"] + 1) or dec(*a))
    for x in inputs:
        n = x.numel()
        _fused_or_torch(monkeypatch, False)
        want = c.encode(x)
        want_dec = c.decode(want, n)
        before = dict(calls)
        _fused_or_torch(monkeypatch, True)
        got = c.encode(x)
        assert got == want, (name, n)
        assert torch.equal(c.decode(got, n).view(torch.int32), want_dec.view(torch.int32))
        out = torch.full((n,), float("nan"))
        c.decode_into(got, out)
        assert torch.equal(out.view(torch.int32), want_dec.view(torch.int32))
        assert calls["encode"] == before["encode"] + 1 and calls["decode"] >= before["decode"] + 2


@pytest.mark.parametrize("name", QUANT4)
def test_fused_kernels_refuse_what_the_torch_path_refuses(name, monkeypatch):
    _fused_or_torch(monkeypatch, True)
    c = get_codec(name)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(300)
        x[257] = bad
        with pytest.raises(ValueError, match="non-finite"):
            c.encode(x)
    good = c.encode(torch.randn(300))
    for scale in (-1.0, float("nan"), float("inf")):
        blob = bytearray(good)
        blob[4 * 2: 4 * 3] = torch.tensor([scale]).numpy().astype("<f4").tobytes()  # block 2's scale
        with pytest.raises(WireError, match="scale"):
            c.decode(bytes(blob), 300)
        with pytest.raises(WireError, match="scale"):
            c.decode_into(bytes(blob), torch.empty(300))


@pytest.mark.parametrize("name", QUANT4)
def test_fused_kernels_in_slices_on_several_threads_give_the_same_bytes(name, monkeypatch):
    """Long vectors are coded in block-aligned slices side by side (one per torch thread): the bytes
    and values do not depend on how they were cut."""
    from p2pdiloco.compression import fused

    _fused_or_torch(monkeypatch, True)
    monkeypatch.setattr(fused, "PARALLEL_MIN", 128)
    threads = torch.get_num_threads()
    c = get_codec(name)
    try:
        for n in (1001, 20_001, 64 * 37):
            x = _inputs("student2", n, seed=n)
            torch.set_num_threads(1)
            assert fused._slices(n) == [(0, n)]
            one = c.encode(x)
            one_dec = c.decode(one, n)
            torch.set_num_threads(3)
            cuts = fused._slices(n)
            assert len(cuts) == 3 and all(a % 64 == 0 for a, _ in cuts) and cuts[-1][1] == n
            assert c.encode(x) == one
            assert torch.equal(c.decode(one, n).view(torch.int32), one_dec.view(torch.int32))
    finally:
        torch.set_num_threads(threads)
