"""The offline job: a program of scenes (one audio file, or a broadcast script) -> one H.264/AAC MP4.

script.py: broadcast scripts -> a Program. checks.py: its inputs checked before torch. program.py: `prepare`
(speech, features, windows, resident avatars, the frame plan) and `render_program`. plan.py: the plan's data.
loop.py: the plan's frames through the engine into the MP4 writer (`write`); producer.py: its GPU side.
options.py: RenderOptions. The names load on first use (PEP 562): the CLI and a remote client read scripts
and options without torch.
"""

from __future__ import annotations

from lipstream import lazy_names

_LAZY = {"render_program": "program", "prepare": "program", "RenderOptions": "options", "Program": "script",
         "load_script": "script", "RenderReport": "loop"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, globals(), _LAZY)
