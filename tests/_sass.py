"""Reading SASS in CPU tests: the disassembler Triton bundles, and the innermost loop of a kernel that holds MMAs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return shutil.which("cuobjdump")
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def compiled_in_subprocess(script: str, folder: Path) -> dict:
    """The JSON that ``python script <folder>/resources.json`` writes, run without Triton's interpreter (the tests'
    session runs it; compiling for a GPU target needs the real compiler) and with its own Triton cache."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "cache")
    result = folder / "resources.json"
    done = subprocess.run([sys.executable, script, str(result)], env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


def sass_of(cubin: bytes, folder: Path) -> str:
    """SASS text of a cubin (written to ``folder``)."""
    path = folder / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True).stdout


def resources_of(cubin: bytes, folder: Path) -> dict[str, int]:
    """``{"REG": ..., "STACK": ..., "LOCAL": ...}`` from ``cuobjdump -res-usage``."""
    path = folder / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def rollout_argument_types(model: str) -> dict[str, str]:
    """Triton types of the rollout's Triton kernels' (`_split_kv_kernel`, `_fused_shrink_kernel`) non-integer
    arguments as their launchers pass them: ``model`` ("bf16", "fp16", "fp32") for activations and outputs, fp32 for
    softmax partials, norm weights, LoRA A matrices, shrink sums and their scratch; every other argument is an int32
    size or stride."""
    return {
        **dict.fromkeys(
            ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "out_ptr", "new_k_ptr", "new_v_ptr", "cos_ptr", "sin_ptr"],
            f"*{model}",
        ),  # fmt: skip
        **dict.fromkeys(["x_ptr", "res_ptr", "s_ptr", "h_ptr", "gate_ptr", "up_ptr", "y_ptr"], f"*{model}"),
        **dict.fromkeys(["acc_ptr", "max_ptr", "sum_ptr", "w_ptr", "a0", "a1", "a2", "t_ptr", "partial_ptr"], "*fp32"),
        "position_ptr": "*i64",
        "count_ptr": "*i32",
        "scaling": "fp32",
        "eps": "fp32",
    }


def triton_signature(kernel, constexprs: dict, types: dict[str, str]) -> dict[str, str]:
    """`triton.compiler.ASTSource`'s signature of ``kernel``: ``"constexpr"`` for the arguments in ``constexprs``,
    ``types`` for the others (int32 where absent)."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}


def opcodes(sass: str) -> list[str]:
    """Opcodes in order (predicates dropped)."""
    return [text.split()[1] if text.startswith("@") else text.split()[0]
            for text in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]  # fmt: skip


def main_loop(sass: str, mma: str = "HMMA") -> list[str]:
    """Opcodes of the innermost loop that holds MMAs (opcodes starting with ``mma``): from a backward branch's
    target to the branch."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    opcode = [(address, text.split()[1] if text.startswith("@") else text.split()[0]) for address, text in lines]
    loops = []
    for i, (address, text) in enumerate(lines):
        target = re.search(r"BRA\s+(?:`?\(?)(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = [op for a, op in opcode if start <= a <= address]
            if any(op.startswith(mma) for op in body):
                loops.append(body)
    assert loops, "no loop with MMAs found"
    return min(loops, key=len)
