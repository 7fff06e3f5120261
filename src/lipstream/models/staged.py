"""A safetensors file straight into GPU memory: read through a small pinned ring into one allocation.

`safetensors.torch.load_file(path, device="cuda")` maps the file and copies each tensor from the mapping:
every page faulted in one by one, and every copy from pageable memory (the driver stages it again). For the
compiled engine's 1.87 GiB weights that was 0.63-1.16 s of a one-shot render's start on the H100/H200.
Here the file is read with large `preadv` calls on a few threads (the page cache copies outside the GIL) into
pinned buffers, each copied to its places in one device allocation while the next is read; the
tensors are views of that allocation, each at an aligned offset. The same names, dtypes, shapes and bytes
as `load_file`; on a CPU device `load_file` itself is used (its mapping is already the cheapest there).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20  # one pinned staging buffer
STAGING_BUFFERS = 2  # each reader's: it reads into one while the other copies
READERS = max(1, min(4, (os.cpu_count() or 1) // 2))  # threads reading the file
ALIGN = 512  # bytes: where each tensor starts on the device
# safetensors' dtype names (the format's spec) -> torch
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """(tensors: name -> {dtype, shape, data_offsets}, the metadata, where the data starts)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header's length)")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (a {size}-byte header)")
        header = json.loads(f.read(size))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + size


def load_to_device(path: str | Path, device: torch.device, staged: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file on `device` (see the module docstring). `staged`: through the ring (default:
    on CUDA only; the tests stage into CPU memory too)."""
    return load_with_metadata(path, device, staged)[1]


def load_with_metadata(path: str | Path, device: torch.device,
                       staged: bool | None = None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(the file's metadata, every tensor on `device`), its header read once."""
    header, metadata, start = read_header(path)
    if not (device.type == "cuda" if staged is None else staged):
        from safetensors.torch import load_file

        return metadata, load_file(str(path), device=str(device))
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which LipStream does not load")
    layout = Layout(header)
    try:
        blob = torch.empty(layout.total, dtype=torch.uint8, device=device)
        _read_into(Path(path), start, layout, blob)
    except RuntimeError as e:  # the ring itself (pinned memory, streams) failed, not the file: the plain way
        log.warning("the staged read of %s failed (%s); loading it with load_file", path, e)
        from safetensors.torch import load_file

        return metadata, load_file(str(path), device=str(device))
    out = {}
    for name, begin, end, place in layout.spans:
        entry = header[name]
        out[name] = blob[place:place + end - begin].view(DTYPES[entry["dtype"]]).view(entry["shape"])
    return metadata, out


class Layout:
    """Where each tensor goes in the one device allocation: at a multiple of ALIGN bytes, as the caching
    allocator places its own (compiled kernels assume aligned weights; the file's offsets only promise
    whole elements, and one 8-byte bias shifts every tensor after it)."""

    def __init__(self, header: dict[str, dict]):
        spans, place = [], 0
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            spans.append((name, begin, end, place))
            place += -(-(end - begin) // ALIGN) * ALIGN
        self.spans: list[tuple[str, int, int, int]] = spans  # (name, file begin, file end, device offset)
        self.size = max((end for _, _, end, _ in spans), default=0)  # the file's data bytes
        self.total = max(place, 1)
        self._begins = [begin for _, begin, _, _ in spans]

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """The parts of file bytes [a, b) that belong to tensors: (from a, to a, device offset) each."""
        out = []
        for _, begin, end, place in self.spans[max(0, bisect.bisect_right(self._begins, a) - 1):]:
            if begin >= b:
                break
            lo, hi = max(a, begin), min(b, end)
            if lo < hi:
                out.append((lo - a, hi - a, place + lo - begin))
        return out


def _read_into(path: Path, start: int, layout: Layout, blob: torch.Tensor, readers: int | None = None) -> None:
    """The file's tensor bytes (from `start`) into their places in `blob`. Each of `readers` threads takes
    every readers-th chunk into two staging buffers of its own in turn (pinned, and copied to the device on a
    stream of its own, on CUDA): one core copies from the page cache at ~6-7 GiB/s, two at ~11-12 (a 2-core
    VM)."""
    total = layout.size
    if not total:
        return
    cuda = blob.device.type == "cuda"
    chunk = min(CHUNK_BYTES, total)
    chunks = -(-total // chunk)
    readers = max(1, min(readers or READERS, chunks))
    fd = os.open(path, os.O_RDONLY)

    def read(first: int) -> None:
        # on blob's GPU: a new thread's current device is the first one, and its streams and events follow it
        with torch.cuda.device(blob.device) if cuda else contextlib.nullcontext():
            read_chunks(first)

    def read_chunks(first: int) -> None:
        stream = torch.cuda.Stream(blob.device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(blob.device))  # blob's allocation comes first
        mine = min(STAGING_BUFFERS, -(-(chunks - first) // readers))
        ring = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(mine)]
        done: list = [None] * mine  # each buffer's last copies (an event), on CUDA
        for n, i in enumerate(range(first, chunks, readers)):
            k, offset = n % mine, i * chunk
            size = min(chunk, total - offset)
            if done[k] is not None:
                done[k].synchronize()  # those copies have left the buffer
            view = memoryview(ring[k].numpy())[:size]
            got = 0
            while got < size:  # a read may return fewer bytes than asked
                got_now = os.preadv(fd, [view[got:]], start + offset + got)
                if got_now <= 0:
                    raise ValueError(f"{path}: the file ends {total - offset - got} bytes before its tensors do")
                got += got_now
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for lo, hi, place in layout.pieces(offset, offset + size):
                    blob[place:place + hi - lo].copy_(ring[k][lo:hi], non_blocking=cuda)
                if stream is not None:
                    done[k] = torch.cuda.Event()
                    done[k].record(stream)
        if stream is not None:
            stream.synchronize()  # every byte in place before any stream reads the tensors

    try:
        if readers == 1:
            read(0)
        else:
            with ThreadPoolExecutor(readers, thread_name_prefix="lipstream-read") as pool:
                for future in [pool.submit(read, r) for r in range(readers)]:
                    future.result()
    finally:
        os.close(fd)
