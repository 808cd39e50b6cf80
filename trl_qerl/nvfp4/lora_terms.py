"""LoRA terms on top of a grouped NVFP4 product, in pure torch: the reference of what the CUDA decode kernel adds in
its epilogue (`cuda_mma.LoraInputs`), and its fallback where another kernel computes the product."""

from __future__ import annotations

import torch
import torch.nn.functional as F


__all__ = ["add_lora_terms"]


def add_lora_terms(
    out: torch.Tensor,
    widths: list[int],
    hidden: torch.Tensor,
    lora_b: list[torch.Tensor | None],
    scaling: list[float],
) -> torch.Tensor:
    """``out`` (a grouped product ``[M, sum N_i]``, the weights' outputs side by side, ``widths`` = ``N_i``) with
    each weight's LoRA term added: ``round(out_i + scaling_i * hidden_i @ B_i.T)``, where ``hidden`` holds
    ``x @ A_i.T`` of the weights that have an adapter (``lora_b[i]`` not None), side by side in weight order. The
    update is formed in ``hidden``'s dtype (the adapters': fp32 for masters) and the sum rounded once to ``out``'s
    dtype, as the fused decode step's unfused LoRA path does."""
    results, col = [], 0
    for piece, b, s in zip(out.split(widths, dim=1), lora_b, scaling):
        if b is None:
            results.append(piece)
            continue
        update = F.linear(hidden[:, col : col + b.shape[1]], b) * s
        col += b.shape[1]
        results.append((piece + update).to(piece.dtype))
    return torch.cat(results, dim=1)
