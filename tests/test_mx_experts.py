"""mokgen.mx_experts (the MXFP8 routed experts) without a GPU: the weights' layout, the grouping of
rows into padded expert segments, the tile list, the bytes per row and the input checks. The GPU
run against the float64 MX oracle is in test_gpu_mx_experts.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mokgen import mx, mx_experts, mx_gemm  # noqa: E402
from mokgen.errors import InputError  # noqa: E402


def test_segments_group_rows_by_expert_in_pair_order_with_padding():
    ids = torch.tensor([2, 0, 2, 2, 0, 3])  # pairs 0..5
    row, padded, rows = mx_experts._segments(ids, 4)
    assert padded.tolist() == [128, 0, 128, 128] and rows == 384
    # expert 0: pairs 1, 4 at rows 0, 1; expert 2: pairs 0, 2, 3 at 128, 129, 130; expert 3: pair 5 at 256
    assert row.tolist() == [128, 0, 129, 130, 1, 256]


def test_segments_of_a_full_tile_and_more():
    ids = torch.zeros(129, dtype=torch.int64)
    row, padded, rows = mx_experts._segments(ids, 2)
    assert padded.tolist() == [256, 0] and rows == 256 and row.tolist() == list(range(129))


def test_row_tiles_list_each_segments_tiles():
    tiles, n = mx_gemm.row_tiles([256, 0, 128, 384], "cpu")
    assert n == 6 and tiles.dtype == torch.int32
    assert tiles.tolist() == [[0, 0], [0, 128], [2, 256], [3, 384], [3, 512], [3, 640]]
    with pytest.raises(InputError, match="non-negative multiples of 128"):
        mx_gemm.row_tiles([100], "cpu")


def test_quantized_weights_are_the_quantizer_s_in_the_blocked_layout():
    gen = torch.Generator().manual_seed(0)
    E, I, H = 2, 128, 256
    wg, wu = (torch.randn(E, I, H, generator=gen).to(torch.bfloat16) for _ in range(2))
    wd = torch.randn(E, H, I, generator=gen).to(torch.bfloat16)
    w = mx_experts.quantize_weights(wg, wu, wd)
    assert (w.num_experts, w.hidden, w.inter) == (E, H, I)
    codes, scales = mx.quantize(wu[1], dim=-1)
    assert torch.equal(w.gate_up[1, I:].view(torch.uint8), codes.view(torch.uint8))
    # blocked: [E, K / 128, N, 4], row n's four scales of k-block b at [e, b, n]
    assert tuple(w.gate_up_scales.shape) == (E, H // 128, 2 * I, 4)
    assert torch.equal(w.gate_up_scales[1, 1, I + 5], scales[5, 4:8])
    dcodes, dscales = mx.quantize(wd[0], dim=-1)
    assert torch.equal(w.down[0].view(torch.uint8), dcodes.view(torch.uint8))
    assert torch.equal(w.down_scales[0, 0, 7], dscales[7, 0:4])


def test_weights_must_have_the_layout_and_tile_multiples():
    wg = torch.zeros(2, 128, 256)
    with pytest.raises(InputError, match=r"w_gate / w_up \[E, I, H\] and w_down \[E, H, I\]"):
        mx_experts.quantize_weights(wg, wg, wg)
    small = torch.zeros(2, 96, 256)
    with pytest.raises(InputError, match="multiples of 128, got H = 256, I = 96"):
        mx_experts.quantize_weights(small, small, torch.zeros(2, 256, 96))


def test_bytes_per_row():
    assert mx_experts.bytes_per_row(7168, "bf16") == 14336
    assert mx_experts.bytes_per_row(7168) == 7168 + 224
    assert mx_experts.bytes_per_row(7168) / mx_experts.bytes_per_row(7168, "bf16") == pytest.approx(0.515625)
    with pytest.raises(InputError, match="numerics must be bf16 or mxfp8"):
        mx_experts.bytes_per_row(7168, "fp8")


def test_forward_checks_its_inputs():
    E, I, H = 2, 128, 128
    w = mx_experts.quantize_weights(torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    ids, wts = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    with pytest.raises(InputError, match=r"x must be bf16 \[T, 128\]"):
        mx_experts.experts_forward(x[:, :64], ids, wts, w)
    with pytest.raises(InputError, match=r"x must be bf16 \[T, 128\], got torch.float32"):
        mx_experts.experts_forward(x.float(), ids, wts, w)
    with pytest.raises(InputError, match=r"topk_ids and topk_weights must both be \[T, k\]"):
        mx_experts.experts_forward(x, ids, wts[:, :1], w)
    with pytest.raises(InputError, match=r"topk_ids must lie in \[0, 2\)"):
        mx_experts.experts_forward(x, ids + 2, wts, w)
    assert mx_experts.experts_forward(x[:0], ids[:0], wts[:0], w).shape == (0, H)
