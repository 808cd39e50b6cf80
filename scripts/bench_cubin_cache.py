"""What the NVRTC cubin cache's write costs against the compile it saves, and against the write it replaced.

`trl_qerl.nvfp4.nvrtc.cached_cubin` stores each compiled kernel instance (its cubin and its lowered name) through
`trl_qerl.nvfp4._files.write_atomically`: a unique temporary file, fsync, rename. Before, it wrote a per-pid
``.partial`` file and renamed it, without fsync. The first steps on a new GPU or model shape compile every candidate
instance the kernel chooser times, so the write is on that path once per instance. This script cross-compiles the
decode kernel's candidate instances for one shape (no GPU needed) and times, per instance:

* ``compile``: `nvrtc.compile_cubin`;
* ``write (before)``: the previous form, ``.partial`` + `os.replace`, both files;
* ``write (now)``: `write_atomically`, both files;
* ``read``: reading both back (what every later process does instead of compiling).

The files go to a temporary directory beside the real cache (``$TRL_QERL_CACHE`` or ``~/.cache/trl_qerl``), so the
write meets that filesystem's fsync; it is removed afterwards.

Usage:
    python scripts/bench_cubin_cache.py --instances 12 --arch sm_90
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trl_qerl.nvfp4 import cuda_mma, nvrtc
from trl_qerl.nvfp4._files import write_atomically


def write_before(path: Path, data: bytes) -> None:
    """The cache's write before `write_atomically` (kept here as the baseline)."""
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def seconds(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def time_instance(name_expression: str, arch: str, directory: Path, index: int) -> dict[str, float]:
    timings = {}
    start = time.perf_counter()
    cubin, lowered = nvrtc.compile_cubin(cuda_mma.source(), name_expression, arch)
    timings["compile"] = time.perf_counter() - start
    files = ((directory / f"{index}.name", lowered.encode()), (directory / f"{index}.cubin", cubin))
    timings["write (before)"] = sum(seconds(lambda p=p, d=d: write_before(p, d)) for p, d in files)
    timings["write (now)"] = sum(seconds(lambda p=p, d=d: write_atomically(p, d)) for p, d in files)
    timings["read"] = sum(seconds(lambda p=p: p.read_bytes()) for p, _ in files)
    timings["cubin KB"] = len(cubin) / 1e3
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=12, help="compile at most this many candidate instances")
    parser.add_argument("--arch", default="sm_90", help="NVRTC target (cross-compiled: no GPU needed)")
    parser.add_argument("--shape", type=int, nargs=3, default=(1, 37888, 3584), metavar=("M", "N", "K"),
                        help="the product whose decode-kernel candidates are compiled (default: 7B gate/up, 1 row)")  # fmt: skip
    args = parser.parse_args()
    if args.instances < 1:
        parser.error("--instances must be at least 1")
    configs = cuda_mma.candidate_configs(*args.shape)[: args.instances]
    home = nvrtc.cache_dir().parent
    home.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench_cubin_cache-", dir=home))
    try:
        rows = [
            time_instance(c.name_expression(torch.bfloat16), args.arch, directory, i) for i, c in enumerate(configs)
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{len(rows)} decode-kernel instances of M, N, K = {tuple(args.shape)}, {args.arch}, cache beside {home}; "
          f"NVRTC {nvrtc.nvrtc_version()}")  # fmt: skip
    print("| per instance | median ms | total ms |")
    print("|---|---|---|")
    for column in ("compile", "write (before)", "write (now)", "read"):
        values = [row[column] * 1e3 for row in rows]
        print(f"| {column} | {statistics.median(values):.3f} | {sum(values):.1f} |")
    print(f"cubin size: median {statistics.median(r['cubin KB'] for r in rows):.0f} KB")
    before, now, compile_ = (sum(r[c] for r in rows) for c in ("write (before)", "write (now)", "compile"))
    print(f"write now / before: {now / before:.2f}x; write now / compile: {now / compile_:.4f}")


if __name__ == "__main__":
    main()
