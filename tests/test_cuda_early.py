"""cuda_early: the GPU's context made while torch imports, or nothing at all where it cannot be (no GPU, torch
already imported, a device it must not guess). On the H200 suite run the first test makes a real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from lipstream.engine.cuda_context import start_primary_context

PROBE = """
import json, sys, time
from lipstream.engine.cuda_context import start_primary_context
t = time.perf_counter()
handle = start_primary_context(sys.argv[1])
started = time.perf_counter() - t
if handle is None:
    print(json.dumps({"handle": None})); sys.exit()
made = handle.wait(30)
import torch
ready = torch.cuda.is_available() and torch.zeros(1, device="cuda").item() == 0
print(json.dumps({"handle": True, "made": made, "error": handle.error, "started_s": started, "cuda": ready}))
"""


def probe(device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_context_is_made_on_a_thread_where_a_gpu_is_and_nothing_breaks_where_none_is():
    got = probe("auto")
    assert got["handle"] and got["started_s"] < 0.5  # a thread: the caller goes on to import torch at once
    if torch.cuda.is_available() and torch.cuda.device_count() == 1:
        assert got["made"] and got["cuda"], got
    else:
        assert not got["made"] and got["error"], got  # no driver here: torch makes its own, as always


def test_no_early_context_for_another_device_or_after_torch():
    assert probe("cpu") == {"handle": None}
    assert probe("cuda:1") == {"handle": None}  # numbered devices other than 0 are left to torch
    assert start_primary_context("auto") is None  # torch is imported in this process already
