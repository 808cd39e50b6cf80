"""Rollout (generation) backends for `QeRLGRPOTrainer`.

A backend turns tokenised prompts into completion token ids, with the signature of TRL's
``GRPOTrainer._generate_single_turn`` (`RolloutBackend`). The trainer wraps every call in AQN noise and times it.

* ``transformers`` (`generate.TransformersRollout`): TRL's own ``model.generate`` path; works everywhere.
* ``fast`` (`fast.FastRollout`): static KV cache + CUDA-graphed decode step; the default on CUDA.
* ``vllm`` (`vllm.VLLMRollout`): a vLLM engine on the quantised base, adapters hot-swapped, AQN in its norms; in
  this process (``vllm_mode="colocate"``) or behind ``trl-qerl vllm-serve`` (``"server"``).
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from .fast import FastRollout
from .generate import RolloutBackend, TransformersRollout


__all__ = ["FastRollout", "RolloutBackend", "TransformersRollout", "make_rollout_backend"]


def make_rollout_backend(name: str, trainer: GRPOTrainer) -> RolloutBackend:
    """The backend for ``QeRLConfig.rollout_backend``: "auto" picks "fast" on a single CUDA device (the config
    turns "auto" into "vllm" when ``use_vllm=True``)."""
    if name == "auto":
        single_cuda = trainer.accelerator.device.type == "cuda" and trainer.accelerator.num_processes == 1
        name = "fast" if single_cuda and torch.cuda.is_available() else "transformers"
    if name == "transformers":
        return TransformersRollout()
    if name == "fast":
        args = trainer.args
        return FastRollout(
            engine=getattr(args, "fast_rollout_engine", "auto"),
            compile=getattr(args, "fast_rollout_compile", None),
            twiddled_decode=getattr(args, "fast_rollout_twiddled_decode", None),
        )
    if name == "vllm":
        from .vllm import make_vllm_rollout

        return make_vllm_rollout(trainer)
    raise ValueError(f"Unknown rollout_backend={name!r}; use 'auto', 'fast', 'transformers' or 'vllm'.")
