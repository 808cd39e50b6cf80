"""Rollout (generation) backends for `QeRLGRPOTrainer`.

A backend turns tokenised prompts into completion token ids, with the signature of TRL's
``GRPOTrainer._generate_single_turn``. The trainer wraps every call in AQN noise and times it.

* ``transformers``: TRL's own ``model.generate`` path (dynamic cache, no compilation); works everywhere.
* ``fast``: static KV cache + CUDA-graphed decode step (`trl_qerl.rollout.fast`); the default on CUDA.
* ``vllm``: a vLLM engine on the quantised base, adapters hot-swapped, AQN in its norms (`trl_qerl.rollout.vllm`);
  in this process (``vllm_mode="colocate"``) or behind ``trl-qerl vllm-serve`` (``"server"``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from trl import GRPOTrainer


logger = logging.getLogger(__name__)
SUPPORTED_ATTENTION = ("sdpa", "eager")


class RolloutBackend(Protocol):
    """What `QeRLGRPOTrainer` needs from a generation backend."""

    name: str

    def generate(
        self,
        trainer: GRPOTrainer,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: dict,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Completion token ids (one list per prompt row, EOS included) and optional sampling log-probs."""
        ...


class TransformersRollout:
    """TRL's ``model.generate`` path, unchanged."""

    name = "transformers"

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return GRPOTrainer._generate_single_turn(
            trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )


class FastRollout:
    """Static-cache, CUDA-graph decoding (`StaticCacheGenerator`), falling back to TRL's generate (logged) for
    options it does not support or if capture fails."""

    name = "fast"

    def __init__(self, cuda_graph: bool | None = None) -> None:
        self.cuda_graph = cuda_graph
        self.generator = None
        self.fallback = TransformersRollout()
        self.disabled_reason: str | None = None

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        from .fast import SamplingParams, StaticCacheGenerator

        reason = self.disabled_reason or _unsupported(trainer, images)
        if reason:
            if reason != self.disabled_reason:
                logger.warning("fast rollouts unavailable (%s); using transformers generate", reason)
                self.disabled_reason = reason
            return self.fallback.generate(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        args = trainer.args
        params = SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p,
            min_p=args.min_p,
        )
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        try:
            if self.generator is None or self.generator.model is not model:
                self.generator = StaticCacheGenerator(model, cuda_graph=self.cuda_graph)
            completions = self.generator.generate(prompt_ids, params, trainer.eos_token_ids, trainer._tokenizer.pad_token_id)
        except Exception as error:  # noqa: BLE001 - capture problems must not stop training
            self.disabled_reason = f"{type(error).__name__}: {error}"
            logger.warning("fast rollouts failed (%s); falling back to transformers generate", self.disabled_reason)
            return self.fallback.generate(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        return completions, None


def _unsupported(trainer, images) -> str | None:
    args = trainer.args
    if images is not None and any(image is not None for image in images):
        return "multimodal prompts"
    if args.generation_kwargs:
        return f"generation_kwargs {sorted(args.generation_kwargs)}"
    if args.repetition_penalty != 1.0:
        return "repetition_penalty"
    if getattr(trainer, "tools", None):
        return "tool calling"
    attention = getattr(trainer.model.config, "_attn_implementation", None) or "sdpa"
    if attention not in SUPPORTED_ATTENTION:
        return f"attn_implementation={attention!r} (the static-cache step supports {list(SUPPORTED_ATTENTION)})"
    return None


def make_rollout_backend(name: str, trainer: GRPOTrainer) -> RolloutBackend:
    """The backend for ``QeRLConfig.rollout_backend``: "auto" picks "fast" on a single CUDA device (the config
    turns "auto" into "vllm" when ``use_vllm=True``)."""
    if name == "auto":
        single_cuda = trainer.accelerator.device.type == "cuda" and trainer.accelerator.num_processes == 1
        name = "fast" if single_cuda and torch.cuda.is_available() else "transformers"
    if name == "transformers":
        return TransformersRollout()
    if name == "fast":
        return FastRollout()
    if name == "vllm":
        from .vllm import make_vllm_rollout

        return make_vllm_rollout(trainer)
    raise ValueError(f"Unknown rollout_backend={name!r}; use 'auto', 'fast', 'transformers' or 'vllm'.")
