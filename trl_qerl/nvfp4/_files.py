"""Whole-file writes: readers see the old file or the whole new one, never a truncated one.

The lowest layer's own helper (standard library only), so the kernel table (`kernels.KernelChooser.save`), the NVRTC
cubin cache and the trainer's checkpoint markers (`trl_qerl.checkpoints`) share one implementation.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text, as UTF-8, or bytes) to ``path`` through a temporary file in the same directory and a rename.

    The temporary name is unique per call, so processes writing the same path at once never share a half-written
    file: the last rename wins, whole. A failed write removes its temporary file and raises.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        text = not isinstance(data, bytes)
        with os.fdopen(handle, "w" if text else "wb", encoding="utf-8" if text else None) as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
