"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise on the RMSNorm weights that feed q/k/v and gate/up.

Adding channel noise ``Z ~ N(0, σ²)`` to the norm weight ``w`` in front of a quantised projection turns into
multiplicative row noise on that projection's weights at no parameter cost (the paper's "noise sharing").
The noise is resampled, never accumulated: `NormNoise` keeps the clean weights and copies them back bit for bit.

Schedule: the reference code's arithmetic (NVlabs/QeRL ``trl_trainer/noise_scheduler.py``), not the paper's
printed eq. 8: training steps are cut into K stages with a float interval (``int(step // (total / K))``); stage 0
adds no noise (quantisation noise alone); stage k >= 1 uses ``σ_start·(σ_end/σ_start)^((k-1)/(K-2))`` for the
exponential decay (the exponent runs over K-2, so stage K-1 reaches σ_end). For K=2 and for ``constant`` there
is no decay: every noisy stage uses ``sigma_start``.

Precision: the noisy norm weight is formed in fp32 (an fp32 master plus fp32 noise, see `trl_qerl.norms`) and the
norm's output is rounded to the activation dtype once. In bf16 a weight near 1.0 cannot hold a perturbation below
~4e-3, so noise added to a bf16 weight would vanish for most of the schedule.

`AQNCallback` drives it from any transformers `Trainer`: σ comes from ``state.global_step / state.max_steps``,
so a resumed run continues the schedule. By default the noise is applied to rollout generation only (the
reference behaviour); the trainer opens `NormNoise.rollout` around generation. With ``apply_to_training=True``
the callback also keeps noise on during the loss forward and removes it before the optimizer step.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import TrainerCallback

from .norms import active_module, rms_norms, use_fp32_weight


logger = logging.getLogger(__name__)


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
        finite = math.isfinite(self.sigma_start) and math.isfinite(self.sigma_end)
        if self.schedule != "off" and not (finite and self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError(
                f"AQN sigmas must be positive finite numbers, got start={self.sigma_start}, end={self.sigma_end}."
            )

    def stage(self, step: int, total_steps: int) -> int:
        """Stage of ``step`` when ``total_steps`` are cut into ``num_stages`` equal stages.

        The reference code's arithmetic (NVlabs/QeRL ``noise_scheduler.py``): ``int(step // (total_steps / K))``
        with a float interval, so stages are as even as the step count allows. With fewer steps than stages some
        stages are skipped (5 steps, K=10: stages 0, 2, 4, 6, 8), and σ_end is reached only if a step lands in
        stage K-1.
        """
        if total_steps <= 0:
            raise ValueError(f"AQN needs the total number of training steps, got {total_steps}.")
        return min(int(step // (total_steps / self.num_stages)), self.num_stages - 1)

    def sigma_at_stage(self, stage: int) -> float:
        """σ of ``stage``: 0 for stage 0; for stages 1..K-1 the decay from ``sigma_start`` (stage 1) to
        ``sigma_end`` (stage K-1), its progress ``(stage-1)/(K-2)`` as in the reference code."""
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

    def describe(self) -> str:
        """What the schedule does, in words (model cards, logs)."""
        if self.schedule == "off":
            return "off"
        stages = (f"{self.num_stages} equal stages over training (the reference code's float interval); stage 0 is "
                  "noise-free")  # fmt: skip
        if self.schedule == "constant" or self.num_stages == 2:
            return f"sigma {self.sigma_start:g} in every noisy stage, no decay ({self.schedule}, {stages})"
        return (f"{self.schedule} decay of sigma from {self.sigma_start:g} (stage 1) to {self.sigma_end:g} (stage "
                f"{self.num_stages - 1}), {stages}")  # fmt: skip

    def sigma(self, step: int, total_steps: int) -> float:
        return self.sigma_at_stage(self.stage(step, total_steps))


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
        seed: base seed; the noise of call ``i`` at step ``s`` depends only on ``(seed, rank, s, i)``.
        rank: the data-parallel rank. Each rank draws its own noise: AQN is noise per rollout, and the ranks
            roll out different prompts (identical draws on every rank would correlate their exploration).

    The norms are resolved once, here: create it after wrapping the model with PEFT. Their weights are kept in
    fp32 from here on (`trl_qerl.norms.use_fp32_weight`), so that the noise survives a bf16 model: noise is drawn
    and added in fp32 and the norm's output is rounded to the activation dtype once. Clean copies and noise live
    in persistent flat buffers per (device, dtype), so a perturb/restore cycle is a few fused kernels whatever the
    number of layers.
    """

    def __init__(
        self, model: nn.Module, targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0, rank: int = 0
    ) -> None:
        self.model = model
        self.modules = find_noise_norms(model, (targets,) if isinstance(targets, str) else targets)
        self.seed = seed
        self.rank = rank
        self.step = 0
        self.sigma = 0.0
        self._draws = 0
        self._perturbed = False
        for module in self.modules.values():
            use_fp32_weight(active_module(module))
        self._weights = [active_module(module).weight for module in self.modules.values()]
        self._realised: torch.Tensor | None = None
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
        squares, count = [], 0
        for group in groups:
            torch._foreach_copy_(group.weights, group.clean)
            if seed is not None:
                group.noise.normal_(generator=self._generator(group.noise.device).manual_seed(seed))
                torch._foreach_add_(group.weights, group.noise_views, alpha=sigma)
                squares += [n.float().square().sum().to(groups[0].noise.device) for n in group.realised_change()]
                count += group.noise.numel()
        self._realised = torch.stack(squares).sum().div(count).sqrt() if squares else None

    def realised_sigma(self) -> float:
        """RMS of the change the last `perturb` made to the weights as stored (0 without noise). It equals σ up to
        sampling error when the weights can hold the noise; a bf16 weight would show how much rounded away."""
        return 0.0 if self._realised is None else float(self._realised)

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
        # rank 0 keeps the key of single-process runs from before ranks were seeded apart (same draws as then)
        key = (
            f"{self.seed}:{self.step}:{self._draws}"
            if self.rank == 0
            else f"{self.seed}:{self.rank}:{self.step}:{self._draws}"
        )
        return zlib.crc32(key.encode())


class _Buffers:
    """Clean copies and a noise buffer, flat, for weights sharing a device and dtype."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        sizes = [w.numel() for w in weights]
        flat_clean = torch.empty(sum(sizes), device=weights[0].device, dtype=weights[0].dtype)
        self.noise = torch.empty_like(flat_clean)
        self.clean = [c.view_as(w) for c, w in zip(flat_clean.split(sizes), weights)]
        self.noise_views = [n.view_as(w) for n, w in zip(self.noise.split(sizes), weights)]

    def realised_change(self) -> list[torch.Tensor]:
        """Weight minus clean copy, per weight (the noise as the weights hold it)."""
        return torch._foreach_sub(self.weights, self.clean)


class AQNCallback(TrainerCallback):
    """Schedules AQN from any transformers `Trainer`; logs ``aqn/sigma`` (scheduled), ``aqn/realised_sigma`` (the
    RMS change of the norm weights in the last draw) and ``aqn/stage``.

    Args:
        schedule: the σ schedule.
        targets: leaf names of the norms to perturb.
        seed: noise seed (default: the Trainer's seed); each data-parallel rank draws its own noise from it.
        apply_to_training: also perturb during the loss forward (removed before each optimizer step); by default
            only rollout generation sees noise, opened by the trainer through ``callback.noise.rollout()``.

    On its own (with a stock `trl.GRPOTrainer`, without ``apply_to_training``) the callback schedules σ but cannot
    reach rollout generation, and warns once. `QeRLGRPOTrainer` opens the noise around every rollout; elsewhere, do
    the same in a subclass::

        class NoisyGRPOTrainer(GRPOTrainer):
            def _generate_single_turn(self, *args, **kwargs):
                with aqn.noise.rollout():
                    return super()._generate_single_turn(*args, **kwargs)
    """

    def __init__(
        self,
        schedule: NoiseSchedule | None = None,
        targets: Sequence[str] = DEFAULT_TARGETS,
        seed: int | None = None,
        apply_to_training: bool = False,
    ) -> None:
        self.schedule = schedule or NoiseSchedule()
        self.targets = (targets,) if isinstance(targets, str) else tuple(targets)  # a bare name is one target
        self.seed = seed
        self.apply_to_training = apply_to_training
        self.noise: NormNoise | None = None
        self.sigma = 0.0
        self.stage = 0
        self.drives_rollouts = False
        """Set by a trainer that opens ``noise.rollout()`` around generation (`QeRLGRPOTrainer` does)."""

    def attach(self, model: nn.Module, seed: int = 0, rank: int = 0) -> NormNoise:
        """Find the norms of ``model`` (done at train start; call it yourself to use the noise earlier)."""
        self.noise = NormNoise(model, self.targets, seed=self.seed if self.seed is not None else seed, rank=rank)
        return self.noise

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.noise is None or self.noise.model is not model:
            self.attach(model, seed=args.seed, rank=args.process_index)
        if self.schedule.schedule != "off" and 0 < state.max_steps < self.schedule.num_stages:
            visited = sorted({self.schedule.stage(step, state.max_steps) for step in range(state.max_steps)})
            logger.warning(
                "AQN has %d stages but training has only %d steps: stages %s run, the others are skipped%s.",
                self.schedule.num_stages, state.max_steps, visited,
                "" if visited[-1] == self.schedule.num_stages - 1 else " and sigma_end is never reached",
            )  # fmt: skip
        if not (self.drives_rollouts or self.apply_to_training) and self.schedule.schedule != "off":
            logger.warning(
                "AQNCallback schedules sigma but nothing opens its noise around rollout generation, so this run "
                "trains without AQN. Use QeRLGRPOTrainer, open `callback.noise.rollout()` around generation (see "
                "the AQNCallback docstring), or pass apply_to_training=True."
            )
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
        realised = self.noise.realised_sigma() if self.noise is not None else 0.0
        extra = {"aqn/sigma": self.sigma, "aqn/realised_sigma": realised, "aqn/stage": self.stage}
        logs.update(extra)  # seen by the callbacks after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)  # the Trainer copied `logs` into its history before calling us

    def _update(self, state) -> None:
        self.stage = self.schedule.stage(state.global_step, state.max_steps)
        self.sigma = self.schedule.sigma_at_stage(self.stage)
        if self.noise is not None:
            self.noise.set_step(state.global_step, self.sigma)
