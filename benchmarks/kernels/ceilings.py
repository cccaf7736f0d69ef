"""The two ceilings every kernel number is read against, measured in the same run: device-to-device copy
bandwidth (bytes read + written) and a large bf16 matrix product."""
from __future__ import annotations

import torch

from benchmarks.kernels.timing import time_eager


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_eager(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_eager(lambda: a @ b, iters=10)
    return 2 * n ** 3 / ms / 1e9
