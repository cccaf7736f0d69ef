"""Global loads of compiled GPU code by how many bytes a thread moves, read from its PTX (no GPU needed)."""
from __future__ import annotations

import re


def load_widths(ptx: str) -> dict[int, int]:
    """Global loads in the PTX by bytes a thread moves: plain loads (`.v4.b32` is 16) and asynchronous copies
    (what a pipelined loop's loads become). A tile read 2 bytes a load is one whose offsets the compiler could
    not prove aligned or whose mask varies along its contiguous axis."""
    widths: dict[int, int] = {}
    for vec, bits in re.findall(r"ld\.global(?:\.[\w:]+?)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        n = int(vec or 1) * int(bits) // 8
        widths[n] = widths.get(n, 0) + 1
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx):
        n = int(size, 0)
        widths[n] = widths.get(n, 0) + 1
    return dict(sorted(widths.items()))
