"""Rollout (generation) backends for `QeRLGRPOTrainer`.

A backend turns tokenised prompts into completion token ids, with the signature of TRL's
``GRPOTrainer._generate_single_turn``. The trainer wraps every call in AQN noise and times it.

* ``transformers``: TRL's own ``model.generate`` path (dynamic cache, no compilation); works everywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

from trl import GRPOTrainer


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


def make_rollout_backend(name: str, trainer: GRPOTrainer) -> RolloutBackend:
    """The backend for ``QeRLConfig.rollout_backend``."""
    if name in ("auto", "transformers"):
        return TransformersRollout()
    raise ValueError(
        f"rollout_backend={name!r} is not available in this version of trl-qerl; use 'transformers' (or 'auto')."
    )
