"""`QeRLGRPOTrainer`: TRL's GRPOTrainer on NVFP4 base weights + LoRA + Adaptive Quantization Noise.

The subclass overrides as little as possible:

* ``__init__`` loads or quantises the model (or a 16-bit / NF4 / full fine-tuning baseline), applies LoRA and
  installs `AQNCallback`, then hands everything to ``GRPOTrainer.__init__``;
* ``_generate_single_turn`` sends rollouts through a pluggable backend inside a fresh AQN noise draw, and times them;
* ``training_step`` / ``_prepare_inputs`` / ``_calculate_rewards`` / ``_get_per_token_logps_and_entropies`` only add
  timing and memory metrics around TRL's own code;
* ``create_model_card`` appends what a QeRL run needs to be reproduced.

The private TRL/transformers hooks it overrides are listed, with the versions they were checked against, in
`trl_qerl._compat`, which checks their signatures when this module is imported.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, PeftModel
from transformers import AutoTokenizer, PreTrainedModel, set_seed
from trl import GRPOTrainer

from ._compat import check_private_hooks
from .checkpoints import CheckpointMarker, check_base_fingerprint, last_complete_checkpoint, write_base_fingerprint
from .config import QeRLConfig
from .loading import load_policy
from .lora import get_peft_model, nvfp4_lora_config, register_nvfp4_lora
from .noise import AQNCallback
from .norms import keep_fp32_trainable_norms
from .nvfp4.linear import exclude_packed_tensors_from_ddp
from .replica_check import ReplicaCheck
from .rollout import make_rollout_backend


logger = logging.getLogger(__name__)
check_private_hooks()  # the private TRL/transformers/PEFT methods below are listed and checked in _compat.py

QERL_CITATION = """\
@article{huang2025qerl,
    title   = {{QeRL: Beyond Efficiency -- Quantization-enhanced Reinforcement Learning for LLMs}},
    author  = {Wei Huang and Yi Ge and Shuai Yang and Yicheng Xiao and Huizi Mao and Yujun Lin and Hanrong Ye and
               Sifei Liu and Ka Chun Cheung and Hongxu Yin and Yao Lu and Xiaojuan Qi and Song Han and Yukang Chen},
    journal = {arXiv preprint arXiv:2510.11696},
    year    = {2025}
}"""


def _reward_error(func: Callable, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"Reward function {getattr(func, '__name__', type(func).__name__)!r} raised {type(error).__name__}: {error}. Reward "
        "functions must score every completion, returning 0 (or None) for output they cannot parse."
    )


def _checked_reward_output(func, output, kwargs: dict):
    """A reward function must return one number (or None) per completion; say so instead of failing in TRL."""
    name = getattr(func, "__name__", type(func).__name__)
    expected = len(kwargs["completions"]) if "completions" in kwargs else None
    if isinstance(output, torch.Tensor):
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise TypeError(f"Reward function {name!r} returned {type(output).__name__}; it must return a list with one "
                        "float (or None) per completion.")  # fmt: skip
    if expected is not None and len(output) != expected:
        raise ValueError(f"Reward function {name!r} returned {len(output)} rewards for {expected} completions.")
    bad = next((value for value in output if value is not None and not isinstance(value, numbers.Real)), None)
    if bad is not None:
        raise TypeError(f"Reward function {name!r} returned {bad!r} ({type(bad).__name__}); rewards must be numbers "
                        "(or None for a completion it cannot score).")  # fmt: skip
    return output


def _is_async(func) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _guard_reward(func):
    """Re-raise a reward function's exception with its name and the fix. Async functions stay async (TRL awaits
    them on its event loop); reward models (`nn.Module`) and names of Hub models pass through unchanged."""
    if isinstance(func, (str, torch.nn.Module)) or not callable(func):
        return func
    if _is_async(func):

        @functools.wraps(func)
        async def guarded_async(*args, **kwargs):
            try:
                output = await func(*args, **kwargs)
            except Exception as error:
                raise _reward_error(func, error) from error
            return _checked_reward_output(func, output, kwargs)

        guarded = guarded_async
    else:

        @functools.wraps(func)
        def guarded(*args, **kwargs):
            try:
                output = func(*args, **kwargs)
            except Exception as error:
                raise _reward_error(func, error) from error
            return _checked_reward_output(func, output, kwargs)

    if not hasattr(func, "__name__"):  # a callable instance: keep the name TRL would log for it
        guarded.__name__ = type(func).__name__
    return guarded


class QeRLGRPOTrainer(GRPOTrainer):
    """GRPO/DAPO with QeRL: NVFP4 base weights, LoRA adapters, Adaptive Quantization Noise.

    Args:
        model: a Hub id or path (loaded through the NVFP4 quantizer, or as the ``args.quantization`` baseline), a
            16-bit model instance (quantised in place), an NVFP4 model, or a `PeftModel` on one.
        reward_funcs: as in `trl.GRPOTrainer` (see `trl_qerl.rewards`).
        args: a `QeRLConfig`.
        peft_config: a custom `LoraConfig`; by default one is built from ``args`` (`nvfp4_lora_config`).
        rollout_backend: a `RolloutBackend` instance overriding ``args.rollout_backend``.
        **kwargs: everything else `trl.GRPOTrainer` accepts (datasets, processing_class, callbacks, ...).
    """

    _tag_names = ["trl", "grpo", "qerl"]
    _name = "QeRL (GRPO)"
    # GRPO's paper and citation, with QeRL's citation added to it (the card cites both)
    _paper = {**GRPOTrainer._paper, "citation": GRPOTrainer._paper["citation"].rstrip() + "\n\n" + QERL_CITATION}

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel | PeftModel,
        reward_funcs: Callable | list[Callable] | str | list[str] | None = None,
        args: QeRLConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        peft_config: PeftConfig | None = None,
        rollout_backend=None,
        **kwargs: Any,
    ) -> None:
        model_id = str(model) if isinstance(model, (str, os.PathLike)) else None
        if args is None:
            args = QeRLConfig(f"{Path(model_id or 'model').name}-QeRL")
        if not isinstance(args, QeRLConfig):
            raise TypeError(
                f"QeRLGRPOTrainer needs a QeRLConfig (a GRPOConfig with QeRL fields), got {type(args).__name__}."
            )
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        _check_output_dir(args.output_dir)  # before any model work: a run must not fail at its final save
        set_seed(args.seed)  # LoRA initialisation happens here, before GRPOTrainer's own set_seed

        model = load_policy(model, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_id or model.config._name_or_path, padding_side="left"
            )
        model = self._apply_lora(model, args, peft_config)
        exclude_packed_tensors_from_ddp(model)
        self.aqn_callback = AQNCallback(
            args.aqn_noise_schedule(), args.aqn_targets, seed=args.seed, apply_to_training=args.aqn_apply_to_training
        )
        self._tag_names = [*type(self)._tag_names, args.quantization, args.loss_type]
        if isinstance(reward_funcs, list):
            reward_funcs = [_guard_reward(f) for f in reward_funcs]
        else:
            reward_funcs = _guard_reward(reward_funcs)
        self._timings: defaultdict[str, float] = defaultdict(float)
        self._step_start: float | None = None
        self._steps_without_rewards = 0

        # TRL's own vLLM path would start a second engine and merge LoRA into the 4-bit base: keep it off while
        # GRPOTrainer initialises, then turn `use_vllm` on so that its importance-sampling correction runs.
        # load_policy used `model_init_kwargs`; GRPOTrainer (TRL 1.16) would warn that they are ignored. Hidden only
        # when it has nothing else to load with them (a reward model given by name, a non-PEFT reference model).
        use_vllm, args.use_vllm = args.use_vllm, False
        model_init_kwargs = args.model_init_kwargs
        rewards = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if isinstance(model, PeftModel) and not any(isinstance(f, str) for f in rewards):
            args.model_init_kwargs = None
        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                **kwargs,
            )
        finally:
            args.use_vllm, args.model_init_kwargs = use_vllm, model_init_kwargs
        _refuse_sharded_parameters(self, self.aqn_callback.schedule)
        self.add_callback(CheckpointMarker())
        self.add_callback(ReplicaCheck())  # data-parallel ranks stay identical (a no-op on one process)
        # First in line, so that reporting callbacks see aqn/sigma in the logs it adds
        self.callback_handler.callbacks.insert(0, self.aqn_callback)
        self.aqn_callback.attach(self.model, seed=args.seed, rank=self.accelerator.process_index)
        self.aqn_callback.drives_rollouts = True  # _generate_single_turn opens the noise around every rollout
        self._keep_fp32_masters()
        self.rollout_backend = rollout_backend or make_rollout_backend(args.rollout_backend, self)
        if getattr(self.rollout_backend, "name", None) == "vllm":
            self.use_vllm, self.vllm_mode, self._last_loaded_step = True, args.vllm_mode, -1
            self.vllm_generation = self.rollout_backend  # what TRL's rollout_func and tool paths reach for
        self._configure_importance_sampling(args)

    def _configure_importance_sampling(self, args: QeRLConfig) -> None:
        """One meaning of ``rollout_importance_sampling`` on every backend (see `QeRLConfig`)."""
        self.vllm_importance_sampling_correction = args.rollout_importance_sampling
        backend = getattr(self.rollout_backend, "name", None)
        if not args.rollout_importance_sampling or backend == "vllm":
            return
        if backend != "fast":
            raise ValueError(
                f"rollout_importance_sampling=True needs the sampling log-probs, which the 'fast' and 'vllm' rollout "
                f"backends return; this run uses {backend!r}. Set rollout_backend='fast' (CUDA) or 'vllm', or turn "
                "rollout_importance_sampling off."
            )
        if getattr(self, "tools", None) or getattr(self, "rollout_func", None):
            raise ValueError(
                "rollout_importance_sampling=True with tools or a rollout_func runs on the vLLM backend only; set "
                "rollout_backend='vllm' or turn rollout_importance_sampling off."
            )
        # Private TRL contract (checked against 1.16): GRPOTrainer applies its importance-sampling correction only
        # when `use_vllm` is set. The fast backend returns the same processed log-probs vLLM does; the transformers
        # fallback clears the flag while it runs TRL's own generate path.
        self.use_vllm = True

    def _keep_fp32_masters(self) -> None:
        """Every trainable adapter weight (LoRA, trained norms) in fp32, in every quantisation mode.

        In bf16 an AdamW update at lr 1e-5 rounds away for most elements (a norm weight near 1.0 moves in steps of
        7.8e-3). Computation stays in the activation dtype: LoRA products run in it (autocast during the loss,
        `LoraNVFP4Linear` casts its weights), and fp32 norms round their output to it once (`trl_qerl.norms`).
        """
        if self.args.quantization == "none":
            return  # full fine-tuning: the model's own dtype (the AQN norms are fp32 already, see NormNoise)
        keep_fp32_trainable_norms(self.model)
        for name, param in self.model.named_parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32 and "lora_" in name:
                param.data = param.data.float()

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """`Trainer.train`; ``resume_from_checkpoint=True`` resumes from the newest *complete* checkpoint (one
        interrupted while saving is skipped with a warning), and AQN noise never outlives a failed step."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no complete checkpoint; start "
                    "without resuming, or pass the path of a checkpoint."
                )
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            if self.aqn_callback.noise is not None:
                self.aqn_callback.noise.restore()  # e.g. a reward function raised while noise was on

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        check_base_fingerprint(resume_from_checkpoint, self.model, strict=True)
        # Private transformers hook (checked against 5.17 and 5.24): resuming reloads the adapter through PEFT;
        # make sure every trainable weight is an fp32 master again before the optimizer is built.
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._keep_fp32_masters()

    @staticmethod
    def _apply_lora(model, args: QeRLConfig, peft_config: PeftConfig | None):
        if args.quantization == "none":
            if peft_config is not None or isinstance(model, PeftModel):
                raise ValueError("quantization='none' is full fine-tuning; drop peft_config / the PeftModel for LoRA.")
            return model
        if isinstance(model, PeftModel):
            if peft_config is not None:
                raise ValueError("Pass either a PeftModel or a peft_config, not both.")
            for config in model.peft_config.values():
                register_nvfp4_lora(config)
            return model
        if peft_config is None:
            peft_config = nvfp4_lora_config(
                model,
                r=args.lora_r,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=args.lora_target_modules,
                train_norms=args.train_norms,
            )
        return get_peft_model(model, peft_config)

    # -- rollouts ------------------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        training = self.model.training
        noise = self.aqn_callback.noise.rollout() if training and self.aqn_callback.noise else nullcontext()
        start = self._now()
        with noise:
            completion_ids, logprobs = self.rollout_backend.generate(
                self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        elapsed = self._now() - start
        self._timings["rollout"] += elapsed
        tokens = sum(len(ids) for ids in completion_ids)
        metrics = self._metrics["train" if training else "eval"]
        metrics["rollout/tokens_per_second"].append(tokens / max(elapsed, 1e-9))
        entropy = _sampling_entropy(self.rollout_backend, logprobs)
        if entropy is not None:
            metrics["rollout/sampling_entropy"].append(entropy)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        ratio = output.get("importance_sampling_ratio")
        if ratio is not None:
            affected = _corrected_sequences(ratio, output["completion_mask"], self.args)
            share = self.accelerator.gather(affected.float().mean()[None]).mean().item()
            self._metrics["train" if self.model.training else "eval"]["sampling/is_corrected_share"].append(share)
        return output

    # -- timing --------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        start = self._now()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._timings["reward"] += self._now() - start
        if _check_rewards(rewards, self.reward_func_names):
            self._steps_without_rewards = 0
        else:
            self._steps_without_rewards += 1
            if self._steps_without_rewards >= MAX_STEPS_WITHOUT_REWARDS:
                raise ValueError(
                    f"Every reward function ({', '.join(self.reward_func_names)}) returned None or NaN for every "
                    f"completion in {self._steps_without_rewards} generation batches in a row: there is nothing to "
                    "learn from (the loss is 0). Return 0.0 for completions you cannot score."
                )
        return rewards

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        start = self._now()
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._timings["logprob"] += self._now() - start
        return result

    def training_step(self, model, inputs, num_items_in_batch):
        # `time/*` and `memory/*` are per optimizer step: summed over its micro-batches (TRL averages each metric
        # list at logging time, so one entry per micro-batch would divide the rollout time by the accumulation).
        on_cuda = torch.cuda.is_available() and self.accelerator.device.type == "cuda"
        if self._step_start is None:
            self._timings.clear()
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(self.accelerator.device)
            self._step_start = self._now()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # the last micro-batch before the optimizer step
            total = self._now() - self._step_start
            self._step_start = None
            metrics = self._metrics["train"]
            for part in ("rollout", "reward", "logprob", "inputs"):
                metrics[f"time/{part}_s"].append(self._timings[part])
            metrics["time/forward_backward_s"].append(total - sum(self._timings.values()))
            metrics["time/step_s"].append(total)
            if on_cuda:
                metrics["memory/peak_allocated_gb"].append(
                    torch.cuda.max_memory_allocated(self.accelerator.device) / 1e9
                )
        return loss

    def _prepare_inputs(self, generation_batch):
        # TRL 1.16's GRPOTrainer._prepare_inputs (private; checked against 1.16.0) builds each micro-batch's loss
        # inputs, rolling out when its buffer is empty. Its time outside the rollout, rewards and log-probs
        # (decoding, padding, advantages) is logged as `time/inputs_s`, so that `time/forward_backward_s` holds
        # only the loss forward and the backward.
        start, timed = self._now(), sum(self._timings.values())
        inputs = super()._prepare_inputs(generation_batch)
        self._timings["inputs"] += self._now() - start - (sum(self._timings.values()) - timed)
        return inputs

    # -- model card ----------------------------------------------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card (GRPO's and QeRL's citations) plus the QeRL setup, with it in the YAML header too."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        from huggingface_hub import ModelCard

        path = Path(self.args.output_dir) / "README.md"
        card = ModelCard.load(path)
        card.data.qerl = self._qerl_card_metadata()
        card.text = card.text.rstrip() + "\n" + self._qerl_card_section()
        card.save(path)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as `Trainer.save_model` does (never with AQN noise in the norms), then replace PEFT's blank card with
        the QeRL card and record the base model's fingerprint."""
        noise = self.aqn_callback.noise
        if noise is not None and noise.is_perturbed:
            logger.warning("AQN noise was still in the norms at save time; saving the clean weights.")
            noise.restore()
        super().save_model(output_dir, _internal_call)
        if not self.is_world_process_zero():
            return
        target = Path(output_dir or self.args.output_dir)
        write_base_fingerprint(target, self.model)
        self.create_model_card()
        if target.resolve() != Path(self.args.output_dir).resolve():
            shutil.copyfile(Path(self.args.output_dir) / "README.md", target / "README.md")

    def _qerl_card_metadata(self) -> dict[str, Any]:
        args = self.args
        schedule = args.aqn_noise_schedule()
        metadata: dict[str, Any] = {"quantization": args.quantization, "loss_type": args.loss_type}
        if args.quantization == "nvfp4":
            metadata["format"] = "compressed-tensors nvfp4-pack-quantized (W4A16, group 16)"
        lora = self._lora_settings()
        if lora is not None:
            metadata["lora"] = lora
        metadata["aqn"] = {
            "schedule": schedule.schedule, "sigma_start": schedule.sigma_start, "sigma_end": schedule.sigma_end,
            "num_stages": schedule.num_stages, "targets": list(args.aqn_targets),
            "importance_sampling": args.rollout_importance_sampling,
        }  # fmt: skip
        return metadata

    def _lora_settings(self) -> dict[str, Any] | None:
        """The LoRA the model really carries (from ``args`` or a ``peft_config`` the caller passed)."""
        if not isinstance(self.model, PeftModel):
            return None
        config = self.model.peft_config[self.model.active_adapter]
        return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
                "trained_norms": bool(config.modules_to_save)}  # fmt: skip

    def _qerl_card_section(self) -> str:
        args = self.args
        schedule = args.aqn_noise_schedule()
        rewards = ", ".join(self.reward_func_names) or "none"
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        quantization = {
            "nvfp4": "NVFP4 base weights (E2M1 values, FP8 E4M3 scales per 16, FP32 global scale), weight-only",
            "bf16": "16-bit base weights (LoRA baseline)",
            "nf4": "NF4 base weights through bitsandbytes (QLoRA baseline)",
            "none": "none: full fine-tuning",
        }[args.quantization]
        settings = self._lora_settings()
        lora = "none" if settings is None else ", ".join(f"{key}={value}" for key, value in settings.items())
        noise = schedule.describe()
        if schedule.schedule != "off":
            noise += (f"; on {', '.join(args.aqn_targets)} (fp32 weights, output rounded once), "
                      + ("also during the loss forward" if args.aqn_apply_to_training else "during rollouts")
                      + ("; importance-sampling correction on" if args.rollout_importance_sampling else
                         "; no importance-sampling correction (as the reference)"))  # fmt: skip
        return (
            "\n## QeRL training setup\n\n"
            f"- Base model: {_model_reference(base.config._name_or_path)}\n"
            f"- Quantisation: {quantization}\n"
            f"- LoRA: {lora}\n"
            f"- Adaptive Quantization Noise: {noise}\n"
            f"- RL: loss `{args.loss_type}`, learning rate {args.learning_rate:g}, beta {args.beta:g}, epsilon "
            f"{args.epsilon:g}/{args.epsilon_high if args.epsilon_high is not None else args.epsilon:g}, "
            f"{args.num_generations} generations per prompt\n"
            f"- Rewards: {rewards}\n"
            f"- Trained with [trl-qerl](https://arxiv.org/abs/2510.11696)\n\n"
            "Load the adapter with `trl_qerl.lora.load_adapter(trl_qerl.from_pretrained(base), adapter_dir)`, or with "
            "plain PEFT onto the 16-bit base model.\n"
        )


def _model_reference(name_or_path: str) -> str:
    """A Hub id as a link; a local checkpoint by its folder name only (cards never carry local paths)."""
    if name_or_path and not os.path.isdir(name_or_path) and not os.path.isabs(name_or_path):
        return f"[{name_or_path}](https://huggingface.co/{name_or_path})"
    return f"a local checkpoint (`{Path(name_or_path).name}`)" if name_or_path else "unknown"


def _sampling_entropy(backend, logprobs: list[list[float]] | None) -> float | None:
    """Entropy per completion token of the policy that sampled (AQN noise included): the backend's exact value, or
    the sampled tokens' mean negative log-probability, an unbiased estimate of it (the vLLM backend)."""
    entropy = getattr(backend, "sampling_entropy", None)
    if entropy is not None or not logprobs:
        return entropy
    values = [value for row in logprobs for value in row if math.isfinite(value)]
    return -sum(values) / len(values) if values else None


def _corrected_sequences(ratio: torch.Tensor, completion_mask: torch.Tensor, args: QeRLConfig) -> torch.Tensor:
    """Per sequence: did TRL's importance sampling mask it (a ratio set to 0) or clip it (a ratio at a bound)?"""
    if args.vllm_importance_sampling_mode.endswith("_mask"):
        hit = ratio == 0
    else:
        hit = ratio == args.vllm_importance_sampling_clip_max
        if args.vllm_importance_sampling_clip_min is not None:
            hit |= ratio == args.vllm_importance_sampling_clip_min
    if hit.shape[-1] != 1:  # token level: a sequence counts if any of its completion tokens was corrected
        hit = hit & completion_mask.bool()
    return hit.any(dim=-1)


def _refuse_sharded_parameters(trainer, schedule) -> None:
    """ZeRO-3 and FSDP shard parameters: AQN would build its clean copies and noise from empty shards and add
    nothing, and the fp32 norm masters would not be gathered. Refused until supported."""
    if schedule.schedule == "off":
        return
    state = trainer.accelerator.state
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None and getattr(deepspeed, "zero_stage", 0) == 3:
        sharding = "DeepSpeed ZeRO-3"
    elif getattr(trainer, "is_fsdp_enabled", False) or getattr(state, "fsdp_plugin", None) is not None:
        sharding = "FSDP"
    else:
        return
    raise ValueError(
        f"{sharding} shards the model's parameters, which AQN does not support yet (its noise would be built from "
        "empty shards and silently add nothing). Use data parallelism (plain `accelerate launch`, or ZeRO-1/2), or "
        "turn AQN off with aqn_schedule='off'."
    )


def _check_output_dir(output_dir: str) -> None:
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".qerl-write-test-"):
            pass
    except OSError as error:
        raise PermissionError(
            f"output_dir {output_dir!r} is not writable ({error.strerror or error}); checkpoints and the adapter "
            "are saved there. Choose another output_dir or fix its permissions."
        ) from error


MAX_STEPS_WITHOUT_REWARDS = 3
"""Generation batches in a row whose rewards are all None/NaN before training stops (one can be bad luck)."""


def _check_rewards(rewards: torch.Tensor, names: list[str]) -> bool:
    """Refuse infinite rewards; warn about, and return False for, a batch whose rewards are all None/NaN."""
    infinite = torch.isinf(rewards)
    if bool(infinite.any()):
        bad = [name for name, column in zip(names, infinite.any(dim=0).tolist()) if column]
        raise ValueError(f"Reward function(s) {bad} returned an infinite value; rewards must be finite numbers.")
    if rewards.numel() and bool(torch.isnan(rewards).all()):
        logger.warning(
            "Every reward function (%s) returned None or NaN for every completion of this batch: it trains nothing.",
            ", ".join(names),
        )
        return False
    return True


def _check_dataset(dataset, name: str) -> None:
    if dataset is not None and hasattr(dataset, "__len__") and not isinstance(dataset, dict) and len(dataset) == 0:
        raise ValueError(f"{name} is empty: there is nothing to train or evaluate on.")
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # DatasetDict
        columns = next(iter(columns.values()), None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Build it with trl_qerl.data.build_math_dataset, or "
            "rename your question column to 'prompt'."
        )
