"""The kernels' arguments that change from step to step are not specialised on, so a step with a new token
count, batch rank, input split, chunk length, segment or chunk-item count, or a mixed step split at another
sequence (attention's metadata slices) reuses a compiled kernel instead of building one (~0.3-1 s, in a step
every running request waits for)."""
from __future__ import annotations

import importlib

import pytest

STEP_VARYING = {
    ("lora_shrink", "_shrink_token_kernel"): {"stride_og", "num_tokens", "max_rank", "n_split"},
    ("lora_shrink", "_shrink_segment_kernel"): {"stride_og", "num_tokens", "max_rank", "n_split", "chunk_tokens",
                                                "n_r_tiles", "num_segments", "seg_programs", "stride_items"},
    ("lora_shrink", "_shrink_finalize_kernel"): {"stride_og", "num_tokens", "max_rank", "n_split"},
    ("lora_expand", "_expand_token_kernel"): {"stride_yg", "y_rank"},
    ("lora_expand", "_expand_segment_kernel"): {"stride_yg", "y_rank", "chunk_tokens", "num_segments",
                                                "seg_programs", "stride_items"},
    ("paged_attention", "_attention_kernel"): {"q_start_ptr", "ctx_lens_ptr", "first_token"},
}


def unspecialised(kernel) -> set[str]:
    """Names the kernel is not specialised on, from a JIT function or the interpreter's wrapper of one."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize", ()))


@pytest.mark.parametrize("module,name", list(STEP_VARYING))
def test_step_varying_ints_are_not_specialised(module, name):
    kernel = getattr(importlib.import_module(f"services.gpu_worker.kernels.{module}"), name)
    names = set(kernel.arg_names)
    assert STEP_VARYING[module, name] <= names, "the kernel's arguments were renamed"
    assert unspecialised(kernel) == STEP_VARYING[module, name]
