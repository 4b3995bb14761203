"""The VNNI int4 kernel (``engine_worker.cpu.vnni``) against an integer reference
computed here in torch, bit for bit; rows alone and batched; the layout; the
fallback to torch's kernel and the weight cache's separate files."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from engine_worker.cpu import weight_cache
from engine_worker.cpu.kernels import int4
from engine_worker.cpu.kernels.attention import DecodeAttention, attention_available
from engine_worker.cpu.quant import Quantization, QuantizedLinear

needs_vnni = pytest.mark.skipif(not int4.available(), reason="this CPU does not run the VNNI kernel")


def _q4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4
    low = torch.randn(n, k // 32, generator=gen) * 0.05
    return codes, scale, low


def _reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic written out: per row and group of 32, ``q =
    rint(x * (127 / max|x|))``, ``d = max|x| / 127``; the integer sums exact (int64
    here); then per group, in group order, ``acc += (isum * scale) * d + low * (d *
    sum q)`` in float32."""
    rows, k = x.shape
    groups = k // 32
    scale, low = scale.half().float(), low.half().float()  # as the kernel keeps them
    g = x.view(rows, groups, 32)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(g * inv[..., None])  # half to even, as rint
    d = amax / 127
    lows = d * q.sum(-1)
    isum = torch.einsum("rgk,ngk->rng", q.long(), codes.view(-1, groups, 32).long()).float()
    acc = torch.zeros(rows, codes.shape[0])
    for j in range(groups):
        acc = acc + ((isum[:, :, j] * scale[None, :, j]) * d[:, j, None] + low[None, :, j] * lows[:, j, None])
    return acc


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17])
def test_the_product_is_bitwise_the_integer_reference(rows: int) -> None:
    codes, scale, low = _q4(48, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(100 + rows))
    x[0, 32:64] = 0  # an all-zero group: scale 0, no division by zero
    got = int4.Product(int4.pack(codes, scale, low))(x)
    assert torch.equal(got, _reference(x, codes, scale, low))


@needs_vnni
def test_rows_are_computed_as_alone_and_out_is_written() -> None:
    codes, scale, low = _q4(64, 128, seed=1)
    product = int4.Product(int4.pack(codes, scale, low))
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([product(x[i : i + 1]).clone() for i in range(21)])
    for m in (2, 5, 8, 13, 21):
        assert torch.equal(product(x[:m]), alone[:m]), m
    out = torch.full((21, 64), float("nan"))
    assert product(x, out=out) is out
    assert torch.equal(out, alone)


@needs_vnni
def test_close_to_the_float_product_of_the_same_weights() -> None:
    codes, scale, low = _q4(32, 256, seed=3)
    scale, low = scale.half().float(), low.half().float()
    weight = (codes.view(32, 8, 32) * scale[..., None] + low[..., None]).view(32, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    exact = x @ weight.T
    error = (int4.Product(int4.pack(codes, scale, low))(x) - exact).abs().max() / exact.abs().max()
    assert error < 0.02  # int8 activations per group of 32: about 1/254 of each group's largest


def test_pack_layout_and_shapes_it_refuses() -> None:
    codes, scale, low = _q4(32, 64, seed=5)
    packed = int4.pack(codes, scale, low)
    assert packed["codes"].shape == (2, 2, 4, 64) and packed["codes"].dtype == torch.uint8
    assert packed["scales"].shape == (2, 2, 16)
    # byte 4i + t of vector p: output 16 nb + i, inputs 32 g + 4p + t (low nibble) and + 16 (high)
    nb, g, p, i, t = 1, 1, 2, 5, 3
    byte = int(packed["codes"][nb, g, p, 4 * i + t])
    n, k = 16 * nb + i, 32 * g + 4 * p + t
    assert (byte & 15, byte >> 4) == (int(codes[n, k]), int(codes[n, k + 16]))
    assert packed["scales"][nb, g, i] == scale[n, g].half()
    assert not int4.supports(40, 64) and not int4.supports(32, 48)
    with pytest.raises(ValueError, match="does not fit"):
        int4.pack(codes[:24], scale[:24], low[:24])
    with pytest.raises(ValueError, match="float16"):
        int4.pack(codes, scale, low * 1e6)


def test_without_the_kernel_int4_uses_torchs_and_the_cache_keeps_another_file(tmp_path: Path) -> None:
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with mock.patch.object(int4, "available", return_value=False):
        linear = QuantizedLinear(weight, None, Quantization.INT4)
        without = weight_cache.cache_file(tmp_path, model, "int4", True, "vnni")
    assert linear.input_dtype == torch.bfloat16 and "vnni_scales" not in linear.state()
    assert linear.kernel == "torch"
    with mock.patch.object(int4, "available", return_value=True):
        assert weight_cache.cache_file(tmp_path, model, "int4", True, "vnni") != without
        assert weight_cache.cache_file(tmp_path, model, "int4", True, "torch") == without


@needs_vnni
def test_a_layer_restored_from_its_state_computes_the_same() -> None:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(7))
    linear = QuantizedLinear(weight, None, Quantization.INT4, dense=True)
    state = linear.state()
    assert {"weight", "vnni_scales", "vnni_lows", "dense"} <= set(state)
    restored = QuantizedLinear.from_state(state, None, linear.mode)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(restored(x), linear(x))


@needs_vnni
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_decode_attention_matches_the_fused_kernel(heads: int, kv_heads: int, head_dim: int) -> None:
    """Every item over its own length of its own buffer's layer, with grouped KV heads,
    against ``scaled_dot_product_attention`` query by query."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    layers, scale = 3, head_dim**-0.5
    buffers = [torch.randn(layers, 2, kv_heads, capacity, head_dim, generator=gen) for capacity in (40, 1200)]
    lengths = [(0, 1), (0, 17), (1, 300), (1, 1200), (0, 40)]  # (buffer, positions)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen) * 3  # peaked softmaxes too
    out = torch.full((len(lengths), heads, head_dim), float("nan"))
    assert attention_available(head_dim, heads, kv_heads)
    attention = DecodeAttention(
        head_dim, heads, kv_heads, scale, [(q[i], buffers[b], out[i], n) for i, (b, n) in enumerate(lengths)]
    )
    for layer in range(layers):
        attention(layer)
        for i, (b, n) in enumerate(lengths):
            keys, values = buffers[b][layer, 0:1, :, :n], buffers[b][layer, 1:2, :, :n]
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[i][None, :, None], keys, values, scale=scale, enable_gqa=True
            )[0, :, 0]
            torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_attention_shapes_it_refuses() -> None:
    assert not attention_available(40, 8, 2)  # a head that does not fill whole vectors
    assert not attention_available(64, 9, 2)  # query heads not a multiple of the KV heads
