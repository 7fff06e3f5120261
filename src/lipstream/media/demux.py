"""Open input media with PyAV the same way on every PyAV release LipStream supports (18 and 19).

PyAV 18 decodes container metadata strictly and raises on a tag in another encoding unless
`metadata_errors="ignore"` is passed; PyAV 19 removed that argument (metadata is always read as
UTF-8 with surrogateescape, which never raises). Rational attributes (`time_base`,
`average_rate`...) are Fractions or None in 18, and never-None `AVRational`s, falsy when unset,
in 19: test them for truth, never against None.
"""

from __future__ import annotations

from pathlib import Path

import av

AV_MAJOR = int(av.__version__.split(".")[0])
_LENIENT_METADATA = {"metadata_errors": "ignore"} if AV_MAJOR < 19 else {}


def open_input(path: str | Path, options: dict[str, str] | None = None) -> av.container.InputContainer:
    """av.open for reading; a tag in a foreign encoding never stops it."""
    return av.open(str(path), options=options or {}, **_LENIENT_METADATA)
