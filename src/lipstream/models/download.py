"""Fetch the upstream files into the models folder with huggingface_hub (when online)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lipstream.errors import WeightsError
from lipstream.models.layout import KEYSYNC_FILES, TRACKER_FILES, UPSTREAM_FILES, UpstreamFile, find

FILES = (*UPSTREAM_FILES, *TRACKER_FILES)  # MuseTalk's networks, then the face tracker compile uses
MODEL_FILES = {"musetalk": FILES, "keysync": KEYSYNC_FILES}


def missing_files(root: Path, files: tuple[UpstreamFile, ...] = FILES) -> list[UpstreamFile]:
    return [f for f in files if find(root, f.path) is None]


def download(root: Path, *, force: bool = False, report: Callable[[str], None] = print,
             files: tuple[UpstreamFile, ...] = FILES) -> list[Path]:
    """Download every file of `files` not already present under `root`; return the files fetched.

    Raises WeightsError with the list of files still missing when the hub cannot be reached.
    """
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover - it is a dependency
        raise WeightsError("huggingface_hub is not installed: pip install huggingface_hub") from None
    todo = list(files) if force else missing_files(root, files)
    if not todo:
        report(f"all model files are already in {root}")
        return []
    fetched = []
    for f in todo:
        local_dir = root / f.path[: len(f.path) - len(f.repo_path)]
        report(f"downloading {f.repo}/{f.repo_path} -> {root / f.path}")
        try:
            path = hf_hub_download(f.repo, f.repo_path, local_dir=str(local_dir))
        except Exception as e:  # offline, DNS, HTTP, gated repo, disk full: all end the same way
            still = ", ".join(x.path for x in missing_files(root, files))
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WeightsError(
                f"cannot download {f.repo}/{f.repo_path} ({type(e).__name__}: {reason[:200]}). "
                f"This machine may be offline: fetch these files elsewhere and copy them into {root}: {still}"
            ) from None
        fetched.append(Path(path))
    return fetched
