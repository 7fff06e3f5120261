"""The one interface every engine implements: resident avatars in, frame requests -> I420 frames out.

A request is (avatar, loop frame index, audio window); the engine does not care which caller or
scene it comes from. `render_program` runs on any FrameEngine: the fast engine on the networks'
modules (ModuleEngine), the one on compiled packages (PackageEngine), the plain reference path
(ReferenceEngine) and a running server's live engine (live.offline.OfflineLane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lipstream.avatar import Avatar


@dataclass(frozen=True)
class FrameRequest:
    avatar: int  # the index FrameEngine.add_avatar returned
    frame: int  # index into that avatar's frames (after ping-pong)
    window: torch.Tensor  # [50, 384] audio window, no positional encoding yet


@runtime_checkable
class FrameEngine(Protocol):
    device: torch.device
    buckets: tuple[int, ...]  # the batch sizes it runs best (captured, compiled): a caller batches to them
    avatars: list[Avatar]  # resident, by index

    def add_avatar(self, avatar: Avatar) -> int:
        """Keep an avatar resident; its index for FrameRequest.avatar."""

    def clear_avatars(self) -> None:
        """Drop every resident avatar (what was captured or compiled stays)."""

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        """Capture or compile these buckets (None: all) now, before the frames that need them; seconds by
        what was captured."""

    def uncaptured(self) -> tuple[int, ...]:
        """The buckets warm_up() would still capture (none: all are, or the engine has no graphs)."""

    def prefetch(self, requests: list[FrameRequest]) -> None:
        """A hint: `render` will be asked for these requests (this list) after the ones before. An engine
        whose frames come from elsewhere (a server's live engine) starts them now; the others ignore it."""

    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 frames, one per request, in order (all of one frame size). It may be a
        view of the engine's own buffer, valid until the next call: copy it out before then."""
