"""Data-parallel replicas must stay identical: a check after every optimizer step.

Under DDP each rank trains its own copy of the LoRA matrices and trained norms; the all-reduced gradients and the
same optimizer keep the copies bit-identical. Anything that breaks this (a parameter DDP does not see, a rank that
skips a step, per-rank noise leaking into the weights) makes the ranks train different models while the logs look
normal. `ReplicaCheck` compares a fingerprint of every trainable tensor across ranks after each step (two float64
sums per tensor, one all-gather: negligible next to a GRPO step) and stops training at the first divergence, naming
the tensors that differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback


def trainable_fingerprint(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names of the trainable tensors and, per tensor, the float64 sum and sum of squares of its values."""
    names, sums = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            values = parameter.detach().double()
            names.append(name)
            sums.append(torch.stack((values.sum(), values.square().sum())))
    return names, torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)


def diverged_tensors(names: list[str], fingerprints: list[torch.Tensor]) -> list[str]:
    """The tensors whose fingerprint differs on some rank from rank 0's."""
    reference = fingerprints[0]
    differs = torch.zeros(len(names), dtype=torch.bool)
    for other in fingerprints[1:]:
        differs |= (other.cpu() != reference.cpu()).any(dim=1)
    return [name for name, bad in zip(names, differs.tolist()) if bad]


def shards_parameters(args) -> bool:
    """FSDP and DeepSpeed ZeRO-3 give each rank a different shard of the parameters by design: nothing to compare."""
    if getattr(args, "fsdp", None):
        return True
    deepspeed = getattr(args, "hf_deepspeed_config", None)
    return bool(deepspeed is not None and deepspeed.is_zero3())


class ReplicaCheck(TrainerCallback):
    """Raise if the data-parallel ranks' trainable weights differ after an optimizer step (see the module doc).
    Under FSDP or ZeRO-3, where ranks hold different shards by design, it does nothing."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if args is not None and shards_parameters(args):
            return
        names, fingerprint = trainable_fingerprint(model)
        gathered = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, fingerprint.contiguous())
        diverged = diverged_tensors(names, gathered)
        if diverged:
            raise RuntimeError(
                f"After step {state.global_step} the data-parallel ranks hold different trainable weights in "
                f"{len(diverged)} tensor(s): {diverged[:4]}{' ...' if len(diverged) > 4 else ''}. They would train "
                "different models from here on; this is a bug (a parameter DDP does not synchronise, or a step one "
                "rank skipped). Please report it with the launch command."
            )
