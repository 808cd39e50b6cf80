"""The ``transformers`` rollout backend: TRL's own ``model.generate`` path, plus the entropy of what it samples.

Also the backend protocol every rollout backend implements, and the sampling settings shared with the fast backend.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from trl import GRPOTrainer

from .sampling import SamplingParams, sample_with_stats


class RolloutBackend(Protocol):
    """What `QeRLGRPOTrainer` needs from a generation backend."""

    name: str
    sampling_entropy: float | None
    """Mean entropy (nats) per completion token of the distribution the last `generate` sampled from (noisy
    weights, temperature and filters applied), or None if the backend does not know it."""

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
    """TRL's ``model.generate`` path, unchanged; a forward hook on the output embedding records the entropy of the
    distribution each step samples from (from the logits generate computes anyway)."""

    name = "transformers"

    def __init__(self) -> None:
        self.sampling_entropy: float | None = None

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        args = trainer.args
        params = sampling_params(args)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        steps: list[torch.Tensor] = []

        def record(module, inputs, logits):
            if logits.shape[0] == len(prompt_ids):  # the generation batch (not another forward)
                steps.append(sample_with_stats_entropy(logits[:, -1], params))

        head = model.get_output_embeddings()
        handle = head.register_forward_hook(record) if head is not None else None
        # TRL 1.16's _generate_single_turn takes its vLLM branch when `use_vllm` is set, which the trainer does for
        # importance sampling on the fast backend: this is TRL's transformers path, so say so while it runs.
        use_vllm, trainer.use_vllm = trainer.use_vllm, False
        try:
            completions, logprobs = GRPOTrainer._generate_single_turn(
                trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            trainer.use_vllm = use_vllm
            if handle is not None:
                handle.remove()
        self.sampling_entropy = _masked_mean_entropy(steps, [len(ids) for ids in completions])
        return completions, logprobs


def sampling_params(args) -> SamplingParams:
    """The trainer's generation settings as `SamplingParams` (transformers' meaning)."""
    return SamplingParams(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        min_p=args.min_p,
    )


def sample_with_stats_entropy(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        return sample_with_stats(logits, params)[2].float().cpu()


def _masked_mean_entropy(steps: list[torch.Tensor], lengths: list[int]) -> float | None:
    """Mean over completion tokens of per-step, per-row entropies (rows stop counting after their EOS)."""
    if not steps or not sum(lengths):
        return None
    table = torch.stack(steps, dim=1)  # rows x steps
    counted = torch.arange(table.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return float(table[counted].mean())
