"""`QeRLConfig`: TRL's `GRPOConfig` plus quantisation, LoRA, AQN and rollout settings.

Every TRL field still works. Defaults that differ from TRL's, following the paper and its scripts:

* ``learning_rate``: 1e-5 (TRL: 1e-6); quantised models train well at about 10x the 16-bit LoRA rate;
* ``epsilon_high``: 0.28 (DAPO's clip-higher; TRL: same as ``epsilon``);
* ``loss_type`` "dapo" and ``beta`` 0 are TRL's defaults already.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from .noise import DEFAULT_TARGETS, SCHEDULES, NoiseSchedule


QUANTIZATIONS = ("nvfp4", "bf16", "nf4", "none")
ROLLOUT_BACKENDS = ("auto", "transformers", "fast", "vllm")


@dataclass
class QeRLConfig(GRPOConfig):
    r"""
    Configuration for `QeRLGRPOTrainer`: GRPO/DAPO (`trl.GRPOConfig`) on NVFP4 base weights + LoRA + Adaptive
    Quantization Noise.

    Parameters that control the model:
        quantization (`str`, defaults to `"nvfp4"`): base weights: `"nvfp4"` (QeRL), `"bf16"` (16-bit LoRA
            baseline), `"nf4"` (QLoRA baseline, bitsandbytes, CUDA only), `"none"` (full fine-tuning).
        nvfp4_modules_to_not_convert (`list[str]`, *optional*): extra Linear layers kept in 16-bit.

    Parameters that control LoRA (ignored with `quantization="none"`):
        lora_r (`int`, defaults to `32`), lora_alpha (`int`, defaults to `2 * lora_r`), lora_dropout (`float`, defaults
        to `0.0`), lora_target_modules (`list[str]`, *optional*: the seven decoder projections), train_norms (`bool`,
        defaults to `True`).

    Parameters that control AQN:
        aqn_schedule (`str`, defaults to `"exponential"`), aqn_sigma_start (`float`, defaults to `1e-2`),
        aqn_sigma_end (`float`, defaults to `1e-4`), aqn_num_stages (`int`, defaults to `10`), aqn_targets
        (`list[str]`), aqn_apply_to_training (`bool`, defaults to `False`).

    Parameters that control rollouts:
        rollout_importance_sampling (`bool`, defaults to `False`): correct for rollouts sampled under AQN noise with
            TRL's importance sampling (vLLM and fast backends); off as in the reference QeRL. Sets TRL's
            ``vllm_importance_sampling_correction``.
        rollout_backend (`str`, defaults to `"auto"`; `use_vllm=True` selects `"vllm"`), vllm_checkpoint_dir,
        vllm_adapter_dir, vllm_max_lora_rank, vllm_enforce_eager, vllm_engine_kwargs (see the fields' help). TRL's
        ``vllm_mode``, ``vllm_gpu_memory_utilization``, ``vllm_enable_sleep_mode``, ``vllm_max_model_length``,
        ``vllm_server_*`` and ``vllm_importance_sampling_*`` fields apply too.
    """

    # Parameters whose defaults differ from TRL's
    learning_rate: float = field(
        default=1e-5,
        metadata={"help": "Initial AdamW learning rate. QeRL default 1e-5: quantised models train well at ~10x the "
                  "16-bit LoRA rate (paper: 1e-5 to 3e-5)."},  # fmt: skip
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={"help": "Upper clipping bound (DAPO's clip-higher, 0.28 in DAPO and QeRL)."},
    )

    # Parameters that control the model
    quantization: str = field(
        default="nvfp4",
        metadata={
            "help": "Base weights: 'nvfp4' (QeRL: NVFP4 base + LoRA), 'bf16' (16-bit LoRA baseline), 'nf4' (QLoRA "
            "baseline through bitsandbytes, CUDA only), 'none' (full fine-tuning).",
            "choices": list(QUANTIZATIONS),
        },
    )
    nvfp4_modules_to_not_convert: list[str] | None = field(
        default=None,
        metadata={"help": "Extra Linear layers to keep in 16-bit when quantising (names, suffixes or 're:' regex)."},
    )

    # Parameters that control LoRA
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (paper's main tables: 32)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha; defaults to 2 * lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input (paper: 0)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Leaf names of the layers to adapt; default: q/k/v/o/gate/up/down projections. "
                  "'all-linear' adapts every Linear-like layer but the output embedding."},  # fmt: skip
    )
    train_norms: bool = field(
        default=True,
        metadata={"help": "Also train input_layernorm and post_attention_layernorm (as QeRL's reference scripts do); "
                  "AQN noise goes on top of the trained weights."},  # fmt: skip
    )

    # Parameters that control AQN
    aqn_schedule: str = field(
        default="exponential",
        metadata={"help": "AQN decay from sigma_start to sigma_end over stages 1..K-1 (stage 0 is noise-free); "
                  "'off' disables AQN.", "choices": list(SCHEDULES)},  # fmt: skip
    )
    aqn_sigma_start: float = field(default=1e-2, metadata={"help": "AQN sigma of stage 1 (paper scripts: 1e-2)."})
    aqn_sigma_end: float = field(default=1e-4, metadata={"help": "AQN sigma of the last stage (paper scripts: 1e-4)."})
    aqn_num_stages: int = field(
        default=10,
        metadata={"help": "Number K of AQN stages over training (10): stage = int(step // (max_steps / K)), the "
                  "reference code's float interval; stage 0 is noise-free."},  # fmt: skip
    )
    aqn_targets: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        metadata={"help": "Leaf names of the RMSNorms that receive AQN noise (those feeding q/k/v and gate/up)."},
    )
    aqn_apply_to_training: bool = field(
        default=False,
        metadata={"help": "Keep AQN noise on during the loss forward too (default: rollout generation only, as the "
                  "reference implementation)."},  # fmt: skip
    )

    # Parameters that control rollouts
    rollout_importance_sampling: bool = field(
        default=False,
        metadata={"help": "Correct the loss for rollouts sampled under AQN noise (and the rollout engine's numerics) "
                  "with TRL's importance sampling (pi_clean / pi_rollout, reweighted or masked per "
                  "vllm_importance_sampling_mode and its clip bounds), on the vLLM and fast backends. Default False, "
                  "as in the reference QeRL: rollouts sampled with noise are trained on as on-policy, since the "
                  "correction would partly undo the exploration AQN adds. Replaces TRL's "
                  "vllm_importance_sampling_correction, which only acts on vLLM."},  # fmt: skip
    )
    rollout_backend: str = field(
        default="auto",
        metadata={
            "help": "Generation backend: 'auto' (vLLM when use_vllm, else the fast CUDA-graph backend on CUDA, else "
            "transformers generate), 'transformers', 'fast', or 'vllm'.",
            "choices": list(ROLLOUT_BACKENDS),
        },
    )

    vllm_checkpoint_dir: str | None = field(
        default=None,
        metadata={"help": "vLLM backend (colocate): the base checkpoint vLLM loads. A directory holding one (e.g. "
                  "from `trl-qerl quantize`, the model you train) is used as is; an empty one receives the base "
                  "exported from the training model; default: a temporary directory."},  # fmt: skip
    )
    vllm_adapter_dir: str | None = field(
        default=None,
        metadata={"help": "vLLM backend (colocate): where per-step adapters are written; default: tmpfs "
                  "(/dev/shm) when available."},  # fmt: skip
    )
    vllm_max_lora_rank: int | None = field(
        default=None,
        metadata={"help": "vLLM backend (colocate): vLLM's max_lora_rank (1, 8, 16, 32, 64, 128, 256, 320, 512); "
                  "default: the smallest one >= the LoRA rank."},  # fmt: skip
    )
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={"help": "vLLM backend (colocate): disable CUDA graphs in vLLM (slower; saves memory and start-up "
                  "time)."},  # fmt: skip
    )
    vllm_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "vLLM backend (colocate): extra keyword arguments for vllm.LLM (a JSON string on the "
                  "command line), e.g. '{\"max_num_batched_tokens\": 8192}'."},  # fmt: skip
    )

    def __post_init__(self) -> None:
        if self.aqn_schedule is False or self.aqn_schedule == "false":  # YAML 1.1 reads a bare `off` as False
            self.aqn_schedule = "off"
        # one switch for every backend: TRL's own flag follows ours (TRL reads it on its vLLM path only)
        self.vllm_importance_sampling_correction = bool(self.rollout_importance_sampling)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}.")
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {self.rollout_backend!r}.")
        if self.use_vllm and self.rollout_backend not in ("auto", "vllm"):
            raise ValueError(f"use_vllm=True asks for vLLM rollouts but rollout_backend={self.rollout_backend!r}.")
        if self.rollout_backend == "vllm" or self.use_vllm:
            self.rollout_backend, self.use_vllm = "vllm", True
            if self.quantization in ("nf4", "none"):
                raise ValueError(
                    f"The vLLM backend serves NVFP4 or 16-bit bases with LoRA; quantization={self.quantization!r} "
                    "cannot use it. Use quantization='nvfp4' or 'bf16', or rollout_backend='auto'."
                )
        if isinstance(self.vllm_engine_kwargs, str):
            self.vllm_engine_kwargs = json.loads(self.vllm_engine_kwargs)
        if self.quantization != "none" and (not isinstance(self.lora_r, int) or self.lora_r <= 0):
            raise ValueError(f"lora_r must be a positive integer, got {self.lora_r!r}.")
        if self.max_steps == 0:
            raise ValueError("max_steps=0 would train nothing; set max_steps > 0, or -1 to train num_train_epochs.")
        self.aqn_noise_schedule()  # validates the AQN fields
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            # TRL turns bf16 on by default, which transformers refuses on a CPU-only machine: train in fp32 there
            self.bf16 = False
        super().__post_init__()

    def aqn_noise_schedule(self) -> NoiseSchedule:
        return NoiseSchedule(self.aqn_sigma_start, self.aqn_sigma_end, self.aqn_num_stages, self.aqn_schedule)


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
