"""What a command loads before its first frame: the networks, as compiled packages or as modules.

`load_networks` is the one place that decides which engine a render gets. With compile "auto"
(the default) a CUDA machine uses the ahead-of-time packages (engine/aot.py) when `lipstream
warmup` has built them, and otherwise the uncompiled networks (CUDA graphs, no compile wait),
saying how to get the compiled engine. "on" builds whatever is missing first (minutes, once per
machine); "off" always uses the uncompiled networks.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lipstream.errors import LipStreamError
from lipstream.models.config import ModelConfig, model_config

COMPILE_CHOICES = ("auto", "on", "off")
RANDOM_SEED = 0
# What each --decode-rows needs compiled: the cropped decode, the whole one, or either per avatar.
KINDS_FOR_ROWS = {"auto": ("crop", "full", "whisper"), "full": ("full", "whisper"), "mask": ("crop", "whisper")}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LipStreamError(f"--device {name}: no CUDA device is available (torch {torch.__version__})")
    return torch.device(name)


def warm_gpu_libraries(device: torch.device) -> threading.Thread | None:
    """cuBLAS and cuDNN loaded and their first kernels run, on a thread, while the networks load: the first
    fp16 matmul and conv of a fresh process cost 0.12-0.16 s and 0.09-0.32 s on the H200
    (a finished study: docs/BENCHMARKS.md), and otherwise the first graph capture pays them on the way to the first
    frame. The libraries and their kernels are the process's; only each thread's handle is its own. Join
    the thread before any graph capture (nothing else may run on the GPU meanwhile)."""
    if device.type != "cuda":
        return None

    def warm() -> None:
        with torch.inference_mode():
            a = torch.ones(64, 64, device=device, dtype=torch.float16)
            x = torch.ones(1, 8, 16, 16, device=device, dtype=torch.float16)
            torch.nn.functional.conv2d(x, torch.ones(8, 8, 3, 3, device=device, dtype=torch.float16), padding=1)
            a @ a

    thread = threading.Thread(target=warm, name="lipstream-warm-libraries", daemon=True)
    thread.start()
    return thread


@dataclass
class WeightsSource:
    """Which networks a command runs: their architecture and where their weights come from."""

    config: ModelConfig
    source: dict[str, Any]  # engine/aot.py's weights key: random size + seed + device, or the files
    models: Path | None  # the models folder (None: random weights)
    size: str | None  # the random preset (None: a folder)


def weights_source(models: str | Path | None, random_weights: bool, size: str, device: torch.device) -> WeightsSource:
    """Read only what is needed to name the weights: no tensor is loaded."""
    from lipstream.engine.aot import folder_source, random_source

    if random_weights:
        return WeightsSource(model_config(size), random_source(size, RANDOM_SEED, device), None, size)
    from lipstream.models.checkpoint import read_json
    from lipstream.models.layout import UNET_DIR, UPSTREAM_FILES, VAE_DIR, WHISPER_DIR, find, models_dir

    root = models_dir(models)
    configs = []
    for rel in (f"{UNET_DIR}/musetalk.json", f"{VAE_DIR}/config.json", f"{WHISPER_DIR}/config.json"):
        path = find(root, rel)
        configs.append(read_json(path) if path else {})
    files = [p for p in (find(root, f.path) for f in UPSTREAM_FILES) if p is not None]
    return WeightsSource(ModelConfig(f"folder:{root}", *configs), folder_source(files), root, None)


@dataclass
class Networks:
    """The networks a command got, and how it got them (printed, and in the render's timings)."""

    models: Any  # models.MuseTalk or engine.aot.CompiledNetworks
    engine: str  # "compiled" (AOTInductor packages) or "uncompiled"
    note: str = ""  # why not compiled, and how to get it
    timings: dict[str, float] = field(default_factory=dict)


def load_networks(models: str | Path | None, device: torch.device, random_weights: bool, size: str, *,
                  compile: str = "auto", decode_rows: str = "auto", dtype: torch.dtype | None = None,
                  report: Callable[[str], None] | None = None) -> Networks:
    """The fastest networks this machine has ready (see the module docstring)."""
    import time

    from lipstream.engine import aot

    t0 = time.perf_counter()
    wanted = compile == "on" or (compile == "auto" and device.type == "cuda" and dtype is None)
    note = ""
    if wanted:
        src = weights_source(models, random_weights, size, device)
        kinds = KINDS_FOR_ROWS[decode_rows]
        try:
            try:
                compiled = aot.load_compiled(src.config, src.source, device, kinds=kinds)
            except aot.NotBuilt:
                if compile != "on":
                    raise
                warmup(models, device, random_weights, size, kinds=kinds, report=report)
                compiled = aot.load_compiled(src.config, src.source, device, kinds=kinds)
            return Networks(compiled, "compiled", timings={"networks_s": time.perf_counter() - t0,
                                                           **compiled.timings})
        except aot.NotBuilt as e:
            note = f"{e}: rendering with the uncompiled networks"
            if e.buildable:
                note += "; `lipstream warmup` builds the compiled engine once for this machine (a few minutes)"
    if device.type == "cuda":  # create the CUDA context while the modules are built and the weights read
        threading.Thread(target=torch.zeros, args=(1,), kwargs={"device": device}, daemon=True).start()
    from lipstream.models import load_musetalk

    m = load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False, dtype=dtype)
    return Networks(m, "uncompiled", note, {"networks_s": time.perf_counter() - t0})


LIVE_KINDS = ("crop", "full")  # the frame steps a live engine runs (its Whisper streams through the module)


@dataclass
class PendingPackages:
    """Packages a server builds after it is ready (serve/upgrade.py): how to name them and the networks'
    command-line arguments for the `lipstream warmup` process that builds them."""

    config: ModelConfig
    source: dict[str, Any]
    network_args: list[str]
    device: torch.device


@dataclass
class LiveNetworks:
    """What `lipstream serve` runs: the modules (the Whisper encoder for the streaming features and the VAE
    for compile jobs; the UNet too when the steps are not compiled ahead of time), the frame steps that
    `lipstream warmup` built where it has, whether Inductor compiles the steps otherwise, and what to build
    in the background (then the server starts on the uncompiled steps and moves onto the packages)."""

    models: Any  # models.MuseTalk
    compiled: Any = None  # engine.aot.CompiledNetworks, or None
    inductor: str = "off"
    note: str = ""
    pending: PendingPackages | None = None

    @property
    def engine(self) -> str:
        """How the steps run, as the server's ready event says it."""
        if self.compiled is not None:
            return "compiled packages"
        if self.pending is not None:
            return "modules, compiled packages building in the background"
        return f"modules, inductor {self.inductor}"


def load_live_networks(models: str | Path | None, device: torch.device, random_weights: bool, size: str, *,
                       compile: str = "auto", background: bool = True) -> LiveNetworks:
    """A server's networks. With compile "auto" on CUDA, or "on": the packages `lipstream warmup` built,
    which start in seconds (no tracing, no compiling). Where they are missing, with `background`: the
    modules' uncompiled steps now (CUDA graphs: ready in seconds) and the packages built beside the running
    server, which then moves onto them (serve/upgrade.py); without it (a fleet's replica), or on a machine
    whose torch cannot load packages: the modules with Inductor (minutes cold, tens of seconds warm)."""
    from lipstream.engine import aot
    from lipstream.engine.engines import FAST_INDUCTOR
    from lipstream.models import load_musetalk

    wanted = compile == "on" or (compile == "auto" and device.type == "cuda")
    note = ""
    if wanted:
        src = weights_source(models, random_weights, size, device)
        try:
            compiled = aot.load_compiled(src.config, src.source, device, kinds=LIVE_KINDS)
        except aot.NotBuilt as e:
            if e.buildable and background:
                m = load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False)
                args = ["--random-weights", "--random-size", size] if random_weights else (
                    ["--models", str(src.models)] if src.models else [])
                note = (f"{e}: serving on the uncompiled steps now; `lipstream warmup` builds the compiled engine "
                        "beside the server (minutes, once per machine), and the server then moves onto it")
                return LiveNetworks(m, None, "off", note, PendingPackages(src.config, src.source, args, device))
            note = f"{e}: the steps are compiled with Inductor at start"
            if e.buildable:
                note += "; `lipstream warmup` builds the compiled engine once, and later starts take seconds"
        else:
            m = load_musetalk(models, device=device, random_weights=random_weights, size=size,
                              components=("whisper", "vae"), warn=False)
            return LiveNetworks(m, compiled)
    m = load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False)
    return LiveNetworks(m, None, FAST_INDUCTOR if wanted else "off", note)


def warmup(models: str | Path | None, device: torch.device, random_weights: bool, size: str, *,
           kinds: tuple[str, ...] = KINDS_FOR_ROWS["auto"], force: bool = False,
           report: Callable[[str], None] | None = None, parallel: int | None = None) -> list:
    """Build every compiled package and weights file a render on this machine needs (engine/aot_build.py).

    The packages are independent compiles of a few minutes each on a big machine, mostly one core's work
    (tracing, Inductor's lowering, the wrapper's C++): with `parallel` > 1 (default: one per 5 cores) each
    missing one builds in a process of its own, beside the others, after this process wrote the weights."""
    from lipstream.engine import aot, aot_build
    from lipstream.models import load_musetalk

    src = weights_source(models, random_weights, size, device)
    m = load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False)

    def tell(b: aot_build.Built) -> None:
        if report:
            size_mb = f", {b.bytes / 2**20:.0f} MiB" if b.bytes else ""
            took = f" in {b.seconds:.1f} s" if b.seconds else ""
            report(f"{b.kind}: {b.status}{took}{size_mb}: {b.path}" + (f" ({b.message})" if b.message else ""))

    if report:
        report(f"building the compiled engine in {aot.aot_dir()} (once per machine, torch and network shape)")
    missing = aot_build.missing_kinds(m, kinds, force=force)
    if parallel is None:
        parallel = aot_build.default_parallel(len(missing))
    if parallel <= 1 or len(missing) <= 1:
        return aot_build.build_all(m, src.source, kinds, force=force, report=tell)
    built = aot_build.build_all(m, src.source, (), force=force, report=tell)  # the weights the children read
    if any(b.status == "failed" for b in built):
        return built
    args = ["--random-size", size] if random_weights else ["--models", str(models or "")]

    def child(kind: str) -> list[str]:
        return [sys.executable, "-m", "lipstream.engine.networks", "build", kind, str(m.device), *args]

    return built + aot_build.build_in_children(m, missing, child, parallel, report=tell)


def _build_child(argv: list[str]) -> None:
    """`python -m lipstream.engine.networks build KIND DEVICE (--random-size S | --models DIR)`: one package, built
    in a process of its own for warmup's `parallel`; prints what it built as JSON, last."""
    import json
    import sys

    from lipstream.engine.aot_build import Built

    if len(argv) != 5 or argv[0] != "build" or argv[3] not in ("--random-size", "--models"):
        sys.exit("usage: python -m lipstream.engine.networks build KIND DEVICE (--random-size S | --models DIR)")
    random = argv[3] == "--random-size"
    done = warmup(None if random else (argv[4] or None), torch.device(argv[2]), random, argv[4] if random else "full",
                  kinds=(argv[1],), parallel=1)
    b = next((b for b in done if b.kind == argv[1]), None) or Built(argv[1], Path(), "failed", message="not built")
    print(json.dumps({"kind": b.kind, "path": str(b.path), "status": b.status, "seconds": b.seconds,
                      "bytes": b.bytes, "message": b.message}))


if __name__ == "__main__":
    _build_child(sys.argv[1:])
