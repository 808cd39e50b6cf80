"""`QeRLConfig`: TRL's `GRPOConfig` plus quantisation, AQN and rollout settings. `QeRLModelConfig`: TRL's
`ModelConfig` with QeRL's LoRA defaults.

LoRA settings come the TRL way: from `ModelConfig` on the command line (``--lora_r``, ``--lora_alpha``, ...; see
`apply_model_config`), from ``peft_config=`` in Python. So a TRL script's parser works unchanged::

    parser = TrlParser((ScriptArguments, QeRLConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    apply_model_config(training_args, model_args)

Every TRL field still works. Defaults that differ from TRL's, following the paper and its scripts:

* ``learning_rate``: 1e-5 (TRL: 1e-6); quantised models train well at about 10x the 16-bit LoRA rate;
* ``epsilon_high``: 0.28 (DAPO's clip-higher; TRL: same as ``epsilon``);
* ``loss_type`` "dapo" and ``beta`` 0 are TRL's defaults already.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, ModelConfig

from .noise import DEFAULT_TARGETS, SCHEDULES, NoiseSchedule


QUANTIZATIONS = ("nvfp4", "bf16", "nf4", "none")
ROLLOUT_BACKENDS = ("auto", "transformers", "fast", "vllm")
CUDA_PAD_TO_MULTIPLE_OF = 64
"""`pad_to_multiple_of="auto"` on CUDA. Measured on the H200 (4 layers at 7B widths, 8 rows, 2026-12-02): the first
forward + backward at each new padded length takes 2.1-3.1 s, nearly all of it in cuDNN attention's plan building
(`aten::_cudnn_attention_forward` / `_backward`: 0.83 + 1.39 s of host time), against ~0.14 s once built. A multiple
of 64 bounds the lengths a run sees to 16 per 1,024 completion tokens and adds at most 63 padded tokens a row."""
# QeRL's LoRA defaults (paper's main tables: rank 32, no dropout, the seven decoder projections; alpha 2 * r).
LORA_DEFAULTS = {"lora_r": 32, "lora_alpha": None, "lora_dropout": 0.0, "lora_target_modules": None}


@dataclass
class QeRLConfig(GRPOConfig):
    r"""
    Configuration class for the [`QeRLGRPOTrainer`]: GRPO/DAPO ([`~trl.GRPOConfig`]) on NVFP4 base weights + LoRA +
    Adaptive Quantization Noise (AQN). Only the parameters specific to QeRL are listed here; see
    [`~trl.GRPOConfig`] for the others.

    LoRA's rank, alpha, dropout and target modules are TRL's: [`~trl.ModelConfig`] on the command line
    ([`QeRLModelConfig`] holds QeRL's defaults; [`apply_model_config`] hands them to the trainer), or
    `peft_config=nvfp4_lora_config(...)` in Python. Without either, the trainer uses rank 32, alpha 64, no
    dropout, on the seven decoder projections.

    Using [`~transformers.HfArgumentParser`] we can turn this class into
    [argparse](https://docs.python.org/3/library/argparse#module-argparse) arguments that can be specified on the
    command line.

    Parameters:
        > Parameters whose defaults differ from TRL's

        learning_rate (`float`, *optional*, defaults to `1e-5`):
            Initial AdamW learning rate. Quantised models train well at about 10x the 16-bit LoRA rate (paper: 1e-5
            to 3e-5; TRL's default: 1e-6).
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clipping bound of the importance ratio (DAPO's clip-higher, 0.28 in DAPO and QeRL; TRL's default:
            same as `epsilon`).
        pad_to_multiple_of (`int` or `str`, *optional*, defaults to `"auto"`):
            Pad prompt and completion ids to a multiple of this length. `"auto"`: 64 on CUDA, where SDPA's cuDNN
            attention builds a plan for every new sequence length (~2 s per forward + backward of a 7B model, paid
            at nearly every step without padding); TRL's choice elsewhere (128 on Neuron, no padding on CPU).

        > Parameters that control the model

        quantization (`str`, *optional*, defaults to `"nvfp4"`):
            Base weights: `"nvfp4"` (QeRL: NVFP4 base + LoRA), `"bf16"` (16-bit LoRA baseline), `"nf4"` (QLoRA
            baseline through bitsandbytes, CUDA only) or `"none"` (full fine-tuning, no LoRA).
        nvfp4_modules_to_not_convert (`list[str]`, *optional*):
            Extra Linear layers to keep in 16-bit when quantising: names, suffixes or `"re:"` regular expressions.
            The output embedding always stays in 16-bit.

        > Parameters that control LoRA (ignored with `quantization="none"`)

        train_norms (`bool`, *optional*, defaults to `True`):
            Also train `input_layernorm` and `post_attention_layernorm` (PEFT `modules_to_save`), as QeRL's
            reference scripts do; AQN noise goes on top of the trained weights.

        > Parameters that control AQN

        aqn_schedule (`str`, *optional*, defaults to `"exponential"`):
            How σ decays from `aqn_sigma_start` to `aqn_sigma_end` over stages 1..K-1 (stage 0 adds no noise):
            `"exponential"` (paper eq. 8), `"linear"`, `"cosine"`, `"logarithmic"`, `"constant"`, or `"off"` to
            disable AQN.
        aqn_sigma_start (`float`, *optional*, defaults to `1e-2`):
            σ of stage 1 (paper's scripts: 1e-2; its main experiments: 5e-2).
        aqn_sigma_end (`float`, *optional*, defaults to `1e-4`):
            σ of the last stage (paper's scripts: 1e-4; its main experiments: 5e-4).
        aqn_num_stages (`int`, *optional*, defaults to `10`):
            Number K of AQN stages over training: stage = `int(step // (max_steps / K))`, the reference code's float
            interval; stage 0 is noise-free.
        aqn_targets (`list[str]`, *optional*, defaults to `["input_layernorm", "post_attention_layernorm"]`):
            Leaf names of the RMSNorms that receive AQN noise: those feeding q/k/v and gate/up.
        aqn_apply_to_training (`bool`, *optional*, defaults to `False`):
            Keep AQN noise on during the loss forward too. By default it is on during rollout generation only, as in
            the reference implementation.

        > Parameters that control rollouts

        rollout_importance_sampling (`bool`, *optional*, defaults to `False`):
            Correct the loss for rollouts sampled under AQN noise (and the rollout engine's numerics) with TRL's
            importance sampling, on the vLLM and fast backends. Off as in the reference QeRL: the correction would
            partly undo the exploration AQN adds. Sets TRL's `vllm_importance_sampling_correction`; TRL's
            `vllm_importance_sampling_mode` and clip bounds apply.
        rollout_backend (`str`, *optional*, defaults to `"auto"`):
            Generation backend: `"auto"` (vLLM when `use_vllm=True`, else the fast CUDA-graph backend on CUDA, else
            transformers' `generate`), `"transformers"`, `"fast"` or `"vllm"` (same as `use_vllm=True`).
        fast_rollout_engine (`str`, *optional*, defaults to `"auto"`):
            Decode step of the fast backend: `"auto"` (the fused step over the model's tensors for Llama, Mistral,
            Qwen2 and Qwen3, else the model's forward, logged), `"fused"` (an error for other models) or `"model"`
            (the model's forward on a static KV cache).
        fast_rollout_compile (`bool`, *optional*):
            Compile the fused decode step with `torch.compile` (default: on CUDA): its layer, what runs around the
            layers (embedding, rotary, final norm) and the sampling. Costs a few seconds once per run; a compile
            failure falls back to eager with a warning.
        fast_rollout_twiddled_decode (`bool`, *optional*):
            Hold the NVFP4 codes in a kernel-friendly order while the fast backend's decode steps run (permuted in
            place for the decode loop, restored after it; 3-5 % of a 7B decode step at 1-32 rows on the H200, 5-6 %
            at 64 rows on an H100). Default: on for bf16 NVFP4 models on CUDA with the fused step, up to 128 rows per
            step; `False` turns it off, `True` also asks for it in fp16 (where it saves nothing). Where a product
            cannot read that order, one warning, then the standard order.
        vllm_checkpoint_dir (`str`, *optional*):
            vLLM backend (colocate): the base checkpoint vLLM loads. A directory holding one (e.g. from `trl-qerl
            quantize`, the model you train) is used as is; an empty one receives the base exported from the training
            model. If `None`, a temporary directory.
        vllm_adapter_dir (`str`, *optional*):
            vLLM backend (colocate): where per-step adapters are written. If `None`, tmpfs (`/dev/shm`) when
            available.
        vllm_max_lora_rank (`int`, *optional*):
            vLLM backend (colocate): vLLM's `max_lora_rank` (1, 8, 16, 32, 64, 128, 256, 320 or 512). If `None`, the
            smallest one at least the LoRA rank.
        vllm_enforce_eager (`bool`, *optional*, defaults to `False`):
            vLLM backend (colocate): disable CUDA graphs in vLLM (slower; saves memory and start-up time).
        vllm_engine_kwargs (`dict[str, Any]` or `str`, *optional*):
            vLLM backend (colocate): extra keyword arguments for `vllm.LLM`, e.g. `{"max_num_batched_tokens": 8192}`;
            a JSON string on the command line, parsed as TRL parses `model_init_kwargs`. TRL's `vllm_mode`,
            `vllm_gpu_memory_utilization`, `vllm_enable_sleep_mode`, `vllm_max_model_length`, `vllm_server_*` and
            `vllm_importance_sampling_*` fields apply too.

        > Deprecated parameters

        lora_r:

            <Deprecated version="0.1.0">

            Parameters `lora_r`, `lora_alpha`, `lora_dropout` and `lora_target_modules` of `QeRLConfig` are deprecated
            and will be removed in version 0.2.0. On the command line they are [`~trl.ModelConfig`]'s (`--lora_r`,
            ...), unchanged; in Python, pass `peft_config=nvfp4_lora_config(r=..., lora_alpha=..., lora_dropout=...,
            target_modules=...)` to the trainer, or a `ModelConfig` to [`apply_model_config`].

            </Deprecated>

        lora_alpha:

            <Deprecated version="0.1.0">

            See `lora_r`.

            </Deprecated>

        lora_dropout:

            <Deprecated version="0.1.0">

            See `lora_r`.

            </Deprecated>

        lora_target_modules:

            <Deprecated version="0.1.0">

            See `lora_r`.

            </Deprecated>

    > [!NOTE]
    > These parameters have default values different from [`~trl.GRPOConfig`]:
    > - `learning_rate`: Defaults to `1e-5` instead of `1e-6`.
    > - `epsilon_high`: Defaults to `0.28` instead of `None` (= `epsilon`).
    > - `bf16`: Defaults to `False` on a machine without an accelerator, where transformers refuses bf16.
    > - `pad_to_multiple_of`: `"auto"` pads to a multiple of 64 on CUDA too, not only on Neuron.
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["vllm_engine_kwargs"]

    # Parameters whose defaults differ from TRL's
    learning_rate: float = field(
        default=1e-5,
        metadata={
            "help": "Initial AdamW learning rate. QeRL default 1e-5: quantised models train well at ~10x the "
            "16-bit LoRA rate (paper: 1e-5 to 3e-5)."
        },  # fmt: skip
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={"help": "Upper clipping bound (DAPO's clip-higher, 0.28 in DAPO and QeRL)."},
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this length. 'auto': 64 on CUDA (SDPA's cuDNN "
            "kernels build a plan per sequence length, ~2 s for a 7B forward + backward, which without padding "
            "nearly every step pays), TRL's choice elsewhere (128 on Neuron, none on CPU)."
        },  # fmt: skip
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

    # Parameters that control LoRA (rank, alpha, dropout and targets are TRL's ModelConfig fields)
    train_norms: bool = field(
        default=True,
        metadata={
            "help": "Also train input_layernorm and post_attention_layernorm (as QeRL's reference scripts do); "
            "AQN noise goes on top of the trained weights."
        },  # fmt: skip
    )

    # Parameters that control AQN
    aqn_schedule: str = field(
        default="exponential",
        metadata={
            "help": "AQN decay from sigma_start to sigma_end over stages 1..K-1 (stage 0 is noise-free); "
            "'off' disables AQN.",
            "choices": list(SCHEDULES),
        },  # fmt: skip
    )
    aqn_sigma_start: float = field(default=1e-2, metadata={"help": "AQN sigma of stage 1 (paper scripts: 1e-2)."})
    aqn_sigma_end: float = field(default=1e-4, metadata={"help": "AQN sigma of the last stage (paper scripts: 1e-4)."})
    aqn_num_stages: int = field(
        default=10,
        metadata={
            "help": "Number K of AQN stages over training (10): stage = int(step // (max_steps / K)), the "
            "reference code's float interval; stage 0 is noise-free."
        },  # fmt: skip
    )
    aqn_targets: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        metadata={"help": "Leaf names of the RMSNorms that receive AQN noise (those feeding q/k/v and gate/up)."},
    )
    aqn_apply_to_training: bool = field(
        default=False,
        metadata={
            "help": "Keep AQN noise on during the loss forward too (default: rollout generation only, as the "
            "reference implementation)."
        },  # fmt: skip
    )

    # Parameters that control rollouts
    rollout_importance_sampling: bool = field(
        default=False,
        metadata={
            "help": "Correct the loss for rollouts sampled under AQN noise (and the rollout engine's numerics) "
            "with TRL's importance sampling (pi_clean / pi_rollout, reweighted or masked per "
            "vllm_importance_sampling_mode and its clip bounds), on the vLLM and fast backends. Default False, "
            "as in the reference QeRL: rollouts sampled with noise are trained on as on-policy, since the "
            "correction would partly undo the exploration AQN adds. Replaces TRL's "
            "vllm_importance_sampling_correction, which only acts on vLLM."
        },  # fmt: skip
    )
    rollout_backend: str = field(
        default="auto",
        metadata={
            "help": "Generation backend: 'auto' (vLLM when use_vllm, else the fast CUDA-graph backend on CUDA, else "
            "transformers generate), 'transformers', 'fast', or 'vllm'.",
            "choices": list(ROLLOUT_BACKENDS),
        },
    )

    fast_rollout_engine: str = field(
        default="auto",
        metadata={
            "help": "Decode step of the fast backend: 'auto' (the fused step over the model's tensors for Llama, "
            "Mistral, Qwen2 and Qwen3, else the model's forward, logged), 'fused' (an error for other models) or "
            "'model' (the model's forward on a static KV cache).",
            "choices": ["auto", "fused", "model"],
        },
    )
    fast_rollout_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile the fused decode step with torch.compile (default: on CUDA): its layer, the embedding, "
            "rotary, final norm and sampling around it. Costs a few seconds once per run; a compile failure falls "
            "back to eager with a warning."
        },
    )
    fast_rollout_twiddled_decode: bool | None = field(
        default=None,
        metadata={
            "help": "Hold the NVFP4 codes in a kernel-friendly order while the fast backend's decode steps run "
            "(permuted in place for the decode loop, restored after it; 3-5% of a 7B decode step at 1-32 rows on the "
            "H200, 5-6% at 64 rows on an H100). Default: on for bf16 NVFP4 models on CUDA with the fused step, up to "
            "128 rows per step; False turns it off, True also asks for it in fp16 (where it saves nothing)."
        },
    )

    vllm_checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "help": "vLLM backend (colocate): the base checkpoint vLLM loads. A directory holding one (e.g. "
            "from `trl-qerl quantize`, the model you train) is used as is; an empty one receives the base "
            "exported from the training model; default: a temporary directory."
        },  # fmt: skip
    )
    vllm_adapter_dir: str | None = field(
        default=None,
        metadata={
            "help": "vLLM backend (colocate): where per-step adapters are written; default: tmpfs "
            "(/dev/shm) when available."
        },  # fmt: skip
    )
    vllm_max_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "vLLM backend (colocate): vLLM's max_lora_rank (1, 8, 16, 32, 64, 128, 256, 320, 512); "
            "default: the smallest one >= the LoRA rank."
        },  # fmt: skip
    )
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "vLLM backend (colocate): disable CUDA graphs in vLLM (slower; saves memory and start-up time)."
        },  # fmt: skip
    )
    vllm_engine_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "vLLM backend (colocate): extra keyword arguments for vllm.LLM, as a JSON string on the "
            "command line, e.g. '{\"max_num_batched_tokens\": 8192}'."
        },  # fmt: skip
    )

    # Deprecated parameters: init-only (not dataclass fields), so that a parser over QeRLConfig and TRL's
    # ModelConfig has one --lora_r. __post_init__ stores them as attributes the trainer reads.
    lora_r: InitVar[int | None] = None
    lora_alpha: InitVar[int | None] = None
    lora_dropout: InitVar[float | None] = None
    lora_target_modules: InitVar[str | list[str] | None] = None

    def __post_init__(
        self,
        lora_r: int | None,
        lora_alpha: int | None,
        lora_dropout: float | None,
        lora_target_modules: str | list[str] | None,
    ) -> None:
        given = zip(LORA_DEFAULTS, (lora_r, lora_alpha, lora_dropout, lora_target_modules), strict=True)
        passed = {name: value for name, value in given if value is not None}
        if passed:
            warnings.warn(
                f"QeRLConfig({', '.join(f'{k}={v!r}' for k, v in passed.items())}): LoRA settings in QeRLConfig are "
                "deprecated and will be removed in trl-qerl 0.2.0. Pass them the TRL way: "
                "`QeRLGRPOTrainer(..., peft_config=nvfp4_lora_config(r=..., lora_alpha=..., lora_dropout=..., "
                "target_modules=...))` in Python; on the command line `--lora_r`, `--lora_alpha`, ... are TRL's "
                "ModelConfig options and work unchanged.",
                FutureWarning,
                stacklevel=3,
            )
        for name, default in LORA_DEFAULTS.items():
            setattr(self, name, passed.get(name, default))
        if isinstance(self.aqn_targets, str):  # a YAML scalar or a bare name: one target, never its characters
            self.aqn_targets = [self.aqn_targets]
        if self.aqn_schedule is False or self.aqn_schedule == "false":  # YAML 1.1 reads a bare `off` as False
            self.aqn_schedule = "off"
        # one switch for every backend: TRL's own flag follows ours (TRL reads it on its vLLM path only)
        self.vllm_importance_sampling_correction = bool(self.rollout_importance_sampling)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}.")
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {self.rollout_backend!r}.")
        from .rollout.fast import ENGINES  # the generator's own list (imported late: rollout imports TRL's trainer)

        if self.fast_rollout_engine not in ENGINES:
            raise ValueError(f"fast_rollout_engine must be one of {ENGINES}, got {self.fast_rollout_engine!r}.")
        if self.use_vllm and self.rollout_backend not in ("auto", "vllm"):
            raise ValueError(f"use_vllm=True asks for vLLM rollouts but rollout_backend={self.rollout_backend!r}.")
        if self.rollout_backend == "vllm" or self.use_vllm:
            self.rollout_backend, self.use_vllm = "vllm", True
            if self.quantization in ("nf4", "none"):
                raise ValueError(
                    f"The vLLM backend serves NVFP4 or 16-bit bases with LoRA; quantization={self.quantization!r} "
                    "cannot use it. Use quantization='nvfp4' or 'bf16', or rollout_backend='auto'."
                )
        _check_lora(self.quantization, self.lora_r, self.lora_alpha, self.lora_dropout)
        if self.max_steps == 0:
            raise ValueError("max_steps=0 would train nothing; set max_steps > 0, or -1 to train num_train_epochs.")
        self.aqn_noise_schedule()  # validates the AQN fields
        if self.bf16 is None and not self.fp16 and not _has_accelerator():
            # TRL turns bf16 on by default, which transformers refuses on a CPU-only machine: train in fp32 there
            self.bf16 = False
        if self.pad_to_multiple_of == "auto" and torch.cuda.is_available() and not self.use_cpu:
            self.pad_to_multiple_of = CUDA_PAD_TO_MULTIPLE_OF
        super().__post_init__()  # parses the JSON strings of _VALID_DICT_FIELDS, as for TRL's model_init_kwargs
        if isinstance(self.vllm_engine_kwargs, str):
            raise ValueError(
                "vllm_engine_kwargs must be a JSON object, e.g. '{\"max_num_batched_tokens\": 8192}'; got "
                f"{self.vllm_engine_kwargs!r}."
            )

    def aqn_noise_schedule(self) -> NoiseSchedule:
        return NoiseSchedule(self.aqn_sigma_start, self.aqn_sigma_end, self.aqn_num_stages, self.aqn_schedule)


@dataclass
class QeRLModelConfig(ModelConfig):
    r"""
    TRL's [`~trl.ModelConfig`] with QeRL's defaults: what `trl-qerl train` parses next to [`QeRLConfig`]. Only the
    parameters whose defaults differ are listed; see [`~trl.ModelConfig`] for the others. [`apply_model_config`]
    hands the values to the trainer.

    Parameters:
        dtype (`str`, *optional*):
            Load the model under this dtype: `"auto"`, `"bfloat16"`, `"float16"` or `"float32"`. If `None` (TRL's
            default: `"float32"`), the dtype follows `bf16`/`fp16`: bfloat16 on GPUs, float32 on CPU.
        use_peft (`bool`, *optional*, defaults to `True`):
            QeRL always trains LoRA, except with `quantization="none"` (full fine-tuning); this field is not read.
        lora_r (`int`, *optional*, defaults to `32`):
            LoRA rank (the paper's main tables: 32; its scripts: 16).
        lora_alpha (`int`, *optional*):
            LoRA alpha. If `None`, `2 * lora_r`.
        lora_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the LoRA input (paper: 0).
        lora_target_modules (`str` or `list[str]`, *optional*):
            Leaf names of the layers to adapt. If `None`, the seven decoder projections (q/k/v/o/gate/up/down);
            `"all-linear"` adapts every Linear-like layer but the output embedding.
    """

    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Load the model under this dtype; default: follow --bf16/--fp16 (bfloat16 on GPUs, float32 "
            "on CPU).",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },  # fmt: skip
    )
    use_peft: bool = field(
        default=True,
        metadata={"help": "Not read: QeRL always trains LoRA, except with --quantization none (full fine-tuning)."},
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (paper's main tables: 32; its scripts: 16)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha; default: 2 * lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input (paper: 0)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Leaf names of the layers to adapt; default: q/k/v/o/gate/up/down projections. "
            "'all-linear' adapts every Linear-like layer but the output embedding."
        },  # fmt: skip
    )


# ModelConfig options the QeRL trainer does not implement: their neutral value and what to use instead.
_UNSUPPORTED_MODEL_OPTIONS = {
    "use_dora": (False, "DoRA is not implemented on NVFP4 layers"),
    "use_rslora": (False, "rsLoRA scaling is not passed to the QeRL trainer; scale lora_alpha instead"),
    "lora_target_parameters": (None, "LoRA on parameters (MoE experts) is not implemented on NVFP4 layers"),
    "lora_modules_to_save": (None, "use train_norms for the two RMSNorms QeRL trains"),
    "lora_task_type": ("CAUSAL_LM", "QeRL trains causal language models"),
    "load_in_4bit": (False, "use quantization='nf4' for the QLoRA baseline"),
    "load_in_8bit": (False, "use quantization 'nvfp4', 'bf16', 'nf4' or 'none'"),
}


def apply_model_config(args: QeRLConfig, model_args: ModelConfig) -> QeRLConfig:
    """Hands TRL's `ModelConfig` to `args`, as TRL's scripts do with ``get_peft_config(model_args)`` and
    ``model_init_kwargs``: LoRA's rank, alpha, dropout and targets become the trainer's, and the model revision,
    attention implementation and dtype go into ``args.model_init_kwargs`` (values already there win).

    ``use_peft`` is not read: QeRL trains LoRA unless ``quantization="none"``. Options the QeRL trainer does not
    implement (DoRA, rsLoRA, ``lora_target_parameters``, ``lora_modules_to_save``, ``load_in_4bit``/``8bit``) raise a
    `ValueError` naming the alternative. Returns ``args``.
    """
    unsupported = [
        f"{name}={getattr(model_args, name)!r} ({fix})"
        for name, (neutral, fix) in _UNSUPPORTED_MODEL_OPTIONS.items()
        if getattr(model_args, name, neutral) != neutral
    ]
    if unsupported:
        raise ValueError(f"QeRLGRPOTrainer does not support these ModelConfig options: {'; '.join(unsupported)}.")
    _check_lora(args.quantization, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout)
    for name in LORA_DEFAULTS:
        setattr(args, name, getattr(model_args, name))
    loading = {
        "revision": model_args.model_revision if model_args.model_revision != "main" else None,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    loading = {name: value for name, value in loading.items() if value is not None}
    if loading:
        args.model_init_kwargs = {**loading, **(args.model_init_kwargs or {})}
    return args


def _check_lora(quantization: str, lora_r: Any, lora_alpha: Any, lora_dropout: Any) -> None:
    """LoRA settings checked when the config is made, before any model is loaded."""
    if quantization == "none":
        return
    if not isinstance(lora_r, int) or isinstance(lora_r, bool) or lora_r <= 0:
        raise ValueError(f"lora_r must be a positive integer, got {lora_r!r}.")
    if lora_alpha is not None and (isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float))
                                   or lora_alpha <= 0):  # fmt: skip
        raise ValueError(f"lora_alpha must be a positive number (or None for 2 * lora_r), got {lora_alpha!r}.")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout is a probability in [0, 1), got {lora_dropout!r} (the paper uses 0).")


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
