"""Files a user names: checked on the way in (present, readable, a file), and outputs written atomically
(a file appears under its name only when it is complete). No torch."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lipstream.errors import InputError


def check_file(path: str | Path, what: str = "file") -> Path:
    """Return `path` as a Path if it is an existing, readable, regular file; else raise InputError."""
    p = Path(path)
    if not p.exists():
        raise InputError(p, f"no such {what}")
    if p.is_dir():
        raise InputError(p, f"is a folder, expected {_a(what)}")
    if not p.is_file():
        raise InputError(p, f"is not a regular file, expected {_a(what)}")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise InputError(p, f"cannot be read ({e.strerror or e})") from None
    return p


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def check_output_path(dest: str | Path) -> Path:
    """Fail early, before any work, if `dest` cannot become an output file."""
    dest = Path(dest)
    if dest.is_dir():
        raise InputError(dest, "is a folder, expected an output file name")
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(dest, f"output folder {parent} does not exist")
    return dest


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
