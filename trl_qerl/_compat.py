"""Every private TRL / transformers / PEFT method trl-qerl overrides or calls, in one place, checked at import.

Public hooks are preferred everywhere; these are the places where only a private one exists. Each entry names the
versions its signature was checked against. `check_private_hooks` compares the installed signatures with the
parameters we rely on and raises one `ImportError` listing every mismatch and what to do, instead of a
`TypeError` deep inside a training step. CI runs the tests on the newest versions pip resolves and on the lowest
ones pyproject.toml admits (`make test-lowest`).

Attributes read from TRL's trainer (``_metrics``, ``_tokenizer``, ``eos_token_ids``, ``reward_func_names``,
``use_vllm``, ``vllm_importance_sampling_correction``, ``vllm_generation``, ``_last_loaded_step``) are checked by
the end-to-end trainer tests rather than here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateHook:
    """One private method we override or call.

    Attributes:
        owner: ``module:Class`` that defines it.
        method: its name.
        parameters: the leading parameter names (after ``self``) our code passes or receives.
        used_by: where trl-qerl uses it, and how.
        checked: the versions it was checked against.
    """

    owner: str
    method: str
    parameters: tuple[str, ...]
    used_by: str
    checked: str


PRIVATE_HOOKS = (
    PrivateHook("trl:GRPOTrainer", "_generate_single_turn",
                ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
                "trainer.QeRLGRPOTrainer overrides it (rollout backends, AQN); rollout.TransformersRollout calls it",
                "trl 1.16"),
    PrivateHook("trl:GRPOTrainer", "_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list"),
                "trainer.QeRLGRPOTrainer overrides it (timing)", "trl 1.16"),
    PrivateHook("trl:GRPOTrainer", "_get_per_token_logps_and_entropies",
                ("model", "input_ids", "attention_mask", "logits_to_keep"),
                "trainer.QeRLGRPOTrainer overrides it (timing)", "trl 1.16"),
    PrivateHook("trl:GRPOTrainer", "_prepare_inputs", ("generation_batch",),
                "trainer.QeRLGRPOTrainer overrides it (timing: time/inputs_s)", "trl 1.16"),
    PrivateHook("trl:GRPOTrainer", "_generate_and_score_completions", ("inputs",),
                "trainer.QeRLGRPOTrainer overrides it (importance-sampling share)", "trl 1.16"),
    PrivateHook("transformers:Trainer", "_load_from_checkpoint", ("resume_from_checkpoint", "model"),
                "trainer.QeRLGRPOTrainer overrides it (fp32 masters after resume)", "transformers 5.17, 5.24"),
    PrivateHook("transformers.quantizers:HfQuantizer", "_process_model_before_weight_loading", ("model",),
                "quantizer.NVFP4A16HfQuantizer overrides it (module replacement)", "transformers 5.17, 5.24"),
    PrivateHook("transformers.quantizers:HfQuantizer", "_process_model_after_weight_loading", ("model",),
                "quantizer.NVFP4A16HfQuantizer overrides it", "transformers 5.17, 5.24"),
    PrivateHook("peft:LoraConfig", "_register_custom_module", ("mapping",),
                "lora.register_nvfp4_lora calls it (LoRA on NVFP4A16Linear in the activation dtype)", "peft 0.21.0, 0.21.2"),
)  # fmt: skip


def _resolve(owner: str):
    module, _, name = owner.partition(":")
    return getattr(importlib.import_module(module), name)


def signature_problems(hooks: tuple[PrivateHook, ...] | None = None) -> list[str]:
    """One line per hook (default: `PRIVATE_HOOKS`) whose installed signature no longer starts with the parameters
    we rely on."""
    problems = []
    for hook in PRIVATE_HOOKS if hooks is None else hooks:
        method = getattr(_resolve(hook.owner), hook.method, None)
        if method is None:
            problems.append(f"{hook.owner}.{hook.method} is gone ({hook.used_by}; checked against {hook.checked})")
            continue
        names = [p for p in inspect.signature(method).parameters if p != "self"]
        if tuple(names[: len(hook.parameters)]) != hook.parameters:
            problems.append(
                f"{hook.owner}.{hook.method}{tuple(names)} no longer takes {hook.parameters} ({hook.used_by}; "
                f"checked against {hook.checked})"
            )
    return problems


def check_private_hooks() -> None:
    """Raise an `ImportError` naming every private hook whose signature changed."""
    problems = signature_problems()
    if problems:
        raise ImportError(
            "trl-qerl relies on private methods whose signatures changed in the installed versions:\n  - "
            + "\n  - ".join(problems)
            + "\nInstall versions inside the ranges in trl-qerl's pyproject.toml, or upgrade trl-qerl."
        )
