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


def sampling_params(args):
    from .fast import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        min_p=args.min_p,
    )


def sample_with_stats_entropy(logits: torch.Tensor, params) -> torch.Tensor:
    from .fast import sample_with_stats

    with torch.no_grad():
        return sample_with_stats(logits, params)[2].float().cpu()


def _masked_mean_entropy(steps: list[torch.Tensor], lengths: list[int]) -> float | None:
    """Mean over completion tokens of per-step, per-row entropies (rows stop counting after their EOS)."""
    if not steps or not sum(lengths):
        return None
    table = torch.stack(steps, dim=1)  # rows x steps
    counted = torch.arange(table.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return float(table[counted].mean())


class FastRollout:
    """Static-cache, CUDA-graph decoding (`StaticCacheGenerator`), falling back to TRL's generate (logged) for
    options it does not support or if capture fails."""

    name = "fast"

    def __init__(self, cuda_graph: bool | None = None) -> None:
        self.cuda_graph = cuda_graph
        self.generator = None
        self.fallback = TransformersRollout()
        self.disabled_reason: str | None = None
        self.sampling_entropy: float | None = None

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        from .fast import StaticCacheGenerator

        reason = self.disabled_reason or _unsupported(trainer, images)
        if reason:
            if reason != self.disabled_reason:
                logger.warning("fast rollouts unavailable (%s); using transformers generate", reason)
                self.disabled_reason = reason
            return self._fall_back(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        params = sampling_params(trainer.args)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        try:
            if self.generator is None or self.generator.model is not model:
                self.generator = StaticCacheGenerator(model, cuda_graph=self.cuda_graph)
            samples = self.generator.sample(prompt_ids, params, trainer.eos_token_ids, trainer._tokenizer.pad_token_id)
        except Exception as error:  # noqa: BLE001 - capture problems must not stop training
            self.disabled_reason = f"{type(error).__name__}: {error}"
            logger.warning("fast rollouts failed (%s); falling back to transformers generate", self.disabled_reason)
            return self._fall_back(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        values = [value for row in samples.entropies for value in row]
        self.sampling_entropy = sum(values) / len(values) if values else None
        return samples.completion_ids, samples.logprobs

    def _fall_back(self, trainer, *args):
        completions, logprobs = self.fallback.generate(trainer, *args)
        self.sampling_entropy = self.fallback.sampling_entropy
        if logprobs is None and trainer.use_vllm:
            # importance sampling is on: TRL reads NaN sampling log-probs as "not scored" (ratio 1, no correction)
            logprobs = [[float("nan")] * len(ids) for ids in completions]
        return completions, logprobs


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
