"""Whether the CUDA decode kernel's instances compile to the same SASS from a git revision's source and from the
working tree: a source change that leaves every instance identical changes no timing, so the numbers measured on
the revision stand. Offline (NVRTC and the cuobjdump Triton bundles; no GPU).

Instances: 1-2 m tiles x 1-2 n tiles x 2/4/8 K warps, plain and LoRA builds (ranks 8, 32, 128), bf16 and fp16,
sm_80 and sm_90. Exit status 1 if any instance differs.

Usage:
    python scripts/compare_sass.py --against 258ccad
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _sass import sass_of  # noqa: E402

from trl_qerl.nvfp4 import cuda_mma, nvrtc  # noqa: E402


def source_at(revision: str) -> str:
    """The kernels' source (`cuda_mma.SOURCE_PATHS`, joined as `cuda_mma.source` joins them) at ``revision``."""
    texts = []
    for path in cuda_mma.SOURCE_PATHS:
        relative = f"{revision}:{path.relative_to(ROOT)}"
        texts.append(
            subprocess.run(["git", "show", relative], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        )
    return "\n".join(texts)


def instructions(cubin: bytes, folder: Path) -> list[str]:
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
            for line in sass_of(cubin, folder).splitlines() if ";" in line]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="git revision whose source to compare with")
    args = parser.parse_args()
    before, now = source_at(args.against), cuda_mma.source()
    folder = Path(tempfile.mkdtemp())
    configs = [cuda_mma.MMAConfig(m, n, k) for m in (1, 2) for n in (1, 2) for k in (2, 4, 8)]
    differing = total = 0
    for config in configs:
        for rank in (0, 8, 32, 128):
            for dtype in (torch.bfloat16, torch.float16):
                for arch in ("sm_80", "sm_90"):
                    name = config.name_expression(dtype, lora_rank=rank)
                    a, b = (instructions(nvrtc.compile_cubin(src, name, arch)[0], folder) for src in (before, now))
                    total += 1
                    if a != b:
                        differing += 1
                        print(f"differs: {name} {arch} ({len(a)} vs {len(b)} instructions)")
    print(f"{total - differing} of {total} instances identical to {args.against}")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
