import os

# Triton kernels run on the CPU through the interpreter when no GPU is present. The switch is read when
# kernels are decorated, so it must be set before any kernel module is imported.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch missing is reported by the imports that need it
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------------------------------------
# Shared tiny checkpoints (foundation). Built once per test session; treat the folders as read-only.
# ---------------------------------------------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random `tiny` (multi-head attention) Llama checkpoint with tokenizer and chat template."""
    from shared.tiny_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny-model") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_gqa_model_dir(tmp_path_factory):
    """A random `tiny-gqa` (grouped-query attention, llama3 rope scaling) Llama checkpoint."""
    from shared.tiny_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny-gqa-model") / "model", preset="tiny-gqa", seed=0)


@pytest.fixture(scope="session")
def tiny_adapter_dirs(tiny_model_dir, tmp_path_factory):
    """Four PEFT adapters for `tiny_model_dir` on every module, ranks 8, 16, 4, 32 (adapter-000..003)."""
    from shared.make_adapters import make_adapters

    return make_adapters(tmp_path_factory.mktemp("tiny-adapters"), tiny_model_dir, 4, ranks=[8, 16, 4, 32], seed=0)
