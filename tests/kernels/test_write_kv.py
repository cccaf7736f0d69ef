"""Triton write_kv against ops.reference.write_kv: rows land at their slots, nothing else is touched."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels import write_kv
from services.gpu_worker.ops import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("width", [20, 64])
def test_write_kv_scatters_rows_to_slots(dtype, width):
    gen = torch.Generator().manual_seed(width)
    k_buf = torch.full((50, width), float("nan"), dtype=dtype)
    v_buf = torch.full((50, width), float("nan"), dtype=dtype)
    slots = torch.randperm(50, generator=gen)[:7].to(torch.int32)
    k = torch.randn(7, width, generator=gen)  # fp32 rows into a narrower pool: cast like the reference
    v = torch.randn(7, width, generator=gen)
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    reference.write_kv(ref_k, ref_v, slots, k, v)
    write_kv(k_buf, v_buf, slots, k, v)
    assert torch.allclose(k_buf, ref_k, equal_nan=True, rtol=0, atol=0)
    assert torch.allclose(v_buf, ref_v, equal_nan=True, rtol=0, atol=0)
    others = torch.ones(50, dtype=torch.bool)
    others[slots.long()] = False
    assert torch.isnan(k_buf[others]).all() and torch.isnan(v_buf[others]).all()


def test_write_kv_rejects_mismatched_rows():
    buf = torch.zeros(10, 8)
    with pytest.raises(ValueError, match=r"k and v must be \[3, 8\]"):
        write_kv(buf, buf.clone(), torch.arange(3, dtype=torch.int32), torch.zeros(2, 8), torch.zeros(2, 8))
