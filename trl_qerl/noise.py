"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise on the RMSNorm weights that feed q/k/v and gate/up.

Adding channel noise ``Z ~ N(0, σ²)`` to the norm weight ``w`` in front of a quantised projection turns into
multiplicative row noise on that projection's weights at no parameter cost (the paper's "noise sharing").
The noise is resampled, never accumulated: `NormNoise` keeps the clean weights and copies them back bit for bit.

Schedule (paper eq. 8): training steps are cut into K equal stages; stage 0 adds no noise (quantisation noise
alone), stages 1..K-1 decay from ``sigma_start`` to ``sigma_end`` (exponential by default).

`AQNCallback` drives it from any transformers `Trainer`: σ comes from ``state.global_step / state.max_steps``,
so a resumed run continues the schedule. By default the noise is applied to rollout generation only (the
reference behaviour); the trainer opens `NormNoise.rollout` around generation. With ``apply_to_training=True``
the callback also keeps noise on during the loss forward and removes it before the optimizer step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import TrainerCallback


SCHEDULES = ("exponential", "linear", "cosine", "logarithmic", "constant", "off")
Schedule = Literal["exponential", "linear", "cosine", "logarithmic", "constant", "off"]
DEFAULT_TARGETS = ("input_layernorm", "post_attention_layernorm")
# Gemma-2/3 decoder layers normalise the MLP input with `pre_feedforward_layernorm`; their
# `post_attention_layernorm` normalises the attention *output* and feeds no projection.
_MLP_NORM_ALTERNATIVES = {"post_attention_layernorm": "pre_feedforward_layernorm"}


@dataclass(frozen=True)
class NoiseSchedule:
    """σ per training step for AQN.

    Args:
        sigma_start: σ of stage 1 (paper scripts: 1e-2; main experiments: 5e-2).
        sigma_end: σ of the last stage (1e-4 / 5e-4).
        num_stages: K, the number of equal stages (10); stage 0 is noise-free.
        schedule: decay from ``sigma_start`` to ``sigma_end`` over stages 1..K-1.
    """

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    schedule: Schedule = "exponential"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Unknown AQN schedule {self.schedule!r}; choose one of {SCHEDULES}.")
        if self.num_stages < 2:
            raise ValueError(f"AQN needs num_stages >= 2 (stage 0 is noise-free), got {self.num_stages}.")
        if self.schedule != "off" and not (self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError(f"AQN sigmas must be positive, got start={self.sigma_start}, end={self.sigma_end}.")

    def stage(self, step: int, total_steps: int) -> int:
        """Stage of ``step`` when ``total_steps`` are cut into ``num_stages`` equal stages."""
        if total_steps <= 0:
            raise ValueError(f"AQN needs the total number of training steps, got {total_steps}.")
        interval = max(1, total_steps // self.num_stages)
        return min(step // interval, self.num_stages - 1)

    def sigma_at_stage(self, stage: int) -> float:
        if self.schedule == "off" or stage <= 0:
            return 0.0
        if self.schedule == "constant":
            return self.sigma_start
        # progress through the noisy stages: 0 at stage 1, 1 at stage K-1 (a single noisy stage stays at start)
        t = (stage - 1) / (self.num_stages - 2) if self.num_stages > 2 else 0.0
        start, end = self.sigma_start, self.sigma_end
        if self.schedule == "exponential":
            return start * (end / start) ** t
        if self.schedule == "linear":
            return start + (end - start) * t
        if self.schedule == "cosine":
            return end + (start - end) * (1 + math.cos(math.pi * t)) / 2
        # logarithmic: fast early decay, log(1 + 9t) / log(10) runs from 0 to 1
        return start - (start - end) * math.log1p(9 * t) / math.log(10)

    def sigma(self, step: int, total_steps: int) -> float:
        return self.sigma_at_stage(self.stage(step, total_steps))


def _is_rms_norm_like(module: nn.Module) -> bool:
    """A module with a 1-D weight, an epsilon, and no bias: Llama/Qwen/Mistral/Gemma RMSNorms and look-alikes."""
    weight = getattr(module, "weight", None)
    has_eps = any(hasattr(module, attr) for attr in ("eps", "variance_epsilon", "epsilon"))
    return isinstance(weight, torch.Tensor) and weight.ndim == 1 and has_eps and getattr(module, "bias", None) is None


def active_module(module: nn.Module) -> nn.Module:
    """The module that runs: for a PEFT ``modules_to_save`` wrapper, its trained copy (noise goes on top of it)."""
    copies = getattr(module, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and not getattr(module, "disable_adapters", False):
        active = getattr(module, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) else active
        if active in copies:
            return copies[active]
    return getattr(module, "original_module", module)


def rms_norms(model: nn.Module) -> dict[str, nn.Module]:
    """Every RMSNorm-like module by qualified name; PEFT ``modules_to_save`` wrappers are kept whole (resolve the
    module that runs with `active_module`)."""
    found = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in ("original_module", "modules_to_save") or ".modules_to_save." in name:
            continue
        if _is_rms_norm_like(active_module(module)):
            found[name] = module
    return found


def find_noise_norms(model: nn.Module, targets: Sequence[str] = DEFAULT_TARGETS) -> dict[str, nn.Module]:
    """The RMSNorm-like modules that AQN perturbs, by qualified name (PEFT wrappers resolved at use time).

    A target name matches the last component of a module name. For decoder layers that have a
    ``pre_feedforward_layernorm`` (Gemma 2/3) that norm replaces ``post_attention_layernorm``. Raises a
    `ValueError` listing the norm-like modules found when no target matches.
    """
    candidates = rms_norms(model)
    found = {}
    for name, module in candidates.items():
        parent, _, leaf = name.rpartition(".")
        wanted = leaf in targets
        alternative = _MLP_NORM_ALTERNATIVES.get(leaf)
        if wanted and alternative and _has_child(model, parent, alternative):
            wanted = False  # this architecture feeds its MLP through the alternative norm
        if not wanted and leaf in _MLP_NORM_ALTERNATIVES.values():
            wanted = any(original in targets for original, alt in _MLP_NORM_ALTERNATIVES.items() if alt == leaf)
        if wanted:
            found[name] = module
    if not found:
        names = list(candidates)
        raise ValueError(
            f"AQN found none of the target norms {list(targets)} in {type(model).__name__}. RMSNorm-like modules "
            f"present: {names[:12]}{' ...' if len(names) > 12 else ''}. Pass `aqn_targets` with the names "
            "of the norms that feed the attention and MLP projections."
        )
    return found


def _has_child(model: nn.Module, parent: str, child: str) -> bool:
    try:
        return hasattr(model.get_submodule(parent) if parent else model, child)
    except AttributeError:
        return False


class NormNoise:
    """Perturbs and restores the AQN norms of a model; noise is seeded, resampled on every `perturb`.

    Args:
        model: a transformers model, possibly PEFT-wrapped (trained norms get the noise on top).
        targets: leaf names of the norms to perturb.
        seed: base seed; the noise of call ``i`` at step ``s`` depends only on ``(seed, s, i)``.

    The norms are resolved once, here: create it after wrapping the model with PEFT. Clean copies and noise live
    in persistent flat buffers per (device, dtype), so a perturb/restore cycle is a few fused kernels whatever the
    number of layers.
    """

    def __init__(self, model: nn.Module, targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> None:
        self.model = model
        self.modules = find_noise_norms(model, targets)
        self.seed = seed
        self.step = 0
        self.sigma = 0.0
        self._draws = 0
        self._perturbed = False
        self._weights = [active_module(module).weight for module in self.modules.values()]
        self._buffers: dict[tuple[torch.device, torch.dtype], _Buffers] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def _current_weights(self) -> list[torch.Tensor]:
        return list(self._weights)

    @property
    def is_perturbed(self) -> bool:
        return self._perturbed

    def clean_weight(self, name: str) -> torch.Tensor | None:
        """The clean (noise-free) weight of norm ``name`` while perturbed, else None."""
        if not self._perturbed:
            return None
        weight = self._weights[list(self.modules).index(name)]
        group = self._buffers[(weight.device, weight.dtype)]
        return group.clean[next(i for i, w in enumerate(group.weights) if w is weight)]

    def set_step(self, step: int, sigma: float) -> None:
        """Move to training step ``step`` with noise level ``sigma`` (restarts the per-step draw counter)."""
        self.step, self.sigma, self._draws = step, sigma, 0

    @torch.no_grad()
    def perturb(self, sigma: float | None = None) -> None:
        """Set every target weight to its clean value plus fresh N(0, σ²) noise (σ defaults to `self.sigma`)."""
        sigma = self.sigma if sigma is None else sigma
        groups = self._groups()
        if not self._perturbed:  # snapshot the clean weights (they change between rollouts when norms are trained)
            for group in groups:
                torch._foreach_copy_(group.clean, group.weights)
            self._perturbed = True
        seed = self._next_seed() if sigma > 0 else None
        for group in groups:
            torch._foreach_copy_(group.weights, group.clean)
            if seed is not None:
                group.noise.normal_(generator=self._generator(group.noise.device).manual_seed(seed))
                torch._foreach_add_(group.weights, group.noise_views, alpha=sigma)

    @torch.no_grad()
    def restore(self) -> None:
        """Copy the clean weights back (bit-exact); a no-op when not perturbed."""
        if self._perturbed:
            for group in self._groups():
                torch._foreach_copy_(group.weights, group.clean)
        self._perturbed = False

    @contextmanager
    def rollout(self, sigma: float | None = None) -> Iterator[None]:
        """Noise on for the duration of the block (one draw), restored afterwards unless it was on before."""
        was_perturbed = self.is_perturbed
        self.perturb(sigma)
        try:
            yield
        finally:
            if not was_perturbed:
                self.restore()

    def _groups(self) -> list[_Buffers]:
        """Buffers per (device, dtype) of the weights, (re)built when the weights moved or changed dtype."""
        wanted: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for weight in self._weights:
            wanted.setdefault((weight.device, weight.dtype), []).append(weight)
        if set(wanted) != set(self._buffers) or any(
            len(self._buffers[key].weights) != len(weights) for key, weights in wanted.items()
        ):
            if self._perturbed:
                raise RuntimeError("AQN norms changed device or dtype while perturbed; restore() first.")
            self._buffers = {key: _Buffers(weights) for key, weights in wanted.items()}
        return list(self._buffers.values())

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _next_seed(self) -> int:
        self._draws += 1
        return zlib.crc32(f"{self.seed}:{self.step}:{self._draws}".encode())


class _Buffers:
    """Clean copies and a noise buffer, flat, for weights sharing a device and dtype."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        sizes = [w.numel() for w in weights]
        flat_clean = torch.empty(sum(sizes), device=weights[0].device, dtype=weights[0].dtype)
        self.noise = torch.empty_like(flat_clean)
        self.clean = [c.view_as(w) for c, w in zip(flat_clean.split(sizes), weights)]
        self.noise_views = [n.view_as(w) for n, w in zip(self.noise.split(sizes), weights)]


class AQNCallback(TrainerCallback):
    """Schedules AQN from any transformers `Trainer`; logs ``aqn/sigma`` and ``aqn/stage``.

    Args:
        schedule: the σ schedule.
        targets: leaf names of the norms to perturb.
        seed: noise seed (default: the Trainer's seed).
        apply_to_training: also perturb during the loss forward (removed before each optimizer step); by default
            only rollout generation sees noise, opened by the trainer through ``callback.noise.rollout()``.
    """

    def __init__(
        self,
        schedule: NoiseSchedule | None = None,
        targets: Sequence[str] = DEFAULT_TARGETS,
        seed: int | None = None,
        apply_to_training: bool = False,
    ) -> None:
        self.schedule = schedule or NoiseSchedule()
        self.targets = tuple(targets)
        self.seed = seed
        self.apply_to_training = apply_to_training
        self.noise: NormNoise | None = None
        self.sigma = 0.0
        self.stage = 0

    def attach(self, model: nn.Module, seed: int = 0) -> NormNoise:
        """Find the norms of ``model`` (done at train start; call it yourself to use the noise earlier)."""
        self.noise = NormNoise(model, self.targets, seed=self.seed if self.seed is not None else seed)
        return self.noise

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.noise is None or self.noise.model is not model:
            self.attach(model, seed=args.seed)
        self._update(state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._update(state)
        if self.apply_to_training:
            self.noise.perturb()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.apply_to_training:
            self.noise.restore()

    def on_step_end(self, args, state, control, **kwargs):
        self.noise.restore()  # never let noise reach a checkpoint or an evaluation

    def on_train_end(self, args, state, control, **kwargs):
        if self.noise is not None:
            self.noise.restore()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        extra = {"aqn/sigma": self.sigma, "aqn/stage": self.stage}
        logs.update(extra)  # seen by the callbacks after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)  # the Trainer copied `logs` into its history before calling us

    def _update(self, state) -> None:
        self.stage = self.schedule.stage(state.global_step, state.max_steps)
        self.sigma = self.schedule.sigma_at_stage(self.stage)
        if self.noise is not None:
            self.noise.set_step(state.global_step, self.sigma)
