"""Time a decode layer's LoRA products above the epilogue's row limit: fp32 cuBLAS against `lora_rows`' two launches.

For each projection group of a Qwen2.5 layer (q/k/v, o, gate/up, down) and each row count, both paths compute
``round(base + scaling * (x @ A.T) @ B.T)`` with fp32 adapters of rank ``--rank``:

* ``cuBLAS``: what `fused_decode.project` ran before `lora_rows` (the stacked A matrices in one fp32 product, one fp32
  product per projection's B, the add and the rounding);
* ``Triton``: `lora_rows.lora_shrink_rows` and `lora_rows.lora_expand_add`, with the kernel settings shipped and with
  each ``--variants`` entry (``NAME=VALUE,...`` of `_lora_rows_kernel`).

Each is captured in a CUDA graph and replayed (`triton.testing.do_bench_cudagraph`), as the decode step runs, once
per layer with that layer's own adapters (so that they come from HBM, as in the step, not from L2); the table gives µs
per call and the ratio, and the per-step sum over the model's layers.

    python scripts/bench_lora_rows.py --model qwen2.5-7b --rows 32 64
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from model_shapes import linear_shapes, qwen25_config


def groups(model: str) -> dict[str, tuple[int, list[int]]]:
    """``{group: (in_features, [out_features per projection])}`` of one decoder layer."""
    shapes = linear_shapes(model)
    (q, hidden), (kv, _), (gate_up, _) = shapes["q_proj"], shapes["kv_proj"], shapes["gate_up_proj"]
    return {"qkv": (hidden, [q, kv, kv]), "o": (hidden, [shapes["o_proj"][0]]),
            "gate_up": (hidden, [gate_up // 2] * 2), "down": (shapes["down_proj"][1], [shapes["down_proj"][0]])}  # fmt: skip


def cublas_path(x, lora_a, lora_b, bases, scalings):
    hidden = F.linear(x.float(), torch.cat(lora_a)).split([a.shape[0] for a in lora_a], dim=-1)
    return [(base + F.linear(h, b) * s).to(x.dtype) for base, h, b, s in zip(bases, hidden, lora_b, scalings)]


def triton_path(x, lora_a, lora_b, bases, scalings):
    from trl_qerl.rollout.lora_rows import lora_expand_add, lora_shrink_rows

    return lora_expand_add(bases, lora_shrink_rows(x, lora_a), lora_b, scalings)


def measure(model: str, rows: int, rank: int, variants: dict[str, dict[str, int]], copies: int) -> list[dict]:
    import triton.testing
    from bench_settings import module_settings

    from trl_qerl.rollout import _lora_rows_kernel as kernel

    results = []
    for name, (width, outs) in groups(model).items():
        torch.manual_seed(0)
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        # one adapter set per layer, each read once per timed call as the decode step reads them (from HBM, not L2)
        layers = [([torch.randn(rank, width, device="cuda") / width**0.5 for _ in outs],
                   [torch.randn(n, rank, device="cuda") * 0.01 for n in outs]) for _ in range(copies)]  # fmt: skip
        bases = list(torch.randn(rows, sum(outs), device="cuda", dtype=torch.bfloat16).split(outs, dim=1))
        scalings = [2.0] * len(outs)

        def per_call_us(path):
            def every_layer():
                for lora_a, lora_b in layers:
                    path(x, lora_a, lora_b, bases, scalings)

            return 1000 * triton.testing.do_bench_cudagraph(every_layer, rep=100) / copies

        theirs = cublas_path(x, *layers[0], bases, scalings)
        row = {"group": name, "rows": rows, "rank": rank, "cublas_us": per_call_us(cublas_path), "triton_us": {},
               "max_abs_gap": {}}  # fmt: skip
        for label, settings in variants.items():
            with module_settings(kernel, settings):
                ours = triton_path(x, *layers[0], bases, scalings)
                row["max_abs_gap"][label] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs)
                )
                row["triton_us"][label] = per_call_us(triton_path)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help="Qwen2.5 shape (scripts/model_shapes.py)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64], help="rows per call (decode batch)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (a multiple of 4 up to 64)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME=VALUE,...",
                        help="more Triton arms: integer settings of trl_qerl.rollout._lora_rows_kernel")  # fmt: skip
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    from bench_settings import parse_settings

    from trl_qerl.rollout import _lora_rows_kernel as kernel

    variants = {"shipped": {}, **{text: parse_settings(text, kernel) for text in args.variants}}
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    layers = qwen25_config(args.model).num_hidden_layers
    print(f"LoRA r{args.rank} above the epilogue rows, {args.model} shapes; {torch.cuda.get_device_name()}")
    labels = list(variants)
    print("| group | rows | cuBLAS µs | " + " | ".join(f"Triton {v} µs" for v in labels) + " | cuBLAS / Triton shipped |"
          " largest output gap |")  # fmt: skip
    print("|---" * (len(labels) + 5) + "|")
    results = []
    for rows in args.rows:
        measured = measure(args.model, rows, args.rank, variants, layers)
        results += measured
        for r in measured:
            cells = " | ".join(f"{r['triton_us'][v]:.1f}" for v in labels)
            gap = max(r["max_abs_gap"].values())
            print(f"| {r['group']} | {rows} | {r['cublas_us']:.1f} | {cells} | "
                  f"{r['cublas_us'] / r['triton_us']['shipped']:.2f} | {gap:.2e} |")  # fmt: skip
        cublas = sum(r["cublas_us"] for r in measured) * layers / 1000
        ours = {v: sum(r["triton_us"][v] for r in measured) * layers / 1000 for v in labels}
        cells = " | ".join(f"{ours[v]:.3f} ms" for v in labels)
        print(f"| per decode step ({layers} layers) | {rows} | {cublas:.3f} ms | {cells} | "
              f"{cublas / ours['shipped']:.2f} | |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
