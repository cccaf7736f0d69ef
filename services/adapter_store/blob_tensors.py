"""The tensors of a stored adapter, viewed in place in one read of its blob.

A blob's content passed every check when it was stored (the safetensors library parsed it; keys, shapes,
ranks and values were checked), and its file name is its sha256. Loading it again for a worker only
needs each tensor's place: tensors here are views of the buffer the blob was read into, where the
library's parser would copy the bytes twice more (a third of a load's time at S2 sizes). Uploads keep
the library's parser; this reader accepts nothing but the layout it checks: offsets that tile the data
exactly, sizes that match shapes, float dtypes.
"""
from __future__ import annotations

import json
import math

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HEADER_LIMIT = 100 * 2**20


class BlobLayoutError(ValueError):
    """The stored safetensors bytes do not lay out tensors as a stored adapter's must."""


def stored_tensors(data: memoryview) -> dict[str, torch.Tensor]:
    """Tensors viewing `data` (a writable buffer's memoryview: the tensors keep it alive)."""
    if len(data) < 8:
        raise BlobLayoutError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _HEADER_LIMIT):
        raise BlobLayoutError(f"header length {n} runs past the data")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlobLayoutError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise BlobLayoutError("header is not an object")
    body = data[8 + n:]
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BlobLayoutError(f"tensor {key!r}: not a float tensor entry: {info!r}") from None
        if any(d < 0 for d in shape):
            raise BlobLayoutError(f"tensor {key!r}: negative dimension in {shape}")
        entries.append((begin, end, key, dtype, shape))
    tensors: dict[str, torch.Tensor] = {}
    cursor = 0
    for begin, end, key, dtype, shape in sorted(entries, key=lambda e: e[:2]):
        count = math.prod(shape)
        if begin != cursor or end - begin != count * dtype.itemsize or end > len(body):
            raise BlobLayoutError(f"tensor {key!r}: bytes [{begin}, {end}) do not follow the previous tensor "
                                  f"(at {cursor}) with {count} values of {dtype}")
        cursor = end
        tensors[key] = (torch.frombuffer(body, dtype=dtype, count=count, offset=begin).view(shape) if count
                        else torch.empty(shape, dtype=dtype))
    if cursor != len(body):
        raise BlobLayoutError(f"{len(body) - cursor} bytes after the last tensor")
    return tensors
