"""The server's own folders stay out of what a client sees: an answer's `detail`, a job's `error`, its events.

A client named its files by their upload names and its avatars by name; a path under `--data` or
`--avatars` tells it nothing it can use and tells an attacker how the machine is laid out. Each such path
in a message becomes its last part (the name the client sent, or the job's result), the folder alone
becomes "the server's folder"."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from lipstream.serve.options import ServeOptions

# a path's characters after a folder, up to what ends it in a message: a quote, a space, a comma, a bracket
_REST = r"(?:/[^\s'\",:;()\[\]{}]*)?"


def server_folders(options: ServeOptions) -> list[Path]:
    """The folders a message must not show: the data folder (uploads, results, the SQLite store) and the
    avatars', as given and resolved."""
    out = []
    for folder in (options.data_dir, options.avatars_dir):
        out.append(Path(folder).absolute())
        out.append(Path(folder).resolve())
    return out


def without_server_paths(text: str, folders: Iterable[Path]) -> str:
    """`text` with every path under `folders` replaced by its last part (the folder itself by a few words)."""
    names = sorted({str(f).rstrip("/") for f in folders if str(f) not in ("", "/", ".")}, key=len, reverse=True)
    if not names:
        return text
    pattern = re.compile("(?:" + "|".join(re.escape(n) for n in names) + ")" + _REST)

    def name(match: re.Match) -> str:
        path = match.group(0)
        return "the server's folder" if path.rstrip("/") in names else Path(path).name

    return pattern.sub(name, text)
