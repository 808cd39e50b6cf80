"""A decode step written against the model's tensors (`DecoderSpec`), not its modules.

transformers' forward spends most of a batch-1 decode step outside the matrix products: PEFT's per-adapter chains
(casts, dropout, scaling, adds), norms, rotary, mask handling, one launch each. This step computes the same
layer (the formulas of transformers' Llama/Qwen2/Qwen3 code, in the same order and dtypes) with fewer launches:

* q/k/v and gate/up each run as one NVFP4 launch (`trl_qerl::nvfp4_linear_grouped` on CUDA, bias in the epilogue) reading
  the stored tensors in place;
* LoRA products run in the adapters' dtype (fp32 masters: no per-step weight casts), the shrink of adapters that
  read the same activations as one product (`lora_shrink`), and the result is rounded once when added to the base
  output; at decode sizes the NVFP4 kernel adds the terms in its epilogue (`LORA_EPILOGUE`), and each shrink is
  made in one launch with its input (`FUSED_SHRINK`: the norm, or SiLU·up); otherwise a compiled step writes them
  as reductions that fuse into the neighbouring kernels;
* attention reads the KV cache through one `scaled_dot_product_attention` call per layer, the query heads of a
  key/value head folded into the query length (no repeated keys);
* optionally (``compile=True``) the whole layer runs through ``torch.compile``, so the elementwise glue (residual
  adds, norms with their fp32 weights, rotary, SiLU) fuses into a few kernels. One compiled graph serves every layer.

The KV cache belongs to the decoder (``[batch, kv_heads, cache_len, head_dim]`` per layer). Prefill runs the same
layer code eagerly on the whole prompt. Rows attend through an additive mask in the model dtype (a boolean mask
would be converted by SDPA in every layer).

Dropout is not applied: rollouts run with the model in eval mode, where PEFT's LoRA dropout is the identity.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..nvfp4.cuda_mma import LORA_RANKS
from ..nvfp4.dispatch import kernels_for
from .decode_attention import (
    rotary_in_attention_applies,
    split_kv_applies,
    split_kv_attention,
    split_kv_attention_rotary,
    triton_available,
)
from .decoder_spec import DecoderSpec, LayerSpec, NormSpec, Projection
from .fused_shrink import (
    add_rms_norm_shrink,
    fused_shrink_applies,
    plain_shrink,
    rms_norm_reference,
    rms_norm_shrink,
    shrink_reference,
    silu_mul_shrink,
)
from .lora_beside import base_products, products_lora_beside
from .lora_rows import (
    adapter_refusal,
    adapters_apply,
    lora_expand_add,
    lora_rows_applies,
    lora_shrink_rows,
    runs_triton,
)


__all__ = [
    "ADD_IN_NEXT_NORM",
    "DECODE_ATTENTION",
    "FUSED_SHRINK",
    "FUSED_SHRINK_ROWS",
    "LORA_EPILOGUE",
    "LORA_BESIDE_MIN_ROWS",
    "LORA_ROW_KERNELS",
    "LORA_SHRINK_BESIDE",
    "ROTARY_IN_ATTENTION",
    "FusedDecoder",
    "apply_rotary",
    "attention",
    "lora_shrink",
    "project",
    "rms_norm",
]


logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, norm: NormSpec) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in fp32, round to the input dtype, multiply by the weight (fp32 for
    trained or AQN norms, whose product is rounded to the input dtype once, as `trl_qerl.norms` does)."""
    return rms_norm_reference(x, norm.weight, norm.eps)


DECODE_ATTENTION = ("auto", "sdpa", "split_kv")
"""Decode attention kernels `FusedDecoder` can use (its ``decode_attention`` argument). ``"auto"`` is ``"split_kv"``
on Hopper GPUs where it applies, else ``"sdpa"``: on the H200 (7B, NVFP4 + LoRA + AQN, 256 + 1024 tokens,
2026-12-02) a decode step takes 3.93 / 7.89 ms at batch 8 / 32 with it and 4.46 / 8.03 ms with SDPA (cuDNN reads the
whole cache). Other GPUs were not measured, so there "auto" keeps SDPA (``"split_kv"`` still runs where asked)."""

LORA_REDUCTION_ROWS = 16
"""Up to this many rows, a compiled step writes LoRA products as multiply-and-sum reductions (see below). Measured
on the H200 (7B, r32, 256 new tokens, one process per value, 2026-12-02): batch 8 takes 4.37 / 5.97 / 4.38 ms per
step with 64 / 0 / 16, batch 32 8.99 / 8.83 / 8.82 ms: reductions win at 8 rows, matmuls at 32."""


LORA_EPILOGUE = True
"""Up to `LORA_REDUCTION_ROWS` rows, NVFP4 projections with one fp32 adapter each, of one rank in `LORA_RANKS` per
group, get their LoRA terms added by the NVFP4 product (`NVFP4Kernels.grouped_lora`: on GPUs the CUDA decode
kernel's epilogue; elsewhere, or where the chooser picks another kernel, added after the product), so no kernel of
the step reads the base output back to expand and add them. Other adapters, and ``False``, take the expand as its
own reductions (how the step ran before; ``False`` is kept for benchmarks: `scripts/bench_rollout.py`'s
``+lora_unfused`` engine)."""


LORA_ROW_KERNELS = True
"""From `LORA_REDUCTION_ROWS` + 1 to `LORA_ROW_KERNELS_MAX` rows, on CUDA, a projection group's LoRA terms (one
adapter per projection that `lora_rows.adapter_refusal` passes: fp32, a rank it takes) take two Triton launches
(`lora_rows`: the shrink over every row, the expand added to the base outputs) instead of fp32 cuBLAS products, which
run on CUDA cores with split-K reductions and a launch per projection; `FusedDecoder` logs one line where its adapters
keep that path. ``False`` is kept for benchmarks (`scripts/bench_rollout.py`'s ``+lora_cublas`` engines)."""

LORA_ROW_KERNELS_MAX = 128
"""Most rows `LORA_ROW_KERNELS` takes (decode batches; longer prefills keep cuBLAS)."""

LORA_SHRINK_BESIDE = True
"""Where `LORA_ROW_KERNELS` takes a group whose every projection has an adapter, launch its shrink on a second stream
beside its base products and join before the expand (`lora_beside.products_lora_beside`: the same kernels and
numbers, one custom op per group), from `LORA_BESIDE_MIN_ROWS` rows. Measured on an H100 (7B decode step, NVFP4 + LoRA
+ AQN, lane order, 2026-12-05, BENCHMARKS.md): 7.27 -> 7.09 ms at 64 rows, 9.90 -> 9.30 at 128; at 32 rows it lost
(5.81 -> 5.94 in the twiddled order) and at 8 (3.69 -> 4.13). ``False``: every group on the serial path."""

LORA_BESIDE_MIN_ROWS = 33
"""Fewest rows `LORA_SHRINK_BESIDE` takes: 33, above the 32-row steps where it measured slower. Lower (a benchmark
switch: ``+shrink_beside`` engines set 17, ``+shrink_beside_all_rows`` engines 1), the groups of smaller steps take it
too, in place of the shrink made with the norm (`FUSED_SHRINK`) and the terms added in
the NVFP4 epilogue (`LORA_EPILOGUE`): a plain norm, the products with the shrink beside them, and an expand launch. The
question it asks: whether hiding a shrink beside the product pays for the expand launch it brings back."""


FUSED_SHRINK = True
"""Where the LoRA terms of a projection group go to the NVFP4 epilogue (`LORA_EPILOGUE`) and a step has at most
`FUSED_SHRINK_ROWS` rows, make the group's input and its shrink ``x @ A.T`` in one launch (`fused_shrink`: the input
norm with the q/k/v shrinks, the residual add and post-attention norm with the gate/up shrinks, SiLU·up with the down
shrink) instead of inductor's separate kernels. ``False`` is kept for benchmarks (`scripts/bench_rollout.py`'s
``+shrink_unfused`` engine)."""

FUSED_SHRINK_ROWS = 8
"""Measured on the H200 (7B, NVFP4 + LoRA r32 + AQN, 256 + 256 tokens, 2026-12-02): 385 instead of 497 kernels per
step, and no step-time change beyond the run-to-run spread up to 8 rows (batch 1 3.77 / 3.81 / 3.60 ms against
3.78 / 3.82 / 3.73 without; batch 8 4.12 / 4.16 / 4.36 against 4.44 / 4.16 / 4.14), but batch 16 5.58 against 5.39.
Again with the SiLU·up shrink over every row (`_fused_shrink_kernel.ROWS_FROM`; eighth session, engines interleaved in
one process): batch 8 3.97 / 4.00 ms against 4.07 / 4.09 with the per-row kernels, batch 16 with the fused shrinks
5.40 / 5.42 against 5.33 / 5.34 with inductor's: the norms' per-row kernels still lose at 16 rows."""

PLAIN_SHRINK = False
"""True: where a projection group's LoRA terms go to the NVFP4 epilogue but no kernel of ours makes its input with the
shrink (the o projection, after the attention), make ``x @ A.T`` in our own launch (`fused_shrink.plain_shrink`) up to
`FUSED_SHRINK_ROWS` rows, instead of inductor's reduction: a launch that takes Programmatic Dependent Launch
(`nvfp4.cuda_mma.PROGRAMMATIC`), so that attention, shrink and o product overlap at their boundaries. Off: on an H100
(2026-12-07, 7B, `scripts/bench_rollout.py`'s ``default+plain_shrink`` against ``default+own_choices``) the decode step
took 2.75-2.80 against 2.79-2.85 ms at batch 1 but 3.98-4.09 against 3.36-3.42 ms at batch 8, with the same kernels and
kernel time uncaptured. The replay profile (forty-third session) puts the loss in the captured step's kernels, not
between them: the same idle time, but the down product 27.2 -> 39.4 µs a call; why is not yet known."""


ROTARY_IN_ATTENTION = False
"""True: where decode attention runs split over the cache and the layer has no q/k norms (bf16), rotate q and k and
write this step's key and value into the cache in the attention's partials launch (`split_kv_attention_rotary`, with
the roundings of the eager ops: the same bits) instead of inductor's kernel for them (~1.35 µs per 7B layer on an
H100). Off: measured no faster. On an H100 (7B, NVFP4 + LoRA r32 + AQN, 2026-12-06, BENCHMARKS.md) a first form, which
read its own cache write back after a barrier, took 268 / 273 kernels per step at batch 1 / 8 instead of 296 / 329, but
the partials kernel grew by what the rotary kernel had taken (batch 1: 4.9 against 3.5 µs per call), so kernel time
stayed 2.93-2.94 ms at batch 1 and moved 3.50 -> 3.45-3.48 at batch 8, inside the spread of the wall step. The form
here takes the step's key and value from registers instead, and measured the same (H100, A-B-A-B in one process,
thirty-sixth session): 0.00-0.02 ms less kernel time per step at batch 1 and 8, the partials kernel 1.8 µs per call
longer (`scripts/bench_rollout.py`'s ``default+rotary_in_attention`` engine)."""


ADD_IN_NEXT_NORM = True
"""Leave each layer's last residual add (its MLP output) to the next layer's input norm, which makes the sum in its
own launch (`normed_input`: with `FUSED_SHRINK`, `add_rms_norm_shrink`, as for the post-attention add; compiled,
inductor fuses it into the norm); the first layer adds zeros and the final norm adds the last pair. Same numbers
(one bf16 add wherever it runs; samples bit for bit the same on CPU, tests/test_fused_shrink.py) with one kernel per
layer fewer. Measured on the H200 (2026-12-04, one process per model, decode step alone, NVFP4 + LoRA r32 + AQN):
7B batch 1 2.75 against 2.84 ms, batch 8 3.35 against 3.34; 14B batch 8 6.17 against 6.18 ms (579 against 625
kernels, 6.06 against 6.11 ms of kernel time); bf16 + LoRA even. `scripts/bench_rollout.py`'s ``+add_in_layer``
engines turn it off."""


def lora_shrink(x: torch.Tensor, projections: Sequence[Projection]) -> list[list[torch.Tensor]]:
    """``x @ A.T`` for every LoRA term of ``projections`` (per projection, per term), in the adapters' dtype. Terms
    of one dtype are computed as one product over their concatenated A matrices: concatenating a few rank-r
    matrices costs less than the launches it saves at decode sizes."""
    terms = [(i, j, term) for i, p in enumerate(projections) for j, term in enumerate(p.lora)]
    out: list[list[torch.Tensor]] = [[None] * len(p.lora) for p in projections]  # type: ignore[list-item]
    if not terms:
        return out
    dtype = terms[0][2].lora_a.dtype
    if len(terms) > 1 and all(t.lora_a.dtype == dtype for _, _, t in terms):
        stacked = torch.cat([t.lora_a for _, _, t in terms])
        hidden = F.linear(x.to(dtype), stacked).split([t.lora_a.shape[0] for _, _, t in terms], dim=-1)
        for (i, j, _), h in zip(terms, hidden):
            out[i][j] = h
        return out
    for i, j, term in terms:
        out[i][j] = F.linear(x.to(term.lora_a.dtype), term.lora_a)
    return out


def project(
    x: torch.Tensor, projections: Sequence[Projection], hidden: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``base(x) + Σ scaling·B(A(x))`` for projections that read the same ``x[M, K]``; one output per projection
    in ``x``'s dtype. NVFP4 bases run as one grouped launch (with their LoRA terms, see `LORA_EPILOGUE`).
    ``hidden``: the shrinks ``x @ A.T`` side by side, made with ``x`` (`normed_input`, `activated_input`)."""
    if hidden is None and _lora_beside(x, projections):
        return _project_with_lora_beside(x, projections)
    if hidden is not None or _lora_in_epilogue(x, projections):
        return _project_with_lora_epilogue(x, projections, hidden)
    outputs = base_products(x, *_product_tensors(projections))
    if not any(p.lora for p in projections):
        return outputs
    if torch.compiler.is_compiling() and x.shape[0] <= LORA_REDUCTION_ROWS:
        return _add_lora_as_reductions(x, projections, outputs)
    if _lora_in_row_kernels(x, projections, outputs):
        return _add_lora_with_row_kernels(x, projections, outputs)
    shrunk = lora_shrink(x, projections)
    for index, (projection, hidden) in enumerate(zip(projections, shrunk)):
        if projection.lora:
            update = sum(F.linear(h, term.lora_b) * term.scaling for term, h in zip(projection.lora, hidden))
            outputs[index] = (outputs[index] + update).to(x.dtype)
    return outputs


def _row_kernels_take(rows: int) -> bool:
    """Whether steps of ``rows`` rows add LoRA through `lora_rows`' kernels (`LORA_ROW_KERNELS`), before the group's
    own checks. Shared by the step and its log line (`_lora_path_note`), so the two cannot disagree."""
    return LORA_ROW_KERNELS and LORA_REDUCTION_ROWS < rows <= LORA_ROW_KERNELS_MAX


def _beside_takes(rows: int) -> bool:
    """Whether steps of ``rows`` rows take the shrink beside the products (`LORA_SHRINK_BESIDE`, from
    `LORA_BESIDE_MIN_ROWS` rows), before the group's own checks; shared as `_row_kernels_take` is."""
    return LORA_SHRINK_BESIDE and LORA_ROW_KERNELS and LORA_BESIDE_MIN_ROWS <= rows <= LORA_ROW_KERNELS_MAX


def _lora_in_row_kernels(x: torch.Tensor, projections: Sequence[Projection], outputs: list[torch.Tensor]) -> bool:
    if not _row_kernels_take(x.shape[0]) or not runs_triton(x):
        return False
    with_lora = [(p, out) for p, out in zip(projections, outputs) if p.lora]
    if not all(len(p.lora) == 1 for p, _ in with_lora):
        return False
    terms = [p.lora[0] for p, _ in with_lora]
    bases = [out for _, out in with_lora]
    return lora_rows_applies(x, bases, [t.lora_a for t in terms], [t.lora_b for t in terms])


def _product_tensors(projections: Sequence[Projection]) -> tuple[list[torch.Tensor | None], ...]:
    """`lora_beside.base_products`' arguments after ``x``: packed, scale, global scale, weight, bias per projection."""
    return (
        [p.packed for p in projections], [p.scale for p in projections], [p.global_scale for p in projections],
        [p.weight for p in projections], [p.bias for p in projections],
    )  # fmt: skip


def _lora_beside(x: torch.Tensor, projections: Sequence[Projection]) -> bool:
    # Runs while dynamo traces the layer: plain loops and comparisons only (see `LORA_SHRINK_BESIDE`).
    if not _beside_takes(x.shape[0]) or not runs_triton(x):
        return False
    for p in projections:
        if len(p.lora) != 1 or (p.weight is not None and p.weight.dtype != x.dtype):
            return False
    return adapters_apply(
        x, [p.out_features for p in projections], [p.lora[0].lora_a for p in projections],
        [p.lora[0].lora_b for p in projections],
    )  # fmt: skip


def _project_with_lora_beside(x: torch.Tensor, projections: Sequence[Projection]) -> list[torch.Tensor]:
    terms = [p.lora[0] for p in projections]
    return products_lora_beside(
        x, *_product_tensors(projections), [t.lora_a for t in terms], [t.lora_b for t in terms],
        [t.scaling for t in terms],
    )  # fmt: skip


def _groups_without_beside(layer: LayerSpec) -> str:
    """The layer's projection groups with LoRA that `LORA_SHRINK_BESIDE` leaves on the serial path because some
    projection of the group has no adapter, by name ("" if none)."""
    groups = {"q/k/v": layer.qkv, "o": (layer.o,), "gate/up": layer.gate_up, "down": (layer.down,)}
    return ", ".join(
        name for name, group in groups.items() if any(p.lora for p in group) and not all(p.lora for p in group)
    )


_NOTED: set[str] = set()
"""`_lora_path_note` lines already logged: a rollout captures a decoder per batch and length, and says each once."""


def _lora_path_note(spec: DecoderSpec, batch: int, device: torch.device) -> str | None:
    """The line a decoder of ``batch`` rows logs where its LoRA terms keep a slower path than the shipped settings
    give: fp32 cuBLAS products instead of `lora_rows`' kernels above `LORA_REDUCTION_ROWS` rows, or shrinks after the
    products instead of beside them from `LORA_BESIDE_MIN_ROWS` rows; up to `LORA_ROW_KERNELS_MAX` rows, where both
    apply (None: no such path, or not at this batch)."""
    if device.type != "cuda" or not spec.layers or not _row_kernels_take(batch):
        return None
    reason = _lora_rows_refusal(spec)
    if reason is not None:
        return (f"decode steps of more than {LORA_REDUCTION_ROWS} rows add LoRA through fp32 cuBLAS products, not "
                f"lora_rows' kernels: {reason}")  # fmt: skip
    serial = _groups_without_beside(spec.layers[0])
    if _beside_takes(batch) and serial:
        return (f"LoRA shrinks of {serial} run after the products, not beside them: some projection of the group "
                "has no adapter.")  # fmt: skip
    return None


def _lora_rows_refusal(spec: DecoderSpec) -> str | None:
    """Why the first layer's LoRA terms would keep the cuBLAS path above `LORA_REDUCTION_ROWS` rows (None: they
    would not, or there are none)."""
    layer = spec.layers[0]
    for projection in (*layer.qkv, layer.o, *layer.gate_up, layer.down):
        if len(projection.lora) > 1:
            return f"{len(projection.lora)} active adapters on a projection (it takes one)"
        for term in projection.lora:
            if (reason := adapter_refusal(term.lora_a, term.lora_b)) is not None:
                return reason
    return None


def _add_lora_with_row_kernels(
    x: torch.Tensor, projections: Sequence[Projection], outputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    indices = [i for i, p in enumerate(projections) if p.lora]
    terms = [projections[i].lora[0] for i in indices]
    t = lora_shrink_rows(x, [term.lora_a for term in terms])
    summed = lora_expand_add([outputs[i] for i in indices], t, [term.lora_b for term in terms],
                             [term.scaling for term in terms])  # fmt: skip
    for index, out in zip(indices, summed):
        outputs[index] = out
    return outputs


def _lora_in_epilogue(x: torch.Tensor, projections: Sequence[Projection]) -> bool:
    if not LORA_EPILOGUE or x.shape[0] > LORA_REDUCTION_ROWS or not any(p.lora for p in projections):
        return False
    if len(projections) > 3 or not all(p.is_nvfp4 and len(p.lora) <= 1 for p in projections):
        return False
    terms = [term for p in projections for term in p.lora]
    ranks = {t.lora_b.shape[1] for t in terms}
    return (
        ranks <= set(LORA_RANKS)
        and len(ranks) == 1
        and all(t.lora_a.dtype == t.lora_b.dtype == torch.float32 for t in terms)
    )


def _project_with_lora_epilogue(
    x: torch.Tensor, projections: Sequence[Projection], hidden: torch.Tensor | None = None
) -> list[torch.Tensor]:
    # Without `hidden` the shrink (x @ A.T, fp32) is made here: compiled, a reduction of its own per input.
    terms = [p.lora[0] if p.lora else None for p in projections]
    if hidden is None:
        hidden = _shrinks(x, [t.lora_a for t in terms if t is not None])
    fused = kernels_for(x.device).grouped_lora(
        x, [p.packed for p in projections], [p.scale for p in projections], [p.global_scale for p in projections],
        [p.bias for p in projections], hidden, [t.lora_b if t is not None else None for t in terms],
        [t.scaling if t is not None else 0.0 for t in terms],
    )  # fmt: skip
    return list(fused.split([p.out_features for p in projections], dim=-1))


def _shrinks(x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``x @ A.T`` of the epilogue path's fp32 A matrices, side by side (eager: `fused_shrink`'s reference; with
    `PLAIN_SHRINK`, `fused_shrink.plain_shrink`)."""
    if PLAIN_SHRINK and x.shape[0] <= FUSED_SHRINK_ROWS and fused_shrink_applies(x, lora_a):
        return plain_shrink(x, lora_a)
    if not torch.compiler.is_compiling():
        return shrink_reference(x, lora_a)
    parts = [_shrink_as_reduction(x, a) for a in lora_a]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _epilogue_shrinks(x: torch.Tensor, projections: Sequence[Projection]) -> list[torch.Tensor] | None:
    """The A matrices of ``projections`` if their terms go to the NVFP4 epilogue and `fused_shrink` takes ``x``
    with them (else None: the input and the shrinks are made apart)."""
    if not FUSED_SHRINK or x.shape[0] > FUSED_SHRINK_ROWS or not _lora_in_epilogue(x, projections):
        return None
    if _lora_beside(x, projections):  # (the shrink goes beside the products instead)
        return None
    lora_a = [p.lora[0].lora_a for p in projections if p.lora]
    return lora_a if fused_shrink_applies(x, lora_a) else None


def normed_input(
    x: torch.Tensor, norm: NormSpec, projections: Sequence[Projection], residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(s, h, hidden)`` for ``x[M, K]``: ``s = x + residual`` (``x`` without one), ``h = rms_norm(s)``, and the
    shrinks of ``projections``' LoRA terms of ``h`` side by side where `FUSED_SHRINK` makes them with ``h`` in one
    launch (else None: `project` makes them)."""
    lora_a = _epilogue_shrinks(x, projections)
    if lora_a is not None and residual is not None:
        return add_rms_norm_shrink(x, residual, norm.weight, norm.eps, lora_a)
    if lora_a is not None:
        return (x, *rms_norm_shrink(x, norm.weight, norm.eps, lora_a))
    s = x + residual if residual is not None else x
    return s, rms_norm(s, norm), None


def activated_input(
    gate: torch.Tensor, up: torch.Tensor, projections: Sequence[Projection]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(silu(gate) * up, hidden)``: the down projection's input and, as in `normed_input`, its shrinks."""
    lora_a = _epilogue_shrinks(gate, projections)
    if lora_a is not None and up.stride(-1) == 1:
        return silu_mul_shrink(gate, up, lora_a)
    return F.silu(gate) * up, None


def _shrink_as_reduction(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """``x @ A.T`` in A's dtype written as broadcast-multiply-sum: compiled, a reduction inductor fuses with the
    kernel that makes ``x``."""
    return (x[:, None, :].to(lora_a.dtype) * lora_a[None]).sum(-1)


def _add_lora_as_reductions(x, projections, outputs):
    # At decode sizes a LoRA product is two tiny GEMVs, each a cuBLAS launch (plus a reduction launch for fp32).
    # Written as broadcast-multiply-sum, inductor fuses the shrink into one reduction kernel per input and the
    # expand into the kernel that adds it to the base output (rounding once): no LoRA launches of their own.
    for index, projection in enumerate(projections):
        if not projection.lora:
            continue
        update = 0
        for term in projection.lora:
            hidden = _shrink_as_reduction(x, term.lora_a)
            update = update + (hidden[:, None, :] * term.lora_b[None]).sum(-1) * term.scaling
        outputs[index] = (outputs[index] + update).to(x.dtype)
    return outputs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' ``apply_rotary_pos_emb`` for ``[batch, heads, tokens, head_dim]`` tensors."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
    cache_position: torch.Tensor | None = None, split_kv: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Grouped-query attention of ``q[B, H, T, D]`` over the cache ``[B, KVH, L, D]`` with an additive mask
    ``[B, 1, T, L]``. One decode token folds a key/value head's query heads into the query length, so the keys
    are read once per group and not repeated; with ``split_kv`` it runs `decode_attention.split_kv_attention`
    instead, which reads the cache only up to ``cache_position`` (callers check `split_kv_applies`)."""
    batch, heads, tokens, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if tokens == 1 and split_kv:
        return split_kv_attention(q, keys, values, mask, scaling, cache_position)
    if tokens == 1:
        out = F.scaled_dot_product_attention(
            q.reshape(batch, kv_heads, group, head_dim), keys, values, attn_mask=mask, scale=scaling
        )
        return out.reshape(batch, heads, 1, head_dim)
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)


def _rotary_in_attention(layer: LayerSpec, q, k, v, cos, sin, cache_k) -> bool:
    return ROTARY_IN_ATTENTION and layer.q_norm is None and rotary_in_attention_applies(q, k, v, cos, sin, cache_k)


def decoder_layer(
    spec: DecoderSpec,
    layer: LayerSpec,
    x: torch.Tensor,
    delta: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    cache_position: torch.Tensor,
    mask: torch.Tensor,
    split_kv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer on the input ``x`` (``[B, T, C]``), or ``x + delta``; writes this layer's keys/values at
    ``cache_position`` in place and returns the next layer's ``(x, delta)``: with `ADD_IN_NEXT_NORM` the residual
    stream after attention and the MLP's output, not yet added; else their sum and None.
    ``split_kv``: decode attention through `decode_attention.split_kv_attention` (one token per row)."""
    batch, tokens, width = x.shape
    rows = (batch * tokens, width)
    residual = delta.reshape(rows) if delta is not None else None
    x, h, hidden = normed_input(x.reshape(rows), layer.input_norm, layer.qkv, residual)
    q, k, v = project(h, layer.qkv, hidden)
    if split_kv and tokens == 1 and _rotary_in_attention(layer, q, k, v, cos, sin, cache_k):
        attended = split_kv_attention_rotary(q, k, v, cos, sin, cache_k, cache_v, mask, spec.scaling, cache_position)
    else:
        q = q.view(batch, tokens, -1, spec.head_dim)
        k = k.view(batch, tokens, -1, spec.head_dim)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache_k.index_copy_(2, cache_position, k)
        cache_v.index_copy_(2, cache_position, v.view(batch, tokens, -1, spec.head_dim).transpose(1, 2))
        attended = attention(q, cache_k, cache_v, mask, spec.scaling, cache_position, split_kv)
    attended = attended.transpose(1, 2).reshape(batch * tokens, -1)
    o = project(attended, (layer.o,))[0]
    x, h, hidden = normed_input(x, layer.post_attention_norm, layer.gate_up, o)
    gate, up = project(h, layer.gate_up, hidden)
    activated, hidden = activated_input(gate, up, (layer.down,))
    down = project(activated, (layer.down,), hidden)[0]
    if ADD_IN_NEXT_NORM:
        return x.view(batch, tokens, width), down.view(batch, tokens, width)
    return (x + down).view(batch, tokens, width), None


COMPILE_ENDS = True
"""With ``compile=True``, also compile what a decode step runs around its layers (`decode_inputs`, `decode_logits`;
`fast.StaticCacheGenerator` compiles its sampling alike). Eagerly, the H100 profile of 2026-12-06 had ~46 launches per
step outside the layers, ~20 of them these ends and the rest the sampling and its bookkeeping: ~0.12 ms of kernels at
batch 1, the vocabulary's log-softmax alone 33 µs in one program per row. Measured on an H100 (7B, NVFP4 + LoRA r32 + AQN, 2026-12-06, with `sampling.argmax_rows`):
324 / 357 kernels per step at batch 1 / 8 instead of 364 / 392, and 0.09-0.10 ms less kernel time; the wall step moved
by less than the spread between runs. ``False`` is kept for benchmarks (`scripts/bench_rollout.py`'s
``default+eager_ends``)."""

COMPILE_OPTIONS = {"emulate_precision_casts": True, "combo_kernels": True}
"""Inductor options of the compiled decode layer. ``emulate_precision_casts``: round where the eager code rounds (to
bf16 after each op), so that compiled and eager steps compute the same numbers up to summation order, and the
rollout's log-probs stay those of the trainer. ``combo_kernels``: independent kernels of a layer (the q, k and v
LoRA expands, ...) share one launch; measured on the H200 (7B, NVFP4 + LoRA + AQN): 611 -> 555 kernels per step,
4.74 -> 4.45 ms at batch 8, 4.17 -> 4.01 ms at batch 1 (notes/fused-decode.md)."""


def _compiled_layer():
    return torch.compile(decoder_layer, fullgraph=True, options=dict(COMPILE_OPTIONS))


def decode_inputs(spec: DecoderSpec, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple:
    """The first layer's ``(x, delta, cos, sin)``: the embeddings, zeros to add (`ADD_IN_NEXT_NORM`; None without) and
    the rotary embedding's cos and sin at ``position_ids``."""
    x = F.embedding(input_ids, spec.embed)
    # (zeros, not None, for the first layer: one compiled graph then serves every layer)
    delta = torch.zeros_like(x) if ADD_IN_NEXT_NORM else None
    cos, sin = spec.rotary(x, position_ids)
    return x, delta, cos, sin


def decode_logits(spec: DecoderSpec, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """Logits ``[B, V]`` of the last position from the last layer's ``(x, delta)``: the final norm and the LM head."""
    last = rms_norm(x[:, -1] if delta is None else x[:, -1] + delta[:, -1], spec.final_norm)
    return project(last, (spec.lm_head,))[0]


def log_compile_failure(log: logging.Logger, what: str, error: Exception) -> None:
    """One warning that compiling ``what`` failed (the error's first line) and that it runs eagerly from now on, and
    the error in full one level down (the line and the user frame dynamo stopped at)."""
    message = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    log.warning("compiling %s failed (%s: %s); running it eagerly", what, type(error).__name__, message)
    log.debug("the compile error in full (the line and the user frame dynamo stopped at)", exc_info=error)


def _compiled_ends() -> tuple:
    """`decode_inputs` and `decode_logits` compiled: eagerly they are ~20 launches of a few µs each per decode step
    (the rotary embedding's, the final norm's), compiled a few fused kernels around the LM head's product."""
    options = dict(COMPILE_OPTIONS)
    return (torch.compile(decode_inputs, fullgraph=True, options=options),
            torch.compile(decode_logits, fullgraph=True, options=options))  # fmt: skip


def _auto_takes_split_kv(device: torch.device) -> bool:
    """``decode_attention="auto"``: split-KV where it was measured to win (Hopper, compute capability 9.x)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _split_kv_runs(spec: DecoderSpec, batch: int, device: torch.device, asked: bool = True) -> bool:
    """Whether the split-KV kernel serves this decoder's decode steps; if not, one log line (SDPA then runs): a
    warning where it was ``asked`` for, information where ``"auto"`` chose it."""
    probe = torch.empty(batch, spec.num_heads, 1, spec.head_dim, dtype=spec.dtype, device="meta")
    keys = torch.empty(batch, spec.num_kv_heads, 1, spec.head_dim, dtype=spec.dtype, device="meta")
    mask = torch.empty(batch, 1, 1, 1, dtype=spec.dtype, device="meta")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not split_kv_applies(probe, keys, mask):
        reason = f"head_dim {spec.head_dim} / dtype {spec.dtype} is outside what it handles"
    elif not triton_available():
        reason = "Triton is not installed"
    elif device.type != "cuda" and not interpreted:
        reason = f"it needs CUDA (or Triton's interpreter), the cache is on {device.type}"
    else:
        return True
    logger.log(logging.WARNING if asked else logging.INFO,
               "decode_attention='split_kv' cannot run here (%s); decode attention uses SDPA.", reason)  # fmt: skip
    return False


class FusedDecoder:
    """Prefill and decode over a `DecoderSpec` with its own static KV cache.

    Args:
        spec: the model's tensors (`read_decoder`).
        batch / cache_len: cache shape; ``cache_len`` must not exceed the model's sliding window.
        device: where the cache lives.
        compile: run each decode layer through ``torch.compile`` (one graph for all layers; prefill stays eager),
            and with `COMPILE_ENDS` the decode step's `decode_inputs` and `decode_logits` too.
        decode_attention: ``"sdpa"`` (`F.scaled_dot_product_attention` over the whole cache), ``"split_kv"``
            (`decode_attention.split_kv_attention`: a Triton kernel split over the cache length that reads only
            the filled positions; CUDA, or Triton's interpreter on CPU) or ``"auto"`` (``"split_kv"`` on Hopper,
            ``"sdpa"`` elsewhere; see `DECODE_ATTENTION`). Where ``"split_kv"`` cannot run, one log line and SDPA.
    """

    def __init__(
        self, spec: DecoderSpec, batch: int, cache_len: int, device, compile: bool = False,
        decode_attention: str = "auto",
    ) -> None:  # fmt: skip
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"Unknown decode_attention={decode_attention!r}; use one of {DECODE_ATTENTION}.")
        if spec.sliding_window is not None and cache_len > spec.sliding_window:
            raise ValueError(
                f"cache length {cache_len} (prompt + max_new_tokens, rounded up) exceeds the model's sliding window "
                f"{spec.sliding_window}; the fused decode step attends to the whole cache. Shorten the rollouts or "
                "use rollout_backend='transformers' or 'vllm'."
            )
        self.spec, self.cache_len = spec, cache_len
        shape = (batch, spec.num_kv_heads, cache_len, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in spec.layers]
        self.values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in spec.layers]
        self.mask_dtype = spec.dtype
        device = torch.device(device)
        asked = decode_attention == "split_kv"
        wanted = asked or (decode_attention == "auto" and _auto_takes_split_kv(device))
        self.split_kv = wanted and _split_kv_runs(spec, batch, device, asked=asked)
        self._decode_layer = _compiled_layer() if compile else decoder_layer
        self._decode_ends = _compiled_ends() if compile and COMPILE_ENDS else (decode_inputs, decode_logits)
        note = _lora_path_note(spec, batch, device)
        if note is not None and note not in _NOTED:
            _NOTED.add(note)
            logger.info(note)

    def reset(self) -> None:
        for tensor in (*self.keys, *self.values):
            tensor.zero_()

    def first_rows(self, batch: int) -> FusedDecoder:
        """A decoder over the first ``batch`` rows of this one's KV cache (views: no copy, no new memory), sharing
        its compiled layer. Rows that are still decoding are moved there (`gather_rows`) so that a smaller step
        carries on without the finished ones."""
        if not 1 <= batch <= self.keys[0].shape[0]:
            raise ValueError(f"first_rows({batch}) of a decoder of {self.keys[0].shape[0]} rows")
        smaller = copy.copy(self)
        smaller.keys = [tensor[:batch] for tensor in self.keys]
        smaller.values = [tensor[:batch] for tensor in self.values]
        return smaller

    def gather_rows(self, index: torch.Tensor) -> None:
        """Move the cache rows ``index`` (a device tensor; repeats allowed) to rows ``0..len(index)-1``, in order."""
        rows = index.numel()
        for tensor in (*self.keys, *self.values):
            tensor[:rows] = tensor.index_select(0, index)  # index_select copies first: overlaps and repeats are safe

    @torch.no_grad()
    def prefill(self, input_ids, mask, position_ids, cache_position) -> torch.Tensor:
        """Logits ``[B, V]`` of the prompt's last position; fills the cache at ``cache_position``, the prompt's
        positions from the cache's start (``arange(T)`` for ``T`` prompt tokens). Attention reads only those ``T``
        positions (the mask hides the rest anyway), so its cost and its temporary copies of grouped keys and values
        do not grow with the rollout's length."""
        end = input_ids.shape[1]
        keys = [tensor[:, :, :end] for tensor in self.keys]  # views: index_copy_ writes through them into the cache
        values = [tensor[:, :, :end] for tensor in self.values]
        return self._forward(decoder_layer, input_ids, mask[..., :end], position_ids, cache_position, keys=keys,
                             values=values)  # fmt: skip

    @torch.no_grad()
    def decode(self, tokens, positions, cache_position, mask) -> torch.Tensor:
        """Logits ``[B, V]`` for one new token per row (``tokens[B]`` at ``positions[B]``); capturable.

        If compiling fails (the first call compiles, outside any graph capture), one warning, then eager layers."""
        args = (tokens[:, None], mask, positions[:, None], cache_position, self.split_kv)
        if self.compiled:
            try:
                return self._forward(self._decode_layer, *args, ends=self._decode_ends)
            except Exception as error:  # noqa: BLE001 - a compiler problem must not stop rollouts
                log_compile_failure(logger, "the fused decode step", error)
                self._decode_layer, self._decode_ends = decoder_layer, (decode_inputs, decode_logits)
        return self._forward(decoder_layer, *args)

    @property
    def compiled(self) -> bool:
        """Whether decode steps run compiled (``compile=True``, and compiling has not failed)."""
        return self._decode_layer is not decoder_layer or self._decode_ends[0] is not decode_inputs

    def _forward(self, layer_fn, input_ids, mask, position_ids, cache_position, split_kv=False, keys=None,
                 values=None, ends=(decode_inputs, decode_logits)) -> torch.Tensor:  # fmt: skip
        inputs_fn, logits_fn = ends
        x, delta, cos, sin = inputs_fn(self.spec, input_ids, position_ids)
        for layer, cache_k, cache_v in zip(self.spec.layers, keys or self.keys, values or self.values):
            x, delta = layer_fn(self.spec, layer, x, delta, cos, sin, cache_k, cache_v, cache_position, mask, split_kv)
        return logits_fn(self.spec, x, delta)
