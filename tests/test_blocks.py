"""The native 4-bit and 8-bit block kernel (``kernels.BlockWeight``, ``native/decoder.cpp``'s
``block_matmul``) against a dense reference on random blocks, odd shapes included; GGUF's blocks kept
exactly; a row's result independent of the call; lossless methods exact in q4 with it.  Skipped when
the extension is not built (``layerleap native --build``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_model

from layerleap.core import kernels
from layerleap.core.gguf_q4 import blocks_to_rows, q8_0_rows
from layerleap.core.kernels import BlockWeight, Int8Rows, QuantizedRows
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


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: activations rounded to 8 bits per group of 32 (amax/127),
    each group's integer dot product with the codes, scaled; ``w`` the exact dense weight [N, K]."""
    M, K = x.shape
    xg = x.double().view(M, K // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.where(amax > 0, torch.round(xg * (127 / amax.clamp_min(1e-30))), torch.zeros_like(xg))
    return (q * d).view(M, K) @ w.double().t()


SHAPES = [(1, 32, 16), (3, 64, 17), (5, 96, 37), (16, 576, 48), (17, 160, 100), (2, 1536, 64)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_block_product_matches_dense_reference(m, k, n, bits):
    w = BlockWeight.from_rows(_rows(n, k, seed=n)) if bits == 4 else BlockWeight.from_int8(_int8(n, k, seed=n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    y = w(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    dense = w.dense()
    ref = _reference(x, dense)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() < 1e-5 * scale + 1e-6  # the same sum up to fp32 rounding
    # and close to the product without rounding the activations (8-bit activations: ~1% of the output)
    exact = x.double() @ dense.double().t()
    assert (y.double() - exact).abs().max().item() < 0.02 * exact.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
def test_vector_path_equals_portable_path_bit_for_bit(bits):
    mod = kernels._native_blocks()
    w = BlockWeight.from_rows(_rows(45, 192, 1)) if bits == 4 else BlockWeight.from_int8(_int8(45, 192, 1))
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(2))
    a = mod.block_matmul(x, w.codes, w.dm, w.out_features, False)
    b = mod.block_matmul(x, w.codes, w.dm, w.out_features, True)
    assert torch.equal(a, b), mod.blocks_isa()


@pytest.mark.parametrize("half", [True, False])
def test_a_row_gets_the_same_bits_in_any_call(half):
    w = BlockWeight.from_rows(_rows(70, 256, 3, half=half))
    assert w.dm.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = w(x)
    assert whole.dtype == torch.bfloat16
    for lo, hi in ((0, 1), (3, 7), (5, 13), (0, 17), (16, 17)):
        assert torch.equal(w(x[lo:hi]), whole[lo:hi])


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
    assert w.dm.dtype == (torch.float32 if qtype == "Q4_K" else torch.float16)  # fp16 wherever exact


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
