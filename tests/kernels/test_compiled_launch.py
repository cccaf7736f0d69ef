"""Direct launches (worker.direct_launch): which kernels can take them, and when a call may skip Triton's
binding. The launches themselves need compiled kernels, so a CUDA GPU: tests/kernels/test_lora_plan.py and
tests/gpu_worker/test_engine_triton_backend.py run them there."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.gpu_worker.kernels import compiled_launch, rms_norm
from services.gpu_worker.kernels.compiled_launch import _fingerprint

REPO = Path(__file__).resolve().parents[2]


def test_every_kernel_takes_its_constexprs_last_so_later_layers_can_launch_direct():
    """A compiled kernel's runner takes the positional arguments then the constexprs: a kernel with a
    constexpr before another parameter would never launch direct. Compiled kernels exist outside the
    interpreter only, hence the subprocess (building the JIT functions needs no GPU)."""
    code = textwrap.dedent("""
        import importlib
        from services.gpu_worker.kernels.compiled_launch import CompiledLaunch, _layout
        names = ["lora_shrink", "lora_expand", "rms_norm", "rotary", "silu_mul", "write_kv", "paged_attention"]
        found = 0
        for name in names:
            module = importlib.import_module("services.gpu_worker.kernels." + name)
            for attr, value in vars(module).items():
                fn = value.fn if isinstance(value, CompiledLaunch) else value
                if attr.endswith("_kernel") or isinstance(value, CompiledLaunch):
                    layout = _layout(fn)
                    assert layout is not None, (name, attr)
                    assert layout[0] >= 5 and layout[1], (name, attr, layout)
                    found += 1
        print(found)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # 5 LoRA kernels, and the norm, rotary, activation, KV write, attention and combine kernels each twice
    # (the kernel and its CompiledLaunch).
    assert int(done.stdout) == 5 + 2 * 6


def test_a_launch_is_direct_only_where_triton_would_specialise_the_same():
    base = torch.zeros(64)
    other = torch.ones(64)
    shifted = torch.zeros(65)[1:]  # 4 bytes past a 16-byte boundary
    same = _fingerprint((base, 7, 1))
    assert _fingerprint((other, 7, 1)) == same  # another layer's tensor: same dtype, device and alignment
    assert _fingerprint((shifted, 7, 1)) != same
    assert _fingerprint((base.double(), 7, 1)) != same
    assert _fingerprint((base, 8, 1)) != same and _fingerprint((base, 7, 2)) != same
    assert _fingerprint((base, 7, True)) != same and _fingerprint((base, 7, 1.0)) != same


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where no GPU is")
def test_under_the_interpreter_every_call_takes_the_ordinary_path_and_is_right():
    x = torch.randn(5, 48)
    w = torch.randn(48)
    before = compiled_launch.direct_calls()
    compiled_launch.set_enabled(True)
    try:
        outs = [rms_norm.rms_norm(x, w, 1e-5) for _ in range(3)]
    finally:
        compiled_launch.set_enabled(False)
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    assert all(torch.allclose(o, ref, atol=1e-5) for o in outs)
    assert compiled_launch.direct_calls() == before
    assert rms_norm._RMS_NORM.captures == []  # no compiled kernel to keep
