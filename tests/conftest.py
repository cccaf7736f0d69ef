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
