"""``kernels.int8_head``: the LM head's int8 x int8 VNNI product equals ``torch._int_mm``
exactly (the same int32 sums), alone or batched, at the extremes of int8."""

from __future__ import annotations

import pytest
import torch

from engine_worker.cpu.kernels import int8_head

needs_kernel = pytest.mark.skipif(not int8_head.available(), reason="this CPU does not run the VNNI kernels")


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(seed)).to(torch.int8)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 33])
def test_the_product_is_int_mms_exactly(rows: int) -> None:
    codes = _codes(96, 160, seed=rows)
    q = _codes(rows, 160, seed=100 + rows)
    product = int8_head.Product(int8_head.pack(codes))
    expected = (q.long() @ codes.long().t()).float()  # rows above 16 take two passes of the weights
    assert torch.equal(product(q), expected)


@needs_kernel
def test_extreme_activations_and_weights_are_exact_and_rows_are_independent() -> None:
    k = 576
    codes = torch.cat(
        [
            torch.full((16, k), 127, dtype=torch.int8),
            torch.full((16, k), -127, dtype=torch.int8),
            _codes(32, k, 1),
        ]
    )
    q = torch.cat(
        [
            torch.full((1, k), 127, dtype=torch.int8),
            torch.full((1, k), -127, dtype=torch.int8),
            _codes(6, k, 2),
        ]
    )
    product = int8_head.Product(int8_head.pack(codes))
    together = product(q).clone()
    assert torch.equal(together, (q.long() @ codes.long().t()).float())
    assert together[0, 0] == 127 * 127 * k and together[1, 0] == -127 * 127 * k
    for i in range(q.shape[0]):
        assert torch.equal(product(q[i : i + 1]), together[i : i + 1])


def test_the_layout_and_the_shapes_it_refuses() -> None:
    codes = _codes(32, 8, 3)
    packed = int8_head.pack(codes)
    assert packed.shape == (2, 2, 16, 4) and packed.dtype == torch.uint8
    # byte 4i + t of vector p of block nb: w[16 nb + i, 4p + t] + 128
    assert int(packed[1, 1, 5, 2]) == int(codes[16 + 5, 4 + 2]) + 128
    for shape in ((24, 8), (32, 6)):
        with pytest.raises(ValueError, match="does not fit"):
            int8_head.pack(_codes(*shape, 4))
