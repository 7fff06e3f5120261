"""CUDA-graph plumbing the engine's steps share: a captured callable, and uploads that never block."""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Graph:
    """`fn` captured at fixed input shapes: fill the static `inputs`, replay, read `out`."""

    def __init__(self, fn: Callable[..., torch.Tensor | None], inputs: dict[str, torch.Tensor],
                 device: torch.device, pool, warmups: int = 2):
        self.inputs = inputs
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):  # compile, cuBLAS/cuDNN handles and algorithm choices
                fn(**inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the avatar loader's copies on its own stream, in another thread, must not
        # invalidate this capture (the default "global" mode forbids them in every thread)
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = fn(**inputs)

    def replay(self) -> torch.Tensor | None:
        self.graph.replay()
        return self.out  # valid until the next replay of this graph


class IndexRing:
    """Small int64 uploads that never block the CPU: pinned buffers reused round-robin."""

    def __init__(self, device: torch.device, buffers: int = 16, size: int = 1024):
        self.cuda = device.type == "cuda"
        self.device = device
        self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=self.cuda) for _ in range(buffers)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(buffers)]
        self.next = 0

    def upload(self, values: list[int]) -> torch.Tensor:
        if not self.cuda or len(values) > self.buffers[0].numel():
            return torch.tensor(values, device=self.device)
        k = self.next
        self.next = (k + 1) % len(self.buffers)
        self.events[k].synchronize()  # the copy that last read this buffer is done (long ago, normally)
        host = self.buffers[k][:len(values)]
        host.numpy()[:] = values
        out = host.to(self.device, non_blocking=True)
        self.events[k].record()
        return out
