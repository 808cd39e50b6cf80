"""Time a decode layer's projection groups with LoRA above the epilogue's rows: the shrink after the products, or beside.

For each projection group of a Qwen2.5 layer (q/k/v with bias, o, gate/up, down), each row count and each arm (NVFP4
weights, bf16 weights), three paths compute the group's outputs with fp32 adapters of rank ``--rank``:

* ``products``: the base products alone (`lora_beside.base_products`), what the group would cost without LoRA;
* ``serial``: the products, then `lora_rows`' shrink and expand on the same stream (the shipped path);
* ``beside``: `lora_beside.products_lora_beside`, the shrink on a second stream during the products.

Each is captured in a CUDA graph and replayed (`triton.testing.do_bench_cudagraph`) once per layer with that layer's
own weights and adapters (copies, so that they come from HBM as in the decode step); the table gives µs per call and
the per-step sum over the model's layers. ``serial − beside`` is what the overlap saved; ``beside − products`` what
LoRA still costs. The beside and serial outputs must agree bit for bit (the table shows the largest gap).

    python scripts/bench_lora_beside.py --model qwen2.5-7b --rows 32 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_lora_rows import groups as lora_rows_groups
from model_shapes import qwen25_config


PATHS = ("products", "serial", "beside")


def groups(model: str) -> dict[str, tuple[int, list[int], bool]]:
    """`bench_lora_rows.groups` with whether the group has a bias (Qwen2's q/k/v)."""
    return {name: (width, outs, name == "qkv") for name, (width, outs) in lora_rows_groups(model).items()}


def layer_arguments(width: int, outs: list[int], bias: bool, nvfp4: bool, rank: int, device: str) -> list:
    """`products_lora_beside`'s arguments after ``x`` for one layer's group: random weights (NVFP4 with one global scale
    per group, as q/k/v and gate/up share one), biases and fp32 adapters."""
    from trl_qerl.nvfp4.format import quantize, shared_global_scale

    dense = [torch.randn(n, width, device=device, dtype=torch.bfloat16) * 0.02 for n in outs]
    none = [None] * len(outs)
    if nvfp4:
        shared = shared_global_scale(dense)
        weights = [quantize(w, shared) for w in dense]
        packed, scale, global_scale = ([w[i] for w in weights] for i in range(3))
        weight = none
    else:
        packed = scale = global_scale = none
        weight = dense
    biases = [torch.randn(n, device=device, dtype=torch.bfloat16) * 0.1 if bias else None for n in outs]
    lora_a = [torch.randn(rank, width, device=device) / width**0.5 for _ in outs]
    lora_b = [torch.randn(n, rank, device=device) * 0.01 for n in outs]
    return [packed, scale, global_scale, weight, biases, lora_a, lora_b, [2.0] * len(outs)]


def run_path(path: str, x: torch.Tensor, arguments: list) -> list[torch.Tensor]:
    """One group's outputs by ``path`` (see `PATHS`)."""
    from trl_qerl.rollout.lora_beside import base_products, products_lora_beside
    from trl_qerl.rollout.lora_rows import lora_expand_add, lora_shrink_rows

    packed, scale, global_scale, weight, biases, lora_a, lora_b, scalings = arguments
    if path == "beside":
        return products_lora_beside(x, *arguments)
    bases = base_products(x, packed, scale, global_scale, weight, biases)
    if path == "products":
        return bases
    return lora_expand_add(bases, lora_shrink_rows(x, lora_a), lora_b, scalings)


def largest_gap(x: torch.Tensor, arguments: list) -> float:
    """The largest absolute difference between the beside and the serial outputs (0.0: bit for bit)."""
    pairs = zip(run_path("beside", x, arguments), run_path("serial", x, arguments))
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def measure(model: str, rows: int, rank: int, nvfp4: bool, copies: int) -> list[dict]:
    import triton.testing

    results = []
    for name, (width, outs, bias) in groups(model).items():
        torch.manual_seed(0)
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        first = layer_arguments(width, outs, bias, nvfp4, rank, "cuda")
        layers = [first] + [_copy(first) for _ in range(copies - 1)]
        row = {"group": name, "rows": rows, "arm": "nvfp4" if nvfp4 else "bf16", "gap": largest_gap(x, first)}
        for path in PATHS:

            def every_layer(path=path, layers=layers):
                for arguments in layers:
                    run_path(path, x, arguments)

            row[path] = 1000 * triton.testing.do_bench_cudagraph(every_layer, rep=100) / copies
        results.append(row)
        del layers, first  # before the next group's copies are made
    return results


def _copy(arguments: list) -> list:
    """A layer's arguments with every tensor cloned (another layer's weights and adapters at the same shapes)."""
    return [[t.clone() if isinstance(t, torch.Tensor) else t for t in items] for items in arguments]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help="Qwen2.5 shape (scripts/model_shapes.py)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64], help="rows per call (decode batch)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (a multiple of 4 up to 64)")
    parser.add_argument("--arms", nargs="+", default=["nvfp4", "bf16"], choices=["nvfp4", "bf16"])
    parser.add_argument("--copies", type=int, default=None, help="layers of weights to cycle through (default: all)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    layers = qwen25_config(args.model).num_hidden_layers
    copies = args.copies or layers
    print(f"LoRA r{args.rank} above the epilogue rows, {args.model} shapes, {copies} weight copies; "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| arm | group | rows | products µs | serial µs | beside µs | serial − beside µs | beside − products µs |"
          " beside / serial | largest gap |")  # fmt: skip
    print("|---" * 10 + "|")
    results = []
    for arm in args.arms:
        for rows in args.rows:
            measured = measure(args.model, rows, args.rank, arm == "nvfp4", copies)
            results += measured
            for r in measured:
                print(f"| {arm} | {r['group']} | {rows} | {r['products']:.1f} | {r['serial']:.1f} | {r['beside']:.1f} "
                      f"| {r['serial'] - r['beside']:.1f} | {r['beside'] - r['products']:.1f} | "
                      f"{r['beside'] / r['serial']:.2f} | {r['gap']:.1e} |")  # fmt: skip
            step = {path: sum(r[path] for r in measured) * layers / 1000 for path in PATHS}
            print(f"| {arm} | per decode step ({layers} layers) | {rows} | {step['products']:.3f} ms | "
                  f"{step['serial']:.3f} ms | {step['beside']:.3f} ms | {step['serial'] - step['beside']:.3f} ms | "
                  f"{step['beside'] - step['products']:.3f} ms | {step['beside'] / step['serial']:.2f} | |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
