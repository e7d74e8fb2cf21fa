"""The native 4-bit and 8-bit block kernel (``kernels.BlockWeight``, ``native/decoder.cpp``'s
``block_matmul``) against a dense reference on random blocks, odd shapes included; GGUF's blocks kept
exactly; a row's result independent of the call; lossless methods exact in q4 with it.  Skipped when
the extension is not built (``layerleap native --build``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import random_model

from layerleap.core import kernels
from layerleap.core.gguf_q4 import blocks_to_rows, q6_k_rows, q8_0_rows
from layerleap.core.kernels import BlockWeight, Int8Rows, Q6Rows, QuantizedRows
from layerleap.core.loading import quantize_model

pytestmark = pytest.mark.skipif(
    not kernels.blocks_available(), reason="the native layers are not built: run `layerleap native --build`"
)


def _rows(n: int, k: int, seed: int = 0, half: bool = True) -> QuantizedRows:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3
    minimum = -torch.rand(n, k // 32, generator=g) * 0.4
    if half:
        scale, minimum = scale.half().float(), minimum.half().float()
    return QuantizedRows(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scale, minimum)


def _int8(n: int, k: int, seed: int = 0) -> Int8Rows:
    g = torch.Generator().manual_seed(seed)
    return Int8Rows(
        torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        (torch.rand(n, k // 32, generator=g) * 0.01).half().float(),
    )


def _reference(x: torch.Tensor, w: torch.Tensor, fine: bool = True) -> torch.Tensor:
    """What the kernel computes, in float64: activations rounded per group of 32 to ``qmax`` steps of
    amax/qmax (15 bits fine, 8 bits coarse), each group's integer dot product with the codes, scaled;
    ``w`` the exact dense weight [N, K]."""
    qmax = 127 * 128 if fine else 127
    M, K = x.shape
    xg = x.double().view(M, K // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    d = amax / qmax
    q = torch.where(amax > 0, torch.round(xg * (qmax / amax.clamp_min(1e-30))), torch.zeros_like(xg))
    return (q * d).view(M, K) @ w.double().t()


def _weight(bits: int, n: int, k: int, seed: int, half: bool = True, fine: bool = True) -> BlockWeight:
    w = BlockWeight.from_rows(_rows(n, k, seed, half)) if bits == 4 else BlockWeight.from_int8(_int8(n, k, seed))
    w.fine = fine
    return w


SHAPES = [(1, 32, 16), (3, 64, 17), (5, 96, 37), (16, 576, 48), (17, 160, 100), (2, 1536, 64)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fine", [True, False])
def test_block_product_matches_dense_reference(m, k, n, bits, fine):
    w = _weight(bits, n, k, seed=n, fine=fine)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    y = w(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    dense = w.dense()
    ref = _reference(x, dense, fine)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() < 1e-5 * scale + 1e-6  # the same sum up to fp32 rounding
    # and close to the product without rounding the activations (15 bits: ~1e-4 of the output, 8: ~1%)
    exact = x.double() @ dense.double().t()
    assert (y.double() - exact).abs().max().item() < (1e-3 if fine else 0.02) * exact.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fine", [True, False])
def test_every_row_count_matches_dense_reference(bits, fine):
    w = _weight(bits, 37, 96, seed=7, fine=fine)
    dense = w.dense()
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(8)) * torch.linspace(0.01, 30, 96)
    x[3, 5] = 500.0  # an outlier in one group
    for m in range(1, 17):
        ref = _reference(x[:m], dense, fine)
        assert (w(x[:m]).double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6, m


def _paths() -> list[str]:
    return list(kernels._native_blocks().blocks_paths())


def test_the_paths_built_here_include_the_portable_one():
    mod = kernels._native_blocks()
    assert _paths()[-1] == "portable" and mod.blocks_isa() == _paths()[0]
    with pytest.raises(RuntimeError, match="no path"):
        mod.block_matmul(torch.zeros(1, 32), *_weight(4, 16, 32, 0).native_proj()[1:], 16, True, "sse9")


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fine", [True, False])
def test_every_path_equals_portable_path_bit_for_bit(bits, half, fine):
    mod = kernels._native_blocks()
    w = _weight(bits, 45, 192, 1, half)
    x = torch.randn(16, 192, generator=torch.Generator().manual_seed(2))
    b = mod.block_matmul(x, w.codes, w.dm, w.out_features, fine, "portable")
    for path in _paths():
        for m in range(1, 17):
            a = mod.block_matmul(x[:m], w.codes, w.dm, w.out_features, fine, path)
            assert torch.equal(a, b[:m]), (path, m)


@pytest.mark.parametrize("fine", [True, False])
def test_a_nan_activation_gives_a_nan_row_on_every_path(fine):
    """A NaN in one input (an overflow inside a layer) makes that row NaN, as the dense product does: the
    rounding's group maximum skips a NaN, so it must not be read as a finite value."""
    mod = kernels._native_blocks()
    w = _weight(4, 33, 96, 5)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    x[1, 5] = float("nan")
    for path in _paths():
        got = mod.block_matmul(x, w.codes, w.dm, w.out_features, fine, path)
        assert torch.isnan(got[1]).all(), path
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all(), path


@pytest.mark.parametrize("fine", [True, False])
def test_vector_rounding_of_activations_equals_the_portable_one(fine):
    """The vector paths round activations with their own instructions, the portable path with scalar
    code: equal bits for groups of zeros, ties at half a step, outliers, tiny and huge magnitudes."""
    mod = kernels._native_blocks()
    w = _weight(4, 33, 320, 4)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 320, generator=g)
    x[0, :32] = 0.0  # a group of zeros
    x[1] = torch.round(x[1] * 4) / 4  # many exact ties
    x[1, ::32] = 4.0  # amax 4: steps of 4/qmax
    x[2, 40] = 1e4  # an outlier
    x[3] *= 1e-30
    x[4] *= 1e30
    x[5, 64:96] = -2.0  # a constant group
    x[6] = torch.arange(320) % 7 - 3.0
    want = mod.block_matmul(x, w.codes, w.dm, w.out_features, fine, "portable")
    for path in _paths():
        for m in (1, 7):
            got = mod.block_matmul(x[:m], w.codes, w.dm, w.out_features, fine, path)
            assert torch.equal(got, want[:m]), (path, m)


@pytest.mark.parametrize("fine", [True, False])
def test_extreme_codes_and_activations_do_not_overflow(fine):
    """8-bit codes 0, 1 and 255 against activations at their group's maximum (where 16-bit pair sums
    of 8-bit products would saturate), and 4-bit codes 15: the integer sums stay exact."""
    mod = kernels._native_blocks()
    n, k = 16, 64
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[1::2] = -128
    q[::4, ::3] = -127
    rows4 = QuantizedRows(torch.full((n, k), 15, dtype=torch.uint8), torch.ones(n, k // 32), torch.zeros(n, k // 32))
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    for w in (BlockWeight.from_int8(Int8Rows(q, torch.full((n, k // 32), 2.0**-10))), BlockWeight.from_rows(rows4)):
        ref = x.double() @ w.dense().double().t()
        for path in _paths():
            y = mod.block_matmul(x, w.codes, w.dm, w.out_features, fine, path)
            assert (y.double() - ref).abs().max().item() < 1e-6 * ref.abs().max().item(), (w.bits, path)


def test_codes_scales_and_lookups_are_exact():
    r = _rows(37, 96, 5)
    w = BlockWeight.from_rows(r)
    assert w.codes.shape == (3, 3, 4, 16, 4) and w.nbytes == 3 * 3 * 256 + 3 * 3 * 32 * 2
    assert torch.equal(w.dense(), r.dense())
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(w.rows(ids), r.dense()[ids].to(torch.bfloat16))
    e = _int8(21, 64, 6)
    b8 = BlockWeight.from_int8(e)
    assert b8.bits == 8 and torch.equal(b8.dense(), e.dense())
    assert torch.equal(b8.rows(torch.tensor([20, 3])), e.rows(torch.tensor([20, 3])))


@pytest.mark.parametrize("bits", [4, 8])
def test_block_rows_refuse_ids_outside_the_table(bits):
    """Ids past a block table's rows (in its last block's padding, or negative) are refused, not
    looked up as a padding row's zeros."""
    w = _weight(bits, 37, 64, 3)
    for ids in ([0, 37], [40], [-1]):
        for lookup in (w.rows, w.dense_rows):
            with pytest.raises(IndexError, match="outside the table.s 37 rows"):
                lookup(torch.tensor(ids))
    assert torch.equal(w.dense_rows(torch.tensor([36, 0])), w.dense()[[36, 0]])


def test_a_q4_model_refuses_token_ids_past_its_vocabulary_as_a_dense_one_does(monkeypatch):
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    base = random_model("llama-gqa-tied", seed=3)
    q4 = quantize_model(base)
    V = base.config.vocab_size
    assert isinstance(q4.tok_embeddings.packed, BlockWeight) and V % 16
    with torch.inference_mode():
        for ids in ([[V]], [[1, V + 2]], [[-1]], [[5] * 8 + [V]]):  # a decoding step's lookup and a prompt's
            for m in (base, q4):
                with pytest.raises(IndexError):
                    m(torch.tensor(ids))


def test_rows_taken_from_8bit_blocks_are_those_rows_exactly(monkeypatch):
    """``take_rows`` keeps the rows' own codes and scales (any ids, repeated, across blocks, an odd
    count), so its product is the rows' product bit for bit; 4-bit blocks are refused.  A q4 model's
    draft vocabulary takes its 8-bit rows that way where 8-bit rows are the fastest (forced here)."""
    from layerleap.drafters import draft_vocab as dv

    w = BlockWeight.from_int8(_int8(53, 96, 7))
    ids = torch.tensor([52, 0, 17, 16, 17, 31, 33])
    taken = w.take_rows(ids)
    assert taken.out_features == 7 and taken.fine == w.fine and torch.equal(taken.dense(), w.dense_rows(ids))
    x = torch.randn(3, 96)
    assert torch.equal(taken.matmul(x), w.matmul(x)[:, ids])
    with pytest.raises(kernels.KernelError, match="8-bit"):
        BlockWeight.from_rows(_rows(16, 64, 1)).take_rows(ids[:1])
    model = quantize_model(random_model("llama-gqa-tied"))
    assert isinstance(model.lm_head.packed, BlockWeight) and model.lm_head.packed.bits == 8
    monkeypatch.setattr(kernels, "draft_head_q8", lambda weight: True)
    vocab = dv.DraftVocab(model, torch.tensor([9, 3, 40, 41]))
    assert vocab.head.q8 is not None and vocab.head.column_major is None
    assert torch.equal(vocab.head.q8.dense(), model.head_rows(vocab.ids))
    z = torch.randn(2, model.config.hidden_size)
    assert torch.equal(vocab.logits(z), dv.DraftRows(model.head_rows(vocab.ids))(z).float())


def test_packed_embedding_serves_decoding_lookups_from_its_rows_cache():
    """A few ids (a decoding step) come from rows dequantized before: the same values as unpacking them
    for that lookup, for every packed table, repeated ids, and again after the table is packed anew."""
    from layerleap.core.model import ROW_CACHE_IDS, Embedding

    emb = Embedding(37, 64)
    for table in (BlockWeight.from_rows(_rows(37, 64, 1)), _int8(37, 64, 2), BlockWeight.from_int8(_int8(37, 64, 3))):
        emb.pack(table)
        with torch.no_grad():
            many = [list(range(ROW_CACHE_IDS + 1))]  # a prompt's ids: unpacked for the lookup
            for ids in ([[5]], [[5, 5, 36]], [[0], [17]], [3], [[1] * ROW_CACHE_IDS], many):
                ids = torch.tensor(ids, dtype=torch.long)
                first, again = emb(ids), emb(ids)
                want = table.rows(ids)
                assert first.dtype == want.dtype and torch.equal(first, want) and torch.equal(again, want)
            assert emb._rows[0] is table and 5 in emb._rows[1]  # the decoding lookups were kept
        assert torch.equal(emb(torch.tensor([[5]])), table.rows(torch.tensor([[5]])))  # with grad: unpacked


def _gguf_blocks(qtype: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    n_half = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2, "Q8_0": 1}[qtype]
    raw[:, : 2 * n_half] = (rng.standard_normal((n_blocks, n_half)) * 0.01).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_are_kept_exactly(qtype):
    from gguf import GGMLQuantizationType, dequantize

    n_rows, n_cols = 19, 512
    per_row = n_cols // (256 if qtype == "Q4_K" else 32)
    raw = _gguf_blocks(qtype, n_rows * per_row).reshape(n_rows, -1)
    if qtype == "Q8_0":
        w = BlockWeight.from_int8(q8_0_rows(raw, n_rows, n_cols))
    else:
        w = BlockWeight.from_rows(blocks_to_rows(raw, qtype, n_rows, n_cols))
    want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n_rows, n_cols)
    assert np.array_equal(w.dense().numpy(), want)  # codes and scales as stored
    # fp16 wherever exact; Q4_K's scales as its fp16 pair per super-block times 6-bit multipliers
    assert w.dm.dtype == (torch.uint8 if qtype == "Q4_K" else torch.float16)
    if qtype == "Q4_K":
        ids = torch.tensor([18, 0, 7])
        assert np.array_equal(w.rows(ids).float().numpy(), torch.from_numpy(want)[ids].bfloat16().float().numpy())


def _q4k_rows(n: int, k: int, seed: int = 0, most: int = 63) -> QuantizedRows:
    """Random Q4_K-like rows: per 8 groups an fp16 d and dmin (either sign) times 6-bit multipliers
    (at most ``most``), exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    s = k // 256
    d = (torch.randn(n, s, 2, 1, generator=g) * 0.01).half().float()
    mult = torch.randint(0, most + 1, (n, s, 2, 8), generator=g).float()
    v = (d * mult).view(n, s, 2, 8).permute(0, 2, 1, 3).reshape(n, 2, k // 32)
    return QuantizedRows(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), v[:, 0], v[:, 1])


@pytest.mark.parametrize("m,n,most", [(1, 16, 63), (3, 37, 63), (8, 45, 40), (17, 100, 5)])
def test_super_block_scales_equal_fp32_scales_bit_for_bit(m, n, most):
    """Q4_K's scales as 8-bit multipliers of an fp16 per super-block (0.625 bits a weight) give the
    same bits as the same scales in fp32 (2 bits a weight) on every path, and match the reference."""
    mod = kernels._native_blocks()
    rows = _q4k_rows(n, 512, seed=n, most=most)
    w = BlockWeight.from_rows(rows)
    assert w.dm.dtype == torch.uint8 and w.dm.shape == ((n + 15) // 16, 2, kernels.SUPER_BYTES)
    assert torch.equal(w.dense(), rows.dense())
    assert w.nbytes == w.codes.numel() + w.dm.numel() < 0.6 * 16 * ((n + 15) // 16) * 512
    fp32 = w._dm_blocks()
    assert fp32.dtype == torch.float32 and fp32.shape == ((n + 15) // 16, 16, 2, 16)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    ref = _reference(x, rows.dense())
    for fine in (True, False):
        want = mod.block_matmul(x, w.codes, fp32, n, fine, "portable")
        for path in _paths():
            assert torch.equal(mod.block_matmul(x, w.codes, w.dm, n, fine, path), want), (path, fine)
    assert (w(x).double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6


def test_scales_that_are_no_products_stay_fp32():
    rows = _rows(20, 512, 3, half=False)  # arbitrary fp32 scales
    assert BlockWeight.from_rows(rows).dm.dtype == torch.float32
    mixed = QuantizedRows.cat([_q4k_rows(16, 512, 1), rows])  # one block of rows is not Q4_K: all fp32
    w = BlockWeight.from_rows(mixed)
    assert w.dm.dtype == torch.float32 and torch.equal(w.dense(), mixed.dense())
    r = _q4k_rows(16, 512, 2)
    part = QuantizedRows(r.q[:, :288], r.scale[:, :9], r.minimum[:, :9])  # 9 groups: no whole super-blocks
    assert BlockWeight.from_rows(part).dm.dtype == torch.float32
    with pytest.raises(RuntimeError, match="scales do not fit"):
        w8 = BlockWeight.from_rows(_q4k_rows(16, 512, 4))
        kernels._native_blocks().block_matmul(torch.zeros(1, 256), w8.codes, w8.dm, 16, True, "")


def _q6(n: int, k: int, seed: int = 0) -> Q6Rows:
    g = torch.Generator().manual_seed(seed)
    return Q6Rows(
        torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
        torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8),
        (torch.rand(n, k // 256, generator=g) * 1e-3).half().float(),
    )


@pytest.mark.parametrize("m,k,n", [(1, 256, 16), (3, 512, 17), (8, 256, 45), (17, 768, 100), (2, 1536, 33)])
@pytest.mark.parametrize("fine", [True, False])
def test_6bit_product_matches_dense_reference(m, k, n, fine):
    """Q6_K as stored (6-bit codes, int8 scales per 16, fp16 per 256) against the dense reference, and
    every path (1 to 16 rows) equal to the portable one bit for bit."""
    rows = _q6(n, k, seed=n)
    w = BlockWeight.from_q6(rows)
    w.fine = fine
    assert w.bits == 6 and w.codes.shape == ((n + 15) // 16, k // 32, 6, 16, 4)
    assert w.nbytes == w.codes.numel() + w.dm.numel() and w.nbytes * 8 == 6.5625 * 16 * ((n + 15) // 16) * k
    dense = w.dense()
    assert torch.equal(dense, rows.dense())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * torch.linspace(0.1, 3, k)
    ref = _reference(x, dense, fine)
    y = w(x)
    assert y.shape == (m, n) and (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6
    mod = kernels._native_blocks()
    xs = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    want = mod.block_matmul(xs, w.codes, w.dm, n, fine, "portable")
    for path in _paths():
        for rows_n in (1, 3, 8, 9, 16):
            got = mod.block_matmul(xs[:rows_n], w.codes, w.dm, n, fine, path)
            assert torch.equal(got, want[:rows_n]), (path, rows_n)


@pytest.mark.parametrize("fine", [True, False])
def test_6bit_extreme_codes_and_scales_do_not_overflow(fine):
    n, k = 16, 512
    q = torch.full((n, k), 63, dtype=torch.uint8)
    q[1::2] = 0
    sc = torch.full((n, k // 16), 127, dtype=torch.int8)
    sc[::3] = -128
    w = BlockWeight.from_q6(Q6Rows(q, sc, torch.full((n, k // 256), 2.0**-12)))
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    ref = x.double() @ w.dense().double().t()
    for path in _paths():
        y = kernels._native_blocks().block_matmul(x, w.codes, w.dm, n, fine, path)
        assert (y.double() - ref).abs().max().item() < 1e-6 * ref.abs().max().item(), path


def test_gguf_q6_k_blocks_are_kept_exactly():
    from gguf import GGMLQuantizationType, dequantize

    n_rows, n_cols = 21, 512
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (n_rows * n_cols // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n_rows, -1)
    rows = q6_k_rows(raw, n_rows, n_cols)
    want = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(n_rows, n_cols)
    assert np.array_equal(rows.dense().numpy(), want)
    w = BlockWeight.from_q6(rows)
    assert np.array_equal(w.dense().numpy(), want)
    ids = torch.tensor([[20, 0], [16, 5]])
    assert torch.equal(w.rows(ids), torch.from_numpy(want)[ids].to(torch.bfloat16))
    assert torch.equal(rows.take_rows(torch.tensor([3, 1])).dense(), rows.dense()[[3, 1]])
    with pytest.raises(kernels.KernelError):
        BlockWeight(w.codes, w.dm, n_rows, 4)


def test_refuses_codes_that_do_not_fit():
    w = BlockWeight.from_rows(_rows(20, 64))
    with pytest.raises(kernels.KernelError):
        BlockWeight(w.codes, w.dm, 40, 4)
    with pytest.raises(kernels.KernelError):
        BlockWeight(w.codes, w.dm, 20, 8)


# -- models ---------------------------------------------------------------------------------------
@pytest.fixture
def blocks_format(monkeypatch):
    monkeypatch.setenv(kernels.Q4_ENV, "blocks")


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-gqa-untied", "mistral-gqa-untied"])
def test_q4_model_on_blocks_is_close_and_small(name, blocks_format):
    from layerleap.core.loading import build

    dense = random_model(name, seed=3)
    q4 = quantize_model(random_model(name, seed=3))
    assert q4.dtype_name == "q4" and q4.fingerprint == dense.fingerprint
    assert {type(lin.packed) for lin in q4.projections()} == {BlockWeight}
    assert q4.lm_head.packed.bits == 8 and q4.tok_embeddings.packed.bits == 8
    if dense.config.tie_embeddings:
        assert q4.lm_head.packed is q4.tok_embeddings.packed  # one 8-bit table
    assert q4.weight_bytes() < dense.weight_bytes() / 3
    sd = {k: v.float() for k, v in q4.dense_state().items()}
    if dense.config.tie_embeddings:
        del sd["lm_head.weight"]
    ref = build(dense.config, sd, torch.float32, pack=False)
    ids = torch.randint(0, dense.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = ref(ids), q4(ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_activation_bits_follow_the_environment(monkeypatch):
    r = _rows(16, 64)
    assert BlockWeight.from_rows(r).fine and BlockWeight.from_rows(r).native_proj()[0] == 4
    monkeypatch.setenv(kernels.Q4_ACTIVATIONS_ENV, "8")
    coarse = BlockWeight.from_rows(r)
    assert not coarse.fine and coarse.native_proj()[0] == 3
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(9))
    assert (coarse(x).double() - _reference(x, coarse.dense(), fine=False)).abs().max() < 1e-5
    monkeypatch.setenv(kernels.Q4_ACTIVATIONS_ENV, "16")
    with pytest.raises(kernels.KernelError, match="LAYERLEAP_Q4_ACTIVATIONS must be 8 or 15"):
        BlockWeight.from_rows(r)


@pytest.mark.parametrize("m", [1, 5, 17])
def test_stacked_parts_of_two_block_types_equal_each_part_alone(m):
    """A weight fused from 4-bit rows, 6-bit rows and 4-bit rows again (``MixedRows`` of 40 + 17 + 16
    rows, the middle part not a whole block of 16) keeps every part exactly, and each output row is the
    one its own part's block weight gives, bias included; its packed state rebuilds the same weight."""
    from layerleap.core.kernels import MixedRows, StackWeight

    parts = [_q4k_rows(40, 512, seed=1), _q6(17, 512, seed=2), _q4k_rows(16, 512, seed=3)]
    mixed = MixedRows.of(parts)
    assert isinstance(mixed, MixedRows) and mixed.shape == (73, 512)
    assert torch.equal(mixed.dense(), torch.cat([p.dense() for p in parts]))
    bias = torch.randn(73, generator=torch.Generator().manual_seed(4))
    w = StackWeight.from_mixed(mixed, bias)
    assert [p.bits for p in w.parts] == [4, 6, 4] and torch.equal(w.dense(), mixed.dense())
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    alone = [  # each part as its own block weight with its share of the bias
        BlockWeight.from_q6(p, b) if isinstance(p, Q6Rows) else BlockWeight.from_rows(p, b)
        for p, b in zip(parts, bias.split([40, 17, 16]))
    ]
    assert torch.equal(w(x), torch.cat([a(x) for a in alone], 1))  # bias added in fp32, then bf16: the same bits
    again = StackWeight.from_state(w.state())
    assert torch.equal(again(x), w(x)) and torch.equal(again.dense(), w.dense())
    assert MixedRows.of(parts[:1] + parts[2:]).shape == (56, 512)  # one type: plain QuantizedRows
    assert isinstance(MixedRows.of(parts[:1] + parts[2:]), QuantizedRows)


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags of the mapping holding ``address`` (``/proc/self/smaps``: ``hg`` advised for
    huge pages, ``sh`` shared)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return set()


def test_block_weights_moved_to_huge_pages_give_the_same_bits():
    """``kernels.to_huge_pages`` copies codes and scales into one arena (a weight met twice, once): the
    products and the dense weights stay the same bits; a tensor that does not fit stays where it is."""
    from layerleap.core.cpu import HUGE_PAGE, HugePageArena
    from layerleap.core.kernels import StackWeight

    w4, w8 = _weight(4, 45, 192, 1), _weight(8, 20, 96, 2)
    stack = StackWeight([BlockWeight.from_rows(_q4k_rows(16, 256, 3)), BlockWeight.from_q6(_q6(17, 256, 4))])
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(3))
    x8 = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    xs = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    before = [w4(x), w8(x8), stack(xs), w4.dense(), stack.dense()]
    kernels.to_huge_pages([w4, stack, w8, w4])
    assert all(torch.equal(a, b) for a, b in zip(before, [w4(x), w8(x8), stack(xs), w4.dense(), stack.dense()]))
    arena = HugePageArena(128)
    if arena.buf is None:  # no transparent huge pages here: nothing moves
        return
    ptrs = sorted(t.data_ptr() for b in (w4, w8, *stack.parts) for t in (b.codes, b.dm))
    assert ptrs[0] % HUGE_PAGE == 0 and len(set(ptrs)) == 8 and all(p % 64 == 0 for p in ptrs)
    assert {"hg"} <= _vm_flags(w4.codes.data_ptr()) and "sh" not in _vm_flags(w4.codes.data_ptr())
    small = torch.arange(10, dtype=torch.float32)
    placed = arena.place(small)
    assert torch.equal(placed, small) and placed.data_ptr() % HUGE_PAGE == 0
    big = torch.zeros(200, dtype=torch.uint8)
    assert arena.place(big) is big  # no room left


def test_moving_weights_to_huge_pages_hands_freed_memory_back_as_it_goes(monkeypatch):
    """A load does not hold the weights twice: every ``TRIM_EVERY`` bytes moved, the freed copies go
    back to the system (``cpu.release_freed_memory``)."""
    from layerleap.core import cpu

    ws = [_weight(4, 64, 256, seed) for seed in range(6)]
    per = ws[0].codes.nbytes + ws[0].dm.nbytes
    trims = []
    monkeypatch.setattr(cpu, "release_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(kernels, "TRIM_EVERY", 2 * per)
    kernels.to_huge_pages(ws)
    assert len(trims) == 3


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_dense_rows_are_the_rows_of_dense(bits):
    """``dense_rows`` unpacks only the rows asked for, in their order: ``dense()``'s values bit for bit
    (rows of the last, partly filled block of 16 too)."""
    w = BlockWeight.from_q6(_q6(200, 512, 5)) if bits == 6 else _weight(bits, 200, 512, 5)
    ids = torch.tensor([199, 0, 17, 16, 15, 150, 17])
    assert torch.equal(w.dense_rows(ids), w.dense()[ids])


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_two_threads_give_the_bits_of_one(bits):
    """The blocks split between threads (and each call's rounded activations shared with them): the
    same bits as one thread, at every row count, after a call with more rows than the next."""
    w = BlockWeight.from_q6(_q6(200, 512, 5)) if bits == 6 else _weight(bits, 200, 512, 5)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(7))
    one = [w(x[:m]) for m in (9, 1, 4)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = [w(x[:m]) for m in (9, 1, 4)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("how", ["forced", "remembered"])
def test_the_block_kernel_chosen_skips_the_trial_of_torchs(how, monkeypatch, tmp_path):
    """``q4_format`` with the block kernel forced or remembered never runs torch's int4 trial product
    (it maps about 7 MB of torch's code); a remembered ``torch`` still checks that torch's kernel runs."""
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.Q4_ENV, raising=False)
    trials = []
    monkeypatch.setattr(kernels, "int4_supported", lambda: trials.append(1) or True)
    if how == "forced":
        monkeypatch.setenv(kernels.Q4_ENV, "blocks")
    else:
        (tmp_path / "kernels.json").write_text(
            json.dumps({kernels._q4_key(): {"choice": "blocks", "timing": kernels.TIMING}})
        )
    assert kernels.q4_format() == "blocks" and trials == []
    (tmp_path / "kernels.json").write_text(
        json.dumps({kernels._q4_key(): {"choice": "torch", "timing": kernels.TIMING}})
    )
    monkeypatch.delenv(kernels.Q4_ENV, raising=False)
    assert kernels.q4_format() == "torch" and trials == [1]
