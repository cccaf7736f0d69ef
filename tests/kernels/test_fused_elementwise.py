"""RMSNorm (with and without the residual add), rotary embedding and SwiGLU kernels against the torch
reference ops, fp32 and fp16, odd sizes."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.rms_norm import add_rms_norm, rms_norm
from services.gpu_worker.kernels.rotary import rotary
from services.gpu_worker.kernels.silu_mul import silu_mul
from services.gpu_worker.ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [48, 100])
def test_rms_norm_and_fused_residual_add(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    res = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])
    summed, out = add_rms_norm(x, res, w, 1e-6)
    ref_summed, ref_out = reference.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_in_place_on_strided_views_of_qkv(dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, hd = 5, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * hd, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 9, 1, 30], dtype=torch.int32, device=DEVICE)
    angle = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    ref_q, ref_k = reference.rotary(q.reshape(tokens, hq, hd), k.reshape(tokens, hkv, hd), positions, cos, sin)
    v_before = v.clone()
    out_q, out_k = rotary(q.view(tokens, hq, hd), k.view(tokens, hkv, hd), positions, cos, sin)
    torch.testing.assert_close(out_q, ref_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert out_q.data_ptr() == q.data_ptr(), "q must be rotated in place"
    assert torch.equal(v, v_before), "v columns must be untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(4)
    gu = torch.randn(6, 2 * 1100, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(silu_mul(gu, 1100), reference.silu_mul(gu, 1100), atol=TOL[dtype], rtol=TOL[dtype])


def test_shape_errors_name_the_argument():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight has 4 entries"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gate_up has 8 columns"):
        silu_mul(x, 3)
