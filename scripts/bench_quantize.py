"""Quantise-on-load benchmark: model size, peak device memory while loading, and weight error.

Writes a random-weight 16-bit checkpoint at real Qwen2.5 shapes (one safetensors shard per decoder layer),
loads it with ``quantization_config=NVFP4A16Config()`` onto the device, and reports:

* model-weight bytes after NVFP4 quantisation versus the same model in bf16 (paper: 7B 15.2 GB -> 5.9 GB);
* peak device memory during the load versus the final quantised size (goal: <= 1.2x);
* relative error of the dequantised weights against the originals (Gaussian weights; NVFP4 RTN ~ 8-10%).

Usage:
    python scripts/bench_quantize.py --model qwen2.5-7b --device cuda --workdir /tmp/ckpt
    python scripts/bench_quantize.py --model tiny --device cpu          # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import NAMES, WEIGHT_STD, qwen25_config, random_tensor, write_checkpoint
from transformers import AutoModelForCausalLM

from trl_qerl import NVFP4A16Config, NVFP4A16Linear
from trl_qerl.nvfp4.format import relative_error


GB = 1e9


def model_bytes(model) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", default=None, help="where to write the random checkpoint (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()

    config = qwen25_config(args.model)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="qerl-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    checkpoint_bytes = write_checkpoint(config, workdir, args.device)
    write_seconds = time.perf_counter() - start

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        workdir, quantization_config=NVFP4A16Config(), dtype=torch.bfloat16, device_map=args.device
    )
    load_seconds = time.perf_counter() - start
    final_bytes = model_bytes(model)
    peak = torch.cuda.max_memory_allocated() - baseline if cuda else float("nan")
    allocated = torch.cuda.memory_allocated() - baseline if cuda else float("nan")

    errors, sq_err, sq_ref = [], 0.0, 0.0
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4A16Linear):
            original = random_tensor(f"{name}.weight", (layer.out_features, layer.in_features), args.device).float()
            dense = layer.dequantize_weight(torch.float32)
            errors.append(relative_error(original, dense))
            sq_err += (dense - original).double().pow(2).sum().item()
            sq_ref += original.double().pow(2).sum().item()

    results = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "bf16_bytes": checkpoint_bytes,
        "nvfp4_bytes": final_bytes,
        "compression": checkpoint_bytes / final_bytes,
        "peak_load_bytes": peak,
        "allocated_after_load_bytes": allocated,
        "peak_over_final": peak / final_bytes if cuda else float("nan"),
        "relative_error_overall": (sq_err / sq_ref) ** 0.5,
        "relative_error_per_layer_min": min(errors),
        "relative_error_per_layer_max": max(errors),
        "write_seconds": write_seconds,
        "load_seconds": load_seconds,
    }
    print(
        f"\nNVFP4 quantise-on-load, {args.model} shapes, random N(0, {WEIGHT_STD}^2) weights, device {results['device']}"
    )
    print("| quantity | value |\n|---|---|")
    print(f"| bf16 model weights | {checkpoint_bytes / GB:.3f} GB |")
    print(f"| NVFP4 model weights (packed linears + bf16 embeddings, lm_head, norms) | {final_bytes / GB:.3f} GB |")
    print(f"| size ratio bf16 / NVFP4 | {results['compression']:.2f}x |")
    if cuda:
        print(f"| peak device memory during load | {peak / GB:.3f} GB ({results['peak_over_final']:.3f}x final) |")
    print(f"| relative weight error, all quantised layers | {results['relative_error_overall']:.4f} |")
    print(f"| relative weight error, per layer min..max | {min(errors):.4f} .. {max(errors):.4f} |")
    print(f"| load + quantise time | {load_seconds:.1f} s (checkpoint written in {write_seconds:.1f} s) |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
