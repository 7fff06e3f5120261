"""Atomic outputs: a file appears under its name only when it is complete."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lipstream.errors import InputError
from lipstream.preflight import check_output_path


@contextlib.contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; rename it to `dest` on success, delete it on any failure."""
    dest = check_output_path(dest)
    parent = dest.parent if str(dest.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=parent)
    except OSError as e:
        raise InputError(dest, f"cannot write here ({e.strerror})") from None
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the output is an ordinary file
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def save_safetensors_atomic(dest: str | Path, tensors: dict, metadata: dict[str, str]) -> None:
    """Tensors (name -> torch.Tensor) into a .safetensors file, atomically."""
    from safetensors.torch import save_file

    with atomic_path(dest) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
