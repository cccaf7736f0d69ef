"""The launch shapes this process's launchers use (shared.kernel_shapes: the worker's `kernel_shapes`)."""
from __future__ import annotations

from shared.kernel_shapes import LaunchShapes

_current = LaunchShapes()


def set_launch_shapes(shapes: LaunchShapes) -> None:
    """Process-wide, as compiled_launch.set_enabled: one engine per worker process, set before its first step."""
    global _current
    _current = shapes


def launch_shapes() -> LaunchShapes:
    return _current
