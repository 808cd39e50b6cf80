"""NVFP4 kernel benchmark: our W4A16 products against bf16 `F.linear`, `humming-kernels` and the streaming floor,
all measured in the same run on the same GPU.

For each Qwen2.5 shape (q/k/v and gate/up as one launch over their separate weights, as the model holds them; o and
down) and row count M, times

* ``nvfp4``: our product (``trl_qerl::nvfp4_linear`` or ``trl_qerl::nvfp4_linear_grouped``: the kernel the chooser
  picks; the ``kernel`` column says which);
* ``bf16``: ``F.linear`` with the fused bf16 weight (cuBLAS);
* ``with PDL`` (``--pdl``): our CUDA decode kernel's choice again with Programmatic Dependent Launch
  (`cuda_mma.PROGRAMMATIC` True): each call may start while the previous one finishes and loads its first weights
  meanwhile. Every other column launches without it (`cuda_mma.PROGRAMMATIC` False), although decode steps of up to
  `cuda_mma.PDL_MAX_ROWS` rows take it by default: back-to-back calls of one product are not a step's neighbours;
* ``humming``: `humming-kernels` (vllm-project/humming, optional: ``pip install humming-kernels``) on the same
  compressed-tensors weight, fused rows;
* ``floor``: one Triton kernel that only streams the layer's NVFP4 bytes (codes and scales) and does no math: the
  fastest any NVFP4 kernel can read them in one launch;
* for M >= 1024 the backward ``grad_out @ W`` (``nvfp4_grad_input`` vs bf16 matmul).

Timing: CUDA events around a CUDA graph of back-to-back calls (launch gaps are those of graph replay), weights
rotated over enough copies that each kind of weight exceeds 3x the L2 cache, median of repeated replays.
Bandwidth counts the bytes that must move (weights once, activations in and out) and is compared with a measured
device-to-device copy. Every point also checks our product against a float64 reference (``rel_err``). ``--sweep``
also times every instance of the CUDA decode kernel for M <= 512 (and ``--variants`` compile-time switches of its
source), of the tiled kernel and of the wgmma kernel (with the ``--variants`` too: ``NVFP4_WGMMA_PROFILE=1`` times it
without the decode). ``--retune ROWS`` ignores the shipped kernel choices (``nvfp4/tuned/``) from
that row bucket on, so every candidate is timed again (save them with ``--choices``); ``--precompile N`` builds
the CUDA kernels' candidate instances in N processes first (NVRTC's disk cache), which keeps compile time out of
the first timings.

Usage:
    python scripts/bench_kernels.py --models qwen2.5-7b qwen2.5-32b --json out.json --choices choices.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl
from bench_settings import module_settings
from model_shapes import linear_shapes

from trl_qerl.nvfp4 import cuda_mma, cuda_wgmma, kernels, nvrtc
from trl_qerl.nvfp4.format import dequantize, quantize, relative_error, shared_global_scale


ROWS = (1, 4, 16, 64, 128, 256, 512, 1024, 4096)
SHAPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def projections(model: str) -> dict[str, list[tuple[int, int]]]:
    """``{shape: [(out, in) of each weight the launch reads]}`` of one decoder layer."""
    shapes = linear_shapes(model)
    gate_up_rows, hidden = shapes["gate_up_proj"]
    return {
        "qkv_proj": [shapes["q_proj"], shapes["kv_proj"], shapes["kv_proj"]],
        "o_proj": [shapes["o_proj"]],
        "gate_up_proj": [(gate_up_rows // 2, hidden)] * 2,
        "down_proj": [shapes["down_proj"]],
    }


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def graph_time(calls, repeats: int = 15) -> float:
    """Median seconds per call of ``calls[i % len(calls)]()`` captured back to back in one CUDA graph."""
    copies = len(calls)
    per_graph = max(copies, 8)
    for call in calls:
        call()  # warm-up outside capture: compiles and tunes
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % copies]()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    del graph
    return statistics.median(times[1:])


@triton.jit
def _stream_kernel(words_ptr, scales_ptr, out_ptr, WORDS_PER_ROW, SCALE_WORDS_PER_ROW, ROWS: tl.constexpr,
                   CHUNK: tl.constexpr):  # fmt: skip
    """Reads ROWS rows of codes and scales (int32 words) once and stores one xor per row: streaming, no math."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    words = words_ptr + rows[:, None] * WORDS_PER_ROW + tl.arange(0, CHUNK)[None, :]
    scales = scales_ptr + rows[:, None] * SCALE_WORDS_PER_ROW + tl.arange(0, CHUNK // 8)[None, :]
    acc = tl.zeros((ROWS, CHUNK), tl.int32)
    scale_acc = tl.zeros((ROWS, CHUNK // 8), tl.int32)
    for k in range(0, WORDS_PER_ROW, CHUNK):
        acc ^= tl.load(words + k, eviction_policy="evict_first")
        scale_acc ^= tl.load(scales + k // 8, eviction_policy="evict_first")
    tl.store(out_ptr + rows, tl.xor_sum(acc, axis=1) ^ tl.xor_sum(scale_acc, axis=1))


def stream_floor(packed: list[torch.Tensor], scales: list[torch.Tensor]) -> float:
    """Fastest of a few launch shapes of `_stream_kernel` over the layers' bytes (rotating copies)."""
    n, k = packed[0].shape[0], packed[0].shape[1] * 2
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    best = float("inf")
    for rows, chunk in ((2, 64), (4, 64), (8, 64), (4, 128)):
        if n % rows or (k // 8) % chunk:
            continue

        def call(i, rows=rows, chunk=chunk):
            _stream_kernel[(n // rows,)](packed[i].view(torch.int32), scales[i].view(torch.int32), out, k // 8, k // 64,
                                         ROWS=rows, CHUNK=chunk, num_warps=4)  # fmt: skip

        best = min(best, graph_time([lambda i=i: call(i) for i in range(len(packed))]))
    return best


def humming_layer(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """A `humming-kernels` layer over one compressed-tensors NVFP4 weight, or None where it is not installed."""
    try:
        from humming.layer import HummingLayer
    except ImportError:
        return None
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float", "num_bits": 4,
              "strategy": "tensor_group", "group_size": 16, "symmetric": True}  # fmt: skip
    layer = HummingLayer(shape_n=packed.shape[0], shape_k=packed.shape[1] * 2, weight_config=config,
                         torch_dtype=torch.bfloat16).cuda()  # fmt: skip
    layer.load_from_tensors({"weight_packed": packed.clone(), "weight_scale": scale.clone(),
                             "weight_global_scale": global_scale.clone()})  # fmt: skip
    layer.transform()
    return layer


class Layer:
    """Rotating copies of one (possibly grouped) projection: NVFP4 members, their fused form, the bf16 weight."""

    def __init__(self, members: list[tuple[int, int]], l2_bytes: int, with_humming: bool) -> None:
        n, k = sum(rows for rows, _ in members), members[0][1]
        self.n, self.k = n, k
        nvfp4_copies = max(2, -(-3 * l2_bytes // (n * k * 9 // 16)))
        bf16_copies = max(2, -(-3 * l2_bytes // (n * k * 2)))
        self.dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(bf16_copies)]
        self.members, self.fused = [], []
        for i in range(nvfp4_copies):
            dense = self.dense[i % bf16_copies]
            scale = shared_global_scale([dense])  # the group shares one global scale, as the quantizer does
            parts = list(dense.split([rows for rows, _ in members]))
            quantized = [quantize(part, scale) for part in parts]
            self.members.append(quantized)
            self.fused.append(quantize(dense, scale))
        self.humming = None
        if with_humming:  # humming's layers hold their own (re-laid) copy of the weight
            self.humming = [layer for layer in (humming_layer(*f) for f in self.fused[:nvfp4_copies]) if layer]

    @property
    def nvfp4_weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fused[0])


def nvfp4_call(x, members):
    if len(members) == 1:
        return lambda: torch.ops.trl_qerl.nvfp4_linear(x, *members[0])
    packed, scale, gs = (list(t) for t in zip(*members))
    return lambda: torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None] * len(members))


def chosen_kernel(x, layer: Layer, members: int) -> str:
    key = kernels.KernelChooser.key(x, layer.n, layer.k, members)
    return str(kernels.CHOOSER.choices.get(key, "heuristic"))


def bench_point(layer: Layer, rows: int, variants: list[str], pdl: bool = False) -> dict:
    n, k = layer.n, layer.k
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    io_bytes = (rows * k + rows * n) * 2
    result = {"N": n, "K": k, "M": rows}
    result["nvfp4_s"] = graph_time([nvfp4_call(x, members) for members in layer.members])
    result["kernel"] = chosen_kernel(x, layer, len(layer.members[0]))
    reference = torch.cat([x.double() @ dequantize(*w, dtype=torch.float64).T for w in layer.members[0]], dim=1)
    result["rel_err"] = relative_error(reference, nvfp4_call(x, layer.members[0])())
    if pdl and "mma" in result["kernel"]:  # the same calls with Programmatic Dependent Launch
        with module_settings(cuda_mma, {"PROGRAMMATIC": True}):
            result["nvfp4_pdl_s"] = graph_time([nvfp4_call(x, members) for members in layer.members])
    result["bf16_s"] = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in layer.dense])
    if layer.humming and rows <= 512:
        try:
            result["humming_s"] = graph_time([lambda h=h: h(x) for h in layer.humming])
        except Exception as error:  # noqa: BLE001 - a peer's failure is reported, not fatal
            result["humming_error"] = repr(error)[:300]
    result["nvfp4_bandwidth"] = (layer.nvfp4_weight_bytes + io_bytes) / result["nvfp4_s"]
    if rows >= 1024:
        grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        result["nvfp4_backward_s"] = graph_time(
            [lambda q=q: torch.ops.trl_qerl.nvfp4_grad_input(grad, *q) for q in layer.fused]
        )
        result["bf16_backward_s"] = graph_time([lambda w=w: grad @ w for w in layer.dense])
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if variants and rows <= kernels.MMA_MAX_ROWS and cuda_mma.supports(x, layer.members[0]):
        result["sweep_s"] = {}
        for variant in (v for v in variants if not wgmma_only(v)):
            options = nvrtc.define_flags(variant)
            for config in cuda_mma.candidate_configs(rows, n, k, num_sms):
                calls = [lambda m=m, c=config, o=options: cuda_mma.matmul(x, m, c, options=o) for m in layer.members]
                try:
                    result["sweep_s"][f"{variant or 'default'}|{config}"] = graph_time(calls, repeats=7)
                except RuntimeError as error:  # an instance that does not build (registers, shared memory)
                    result["sweep_s"][f"{variant or 'default'}|{config}"] = repr(error)[:200]
    if variants and cuda_mma.supports_tile(x, layer.members[0]):
        for config in kernels.tile_candidates(kernels.m_bucket(rows), n, k, x.device, num_sms):
            # the wgmma kernel's source switches too (e.g. NVFP4_WGMMA_PROFILE=1: no decode, wrong products)
            for variant in variants if isinstance(config, cuda_wgmma.WgmmaConfig) else [""]:
                options = nvrtc.define_flags(variant)
                calls = [
                    (lambda m=m, c=config, o=options: cuda_wgmma.wgmma_matmul(x, m, c, options=o))
                    if isinstance(config, cuda_wgmma.WgmmaConfig)
                    else (lambda m=m, c=config: cuda_mma.tile_matmul(x, m, c))
                    for m in layer.members
                ]
                label = f"{variant}|{config}" if variant else str(config)
                try:
                    result.setdefault("sweep_s", {})[label] = graph_time(calls, repeats=7)
                    # a build switch may change the products (NVFP4_WGMMA_PROFILE on purpose): say so per instance
                    result.setdefault("sweep_rel_err", {})[label] = relative_error(reference, calls[0]())
                except RuntimeError as error:
                    result.setdefault("sweep_s", {})[label] = repr(error)[:200]
    return result


def wgmma_only(variant: str) -> bool:
    """Whether a ``--variants`` entry switches only the wgmma kernel's source (``NVFP4_WGMMA_*``): the decode
    kernel's sweep skips it rather than time identical builds."""
    return bool(variant) and all(define.startswith("NVFP4_WGMMA_") for define in variant.split(","))


def best_per_variant(result: dict, variants: list[str]) -> str:
    """One line: the fastest wgmma instance of each ``--variants`` build at this point, µs, with its relative
    error (the sweep's ``sweep_s`` / ``sweep_rel_err``)."""
    cells = []
    for variant in variants:
        prefix = f"{variant}|" if variant else ""
        timed = {
            label[len(prefix) :]: seconds
            for label, seconds in result.get("sweep_s", {}).items()
            if isinstance(seconds, float) and label.startswith(prefix + "wgmma")
        }
        if not timed:
            continue
        config = min(timed, key=timed.get)
        error = result.get("sweep_rel_err", {}).get(prefix + config, float("nan"))
        cells.append(f"{variant or 'default'}: {config} {timed[config] * 1e6:.1f} µs (err {error:.1e})")
    return "; ".join(cells)


def precompile(models: list[str], shapes: list[str], rows: list[int], processes: int,
               variants: tuple[str, ...] = ("",)) -> float:  # fmt: skip
    """Builds every CUDA-kernel instance the chooser may time for these points into NVRTC's disk cache (the wgmma
    instances also in each of ``variants``' builds), in ``processes`` worker processes; returns the seconds it
    took."""
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    major, minor = torch.cuda.get_device_capability(0)
    names = set()
    for model in models:
        for name in shapes:
            members = projections(model)[name]
            n, k = sum(r for r, _ in members), members[0][1]
            for m in rows:
                bucket = kernels.m_bucket(m)
                for choice in kernels.candidate_configs(bucket, n, k, num_sms, mma=True, device=torch.device("cuda")):
                    if hasattr(choice, "name_expression"):  # the CUDA kernels' configs
                        arch = f"sm_{major}{minor}" + ("a" if getattr(choice, "arch_specific", False) else "")
                        builds = variants if isinstance(choice, cuda_wgmma.WgmmaConfig) else ("",)
                        for variant in builds:
                            names.add((choice.name_expression(torch.bfloat16), arch, nvrtc.define_flags(variant)))
    names.add((cuda_mma.reduce_name(torch.bfloat16), f"sm_{major}{minor}", ()))
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(_build, sorted(names)))
    return time.time() - start


def _build(item: tuple[str, str, tuple[str, ...]]) -> None:
    name, arch, options = item
    nvrtc.cached_cubin(cuda_mma.source(), name, arch, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-32b"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--no-humming", action="store_true", help="skip the humming-kernels column")
    parser.add_argument("--no-floor", action="store_true", help="skip the streaming-floor column")
    parser.add_argument("--sweep", action="store_true", help="also time every CUDA decode-kernel instance")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="with --sweep: compile-time switches of the kernel source to compare, e.g. "
                        "NVFP4_DEPTH=2,NVFP4_L2_PREFETCH=1 ('' is the default build)")  # fmt: skip
    parser.add_argument("--pdl", action="store_true",
                        help="also time the CUDA decode kernel's choices with Programmatic Dependent Launch")  # fmt: skip
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--choices", default=None,
                        help="save this GPU's kernel choices here (merged into the file if it exists)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting new shapes after this")
    parser.add_argument("--retune", type=int, default=None, metavar="ROWS",
                        help="ignore the shipped kernel choices for row buckets >= ROWS: time every candidate again")  # fmt: skip
    parser.add_argument("--precompile", type=int, default=0, metavar="N",
                        help="build the CUDA kernels' candidate instances in N processes first")  # fmt: skip
    parser.add_argument("--split-k", action="store_true",
                        help="offer the decode kernel's SPLIT_K builds (K over 2 or 4 CTAs of a tile) to the chooser "
                        "and the sweep (cuda_mma.SPLIT_K_CANDIDATES); combine with --retune 1 to time them")  # fmt: skip
    parser.add_argument("--wgmma-deep", action="store_true",
                        help="offer the wgmma kernel's deeper rings and wave-filling K splits to the chooser and the "
                        "sweep (cuda_wgmma.DEEP_CANDIDATES)")  # fmt: skip
    parser.add_argument("--wgmma-spread", action="store_true",
                        help="offer the wgmma kernel's rings that fit three times per multiprocessor and K splits "
                        "down to 4 blocks per CTA to the chooser and the sweep (cuda_wgmma.SPREAD_CANDIDATES)")  # fmt: skip
    parser.add_argument("--wgmma-from", type=int, default=None, metavar="ROWS",
                        help="offer the wgmma kernel from this row bucket (kernels.WGMMA_ROWS; 64 by default)")  # fmt: skip
    parser.add_argument("--tile-spread", action="store_true",
                        help="offer the tiled kernel's pipelines that fit four times per multiprocessor and K splits "
                        "down to 4 blocks per CTA, up to 32 rows (cuda_mma.TILE_SPREAD_CANDIDATES)")  # fmt: skip
    args = parser.parse_args()
    cuda_mma.PROGRAMMATIC = False  # one product's calls back to back, not a step (see the module docstring)
    cuda_mma.TILE_SPREAD_CANDIDATES = args.tile_spread or cuda_mma.TILE_SPREAD_CANDIDATES
    if args.wgmma_from is not None:
        kernels.WGMMA_ROWS = (args.wgmma_from, kernels.WGMMA_ROWS[1])
    cuda_wgmma.SPREAD_CANDIDATES = args.wgmma_spread or cuda_wgmma.SPREAD_CANDIDATES
    cuda_mma.SPLIT_K_CANDIDATES = args.split_k or cuda_mma.SPLIT_K_CANDIDATES
    cuda_wgmma.DEEP_CANDIDATES = args.wgmma_deep or cuda_wgmma.DEEP_CANDIDATES
    if args.retune is not None:
        stale = [key for key in kernels.CHOOSER.choices if kernels.ChoiceKey.parse(key).rows >= args.retune]
        for key in stale:
            del kernels.CHOOSER.choices[key]
    if args.precompile:
        variants = tuple(args.variants) if args.sweep else ("",)
        seconds = precompile(args.models, args.shapes, args.rows, args.precompile, variants)
        print(f"precompiled the CUDA kernels' candidates in {seconds:.0f} s")

    start = time.time()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    results = []
    for model in args.models:
        print(f"\n### {model}\n")
        print("| shape (N x K) | M | kernel | NVFP4 µs | bf16 µs | NVFP4/bf16 | humming/bf16 | floor/bf16 "
              "| NVFP4 TB/s (% copy) | bwd NVFP4/bf16 | rel. err |" + (" with PDL µs (/bf16) |" if args.pdl else ""))  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.pdl else ""))
        for name in args.shapes:
            if time.time() - start > args.budget_s:
                print(f"(stopped: --budget-s {args.budget_s:.0f} reached before {model} {name})")
                break
            layer = Layer(projections(model)[name], props.L2_cache_size, not args.no_humming)
            floor = None if args.no_floor else stream_floor([f[0] for f in layer.fused], [f[1] for f in layer.fused])
            for rows in args.rows:
                r = bench_point(layer, rows, args.variants if args.sweep else [], args.pdl) | {"model": model,
                                                                                              "shape": name}  # fmt: skip
                if floor is not None:
                    r["floor_s"] = floor
                results.append(r)
                print(_row(name, r, bandwidth, args.pdl), flush=True)
                if args.sweep and (best := best_per_variant(r, args.variants)):
                    print(f"  {name} {rows} rows, fastest wgmma instance per build: {best}", flush=True)
            del layer
            torch.cuda.empty_cache()
            if args.json:
                _write(args.json, props.name, bandwidth, results)
            if args.choices:  # (per shape: a run cut short keeps what it timed)
                kernels.CHOOSER.save(args.choices, device=props.name, merge=True)
    if args.json:
        _write(args.json, props.name, bandwidth, results)
    if args.choices:
        kernels.CHOOSER.save(args.choices, device=props.name, merge=True)


def _row(name: str, r: dict, bandwidth: float, pdl: bool = False) -> str:
    def ratio(key):
        return f"{r[key] / r['bf16_s']:.2f}" if key in r else "-"

    backward = f"{r['nvfp4_backward_s'] / r['bf16_backward_s']:.2f}" if "nvfp4_backward_s" in r else "-"
    return (f"| {name} ({r['N']}x{r['K']}) | {r['M']} | {r['kernel']} | {r['nvfp4_s'] * 1e6:.1f} "
            f"| {r['bf16_s'] * 1e6:.1f} | {ratio('nvfp4_s')} | {ratio('humming_s')} | {ratio('floor_s')} "
            f"| {r['nvfp4_bandwidth'] / 1e12:.2f} ({100 * r['nvfp4_bandwidth'] / bandwidth:.0f}%) | {backward} "
            f"| {r['rel_err']:.1e} |"
            + (f" {r['nvfp4_pdl_s'] * 1e6:.1f} ({ratio('nvfp4_pdl_s')}) |" if "nvfp4_pdl_s" in r else " - |" if pdl else ""))  # fmt: skip


def _write(path: str, device: str, bandwidth: float, results: list) -> None:
    with open(path, "w") as handle:
        json.dump({"device": device, "copy_bandwidth": bandwidth, "results": results,
                   "candidate_ms": kernels.CHOOSER.timings}, handle, indent=1)  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("HUMMING_CACHE_DIR", os.path.join(os.getcwd(), ".humming_cache"))
    main()
