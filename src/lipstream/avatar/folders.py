"""Compiled avatars on disk, found by name or folder: what the CLI and a server check before torch loads.

An avatar is a folder holding avatar.json (avatar/cache.py writes it); a name is looked up in the avatars
folder. Kept free of torch: a wrong name is one line in a fraction of a second.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

from lipstream.errors import InputError

META = "avatar.json"  # the file that makes a folder a compiled avatar


def avatar_names(avatars_dir: Path | None) -> list[str]:
    """The compiled avatars in a folder (sub-folders holding avatar.json), sorted."""
    if avatars_dir is None or not Path(avatars_dir).is_dir():
        return []
    return sorted(p.name for p in Path(avatars_dir).iterdir() if (p / META).is_file())


def resolve_avatar(name: str, avatars_dir: Path | None) -> Path:
    """A compiled avatar by folder path, or by name inside the avatars folder."""
    candidates = [Path(name)] + ([Path(avatars_dir) / name] if avatars_dir is not None else [])
    for folder in candidates:
        if (folder / META).is_file():
            return folder
    for folder in candidates:
        if folder.is_dir():
            raise InputError(folder, f"is a folder but not a compiled avatar (no {META}); make one with "
                                     "`lipstream compile VIDEO -o AVATARS_DIR`")
    if avatars_dir is None or not Path(avatars_dir).is_dir():
        where = f"the avatars folder {avatars_dir} does not exist" if avatars_dir else "no avatars folder given"
        raise InputError(name, f"unknown avatar: {where} (pass --avatars DIR, or make one with "
                               "`lipstream compile VIDEO -o DIR`)")
    names = avatar_names(avatars_dir)
    have = f"it holds: {', '.join(names)}" if names else "it holds no compiled avatars"
    raise InputError(name, f"unknown avatar: not in {avatars_dir} ({have})")


def avatar_meta(folder: Path) -> dict:
    """An avatar's avatar.json, checked enough to plan a render (the loader checks the rest)."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
        int(meta["width"]), int(meta["height"]), Fraction(meta["fps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(path, f"is not a readable avatar description ({type(e).__name__}: {e}); "
                               "compile the avatar again") from None
    return meta
