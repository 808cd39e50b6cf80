"""LoRA terms in the NVFP4 decode kernel's epilogue against the same terms added by their own compiled kernel, per
projection of a Qwen2.5 layer at decode sizes, all in one run (CUDA-graph replays, median).

Columns (µs per call): the NVFP4 product alone (no LoRA: the floor of both paths); ``unfused``: the product, then
``torch.compile`` of the expand-and-add the fused decode step ran before (`fused_decode._add_lora_as_reductions`,
fp32 masters, rounded once), two launches; ``epilogue``: the decode kernel's LoRA build through `cuda_mma.matmul`
with the chooser's instance (one launch: what ``trl_qerl::nvfp4_linear_grouped_lora`` runs). The shrink
(``x @ A.T``) is the same in both paths and not timed. Ratios: epilogue / unfused. ``--variants``: compile-time
switches of the kernel source (``-D`` defines, comma-separated per variant), one more epilogue column each, timed
in the same run. ``--sweep``: every decode instance the chooser could pick, with the epilogue; the fastest in the
build the fast engine runs at that row count (``--choices-build``, `sweep_build`) is what ``--choices`` saves.

Usage (a CUDA GPU):
    python scripts/bench_lora_epilogue.py --model qwen2.5-7b --rows 1 8 16 --rank 32 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import time_us
from model_shapes import NAMES, qwen25_config

from trl_qerl.nvfp4 import cuda_mma, kernels, nvrtc, twiddle
from trl_qerl.nvfp4.format import quantize
from trl_qerl.rollout.decoder_spec import LoraTerm, Projection
from trl_qerl.rollout.fast import TWIDDLE_MAX_ROWS
from trl_qerl.rollout.fused_decode import _add_lora_as_reductions


def layer_groups(config) -> dict[str, tuple[list[int], int]]:
    """Projection groups of one layer as the fused step launches them: name -> (rows of each weight, K)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": ([config.num_attention_heads * head_dim, kv, kv], hidden),
        "o": ([hidden], config.num_attention_heads * head_dim),
        "gate_up": ([inter, inter], hidden),
        "down": ([hidden], inter),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--variants", nargs="*", default=[], metavar="DEFINES",
                        help="also time the epilogue built with these -D switches, e.g. NVFP4_DEPTH=2 (with --sweep: "
                        "every instance in each build)")  # fmt: skip
    parser.add_argument("--sweep", action="store_true",
                        help="also time the epilogue with every decode-kernel instance the chooser could pick")  # fmt: skip
    parser.add_argument("--choices", default=None, metavar="FILE",
                        help="with --sweep: save the fastest instance per launch as LoRA-keyed kernel choices "
                             "(`KernelChooser.lora_key`), for nvfp4/tuned/")  # fmt: skip
    parser.add_argument("--choices-build", choices=CHOICE_BUILDS, default="engine",
                        help="with --sweep: the build whose times pick the fastest instance (and --choices): "
                             "'engine' (default) the one the fast engine runs at that row count, the twiddled code "
                             "order up to fast.TWIDDLE_MAX_ROWS rows (bf16) and the standard order above")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.choices and not args.sweep:
        parser.error("--choices needs --sweep")
    lora_choices = {}
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one compiled expand per projection group and row count
    config = qwen25_config(args.model)
    results = []
    print(f"LoRA r{args.rank} terms, {args.model} shapes, {torch.cuda.get_device_name()}")
    extra = "".join(f" epilogue {variant} µs |" for variant in args.variants)
    print(f"| group | M | product µs | unfused µs | epilogue µs |{extra} epilogue / unfused |")
    print("|---|---|---|---|---|---|" + "---|" * len(args.variants))
    for name, (rows, k) in layer_groups(config).items():
        weights = [tuple(t.cuda() for t in quantize(torch.randn(n, k) * 0.02)) for n in rows]
        terms = [LoraTerm(torch.randn(args.rank, k, device="cuda") / k**0.5,
                          torch.randn(n, args.rank, device="cuda") * 0.01, 2.0) for n in rows]  # fmt: skip
        projections = [Projection(n, packed=p, scale=s, global_scale=g, lora=(t,))
                       for n, (p, s, g), t in zip(rows, weights, terms)]  # fmt: skip
        packed, scale, gs = (list(t) for t in zip(*weights))
        lora_b, scaling = [t.lora_b for t in terms], [t.scaling for t in terms]
        unfused_expand = torch.compile(
            lambda x, outs: _add_lora_as_reductions(x, projections, outs), fullgraph=True, dynamic=False
        )
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            hidden = torch.cat([x.float() @ t.lora_a.T for t in terms], dim=1)

            def product():
                return torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None] * len(rows))

            def unfused():
                return unfused_expand(x, list(product().split(rows, dim=1)))

            def epilogue(options=(), choice=None):
                choice = choice or kernels.chosen(x, weights)
                assert isinstance(choice, cuda_mma.MMAConfig), f"the chooser picked {choice}, not the decode kernel"
                lora = cuda_mma.LoraInputs(hidden, lora_b, scaling)
                return cuda_mma.matmul(x, weights, choice, lora=lora, options=options)

            row = {"group": name, "m": m, "product_us": time_us(product), "unfused_us": time_us(unfused),
                   "epilogue_us": time_us(epilogue),
                   "choice": str(kernels.chosen(x, weights))}  # fmt: skip
            for variant in args.variants:
                options = nvrtc.define_flags(variant)
                row[f"epilogue_{variant}_us"] = time_us(lambda o=options: epilogue(o))
            if args.sweep:
                row["sweep_us"], configs = _sweep(epilogue, m, sum(rows), k)
                build = sweep_build(args.choices_build, m)
                for variant in dict.fromkeys(args.variants + ([build] if build else [])):
                    times, _ = _sweep(epilogue, m, sum(rows), k, nvrtc.define_flags(variant))
                    row["sweep_us"] |= {f"{variant}|{name}": t for name, t in times.items()}
                times = {c: row["sweep_us"][f"{build}|{c}" if build else c] for c in configs}
                best = min(times, key=times.get)
                row["choice_build"], row["fastest"] = build or "standard", best
                key = kernels.KernelChooser.lora_key(x, sum(rows), k, len(rows), args.rank)
                lora_choices[key] = kernels._choice_to_json(configs[best])
                print(
                    f"  {name}, {m} rows: chosen {row['choice']} {row['epilogue_us']:.1f} µs (standard build); "
                    f"fastest with LoRA in the {row['choice_build']} build {best} {times[best]:.1f} µs; every "
                    "instance: "
                    + ", ".join(f"{c} {t:.1f}" for c, t in sorted(row["sweep_us"].items(), key=lambda i: i[1]))
                )
            ours = torch.cat(unfused(), dim=1).double()
            row["relative_error_vs_unfused"] = ((epilogue().double() - ours).norm() / ours.norm()).item()
            results.append(row)
            variants = "".join(f" {row[f'epilogue_{variant}_us']:.1f} |" for variant in args.variants)
            print(f"| {name} | {m} | {row['product_us']:.1f} | {row['unfused_us']:.1f} | {row['epilogue_us']:.1f} |"
                  f"{variants} {row['epilogue_us'] / row['unfused_us']:.2f} |", flush=True)  # fmt: skip
    if args.choices:
        with open(args.choices, "w") as handle:
            json.dump(dict(sorted(lora_choices.items())), handle, indent=1)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": results}, handle, indent=1)


CHOICE_BUILDS = ("engine", "twiddled", "standard")
TWIDDLED_BUILD = ",".join(flag.removeprefix("-D") for flag in twiddle.TWIDDLED_BUILD)
"""`twiddle.TWIDDLED_BUILD` in the ``--variants`` form (defines without ``-D``)."""


def sweep_build(build: str, rows: int) -> str:
    """The ``-D`` defines of the build whose sweep picks the instance at ``rows`` rows (``""``: the standard build).
    With the LoRA epilogue the fastest instance differs between builds (H200, 14B down at 8 rows: 32r x 8t kw8 takes
    20.4 µs twiddled, 28.8 standard, where the standard build's fastest is 16r x 8t kw4), so LoRA-keyed choices are
    timed in the build the fast engine runs: the twiddled one up to `fast.TWIDDLE_MAX_ROWS` rows."""
    if build not in CHOICE_BUILDS:
        raise ValueError(f"build must be one of {CHOICE_BUILDS}, not {build!r}")
    twiddled = build == "twiddled" or (build == "engine" and rows <= TWIDDLE_MAX_ROWS)
    return TWIDDLED_BUILD if twiddled else ""


def _sweep(epilogue, m: int, n: int, k: int, options: tuple[str, ...] = ()
           ) -> tuple[dict[str, float], dict[str, cuda_mma.MMAConfig]]:  # fmt: skip
    """µs per call of the LoRA epilogue with every decode-kernel instance the chooser times at these sizes (the
    chooser times them without LoRA terms), built with ``options``, and the instances by name."""
    configs = {str(c): c for c in cuda_mma.candidate_configs(m, n, k) if cuda_mma.lora_fits(c)}
    return {name: time_us(lambda c=config: epilogue(options, choice=c)) for name, config in configs.items()}, configs


if __name__ == "__main__":
    main()
