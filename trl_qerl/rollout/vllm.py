"""vLLM rollouts with a quantised base: adapters hot-swapped without merging, AQN written into vLLM's norms.

The engine (`trl_qerl.rollout.vllm_engine.VLLMEngine`) owns one ``vllm.LLM`` on a compressed-tensors NVFP4 (or
16-bit) checkpoint with LoRA enabled. `VLLMRollout` is the trainer's backend: on every new optimizer step it saves the adapter's LoRA
matrices (to tmpfs when there is one) and switches vLLM to them under a new `LoRARequest` id, dropping the
previous one; before every rollout batch it copies the current RMSNorm weights into vLLM's model. Those are
the trained norms plus the AQN noise drawn for this batch: the trainer perturbs its own model around
generation, and the clean weights stay on the training side, so noise never accumulates in vLLM.
The norms that receive noise or training hold fp32 weights in vLLM too, given to them when vLLM loads the model
(`trl_qerl.rollout.vllm_norms`): the noisy weight stays fp32 and the norm's product is rounded to the activation
dtype once, as in the trainer.

The engine runs in this process (colocate) or behind ``trl-qerl vllm-serve`` (`trl_qerl.rollout.vllm_server`),
which `VLLMServerClient` (`trl_qerl.rollout.vllm_client`) talks to with the same three calls: ``load_adapter``, ``set_norms``, ``generate``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .vllm_checkpoint import (
    choose_max_lora_rank,
    lora_rank,
    norm_state,
    save_base_checkpoint,
    save_vllm_adapter,
)
from .vllm_engine import SAMPLING_KEYS, Engine, VLLMEngine, adapter_root, require_vllm
from .vllm_norms import fp32_norm_names, matches


if TYPE_CHECKING:
    from trl import GRPOTrainer


logger = logging.getLogger(__name__)


def sampling_options(trainer: GRPOTrainer) -> dict[str, Any]:
    """vLLM sampling settings equivalent to the trainer's generation settings."""
    args = trainer.args
    options = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k or 0,
        "min_p": args.min_p or 0.0,
        "max_tokens": args.max_completion_length,
        "repetition_penalty": args.repetition_penalty,
        "stop_token_ids": list(trainer.eos_token_ids),
    }
    options.update(args.generation_kwargs or {})
    unknown = sorted(set(options) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are not supported by the vLLM backend; supported: {SAMPLING_KEYS}."
        )
    return options


class VLLMRollout:
    """Rollouts through a vLLM engine (local or remote), for `QeRLGRPOTrainer` (``rollout_backend="vllm"``).

    Args:
        trainer: the trainer (the backend keeps a weak reference to read its model and step).
        engine: a `VLLMEngine` or a `VLLMServerClient`.
        adapter_dir: where per-step adapters are written (the server's ``--adapter-dir`` in server mode).
        shared: one engine serves every training process (server mode): the main process gathers the prompts,
            talks to the engine, and hands each process its completions.
    """

    name = "vllm"

    def __init__(
        self, trainer: GRPOTrainer, engine: Engine, adapter_dir: str | os.PathLike, shared: bool = False
    ) -> None:
        self._trainer = weakref.ref(trainer)
        self.engine = engine
        self.adapter_dir = Path(adapter_dir)
        self.shared = shared
        self._synced_step: int | None = None
        self._adapter_path: Path | None = None

    @property
    def llm(self):
        """The colocated ``vllm.LLM`` (TRL's tool-calling path reads its ``max_model_len``)."""
        return getattr(self.engine, "llm", None)

    def sync_weights(self) -> None:
        """Send the current adapter to vLLM (TRL calls this for custom ``rollout_func``s)."""
        trainer = self._trainer()
        model = trainer.accelerator.unwrap_model(trainer.model)
        step = trainer.state.global_step
        path = self.adapter_dir / f"step-{step}"
        if path.exists():
            shutil.rmtree(path)
        save_vllm_adapter(model, path, adapter_name=model.active_adapter)
        self.engine.load_adapter(str(path))
        if self._adapter_path is not None and self._adapter_path != path:
            shutil.rmtree(self._adapter_path, ignore_errors=True)
        self._adapter_path = path
        self._synced_step = step

    def generate(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("The vLLM backend of trl-qerl does not roll out multimodal prompts yet.")
        accelerator = trainer.accelerator
        if not self.shared or accelerator.num_processes == 1:
            return self._generate(trainer, prompt_ids)
        from accelerate.utils import broadcast_object_list, gather_object

        all_prompt_ids = gather_object(prompt_ids)
        payload = [self._generate(trainer, all_prompt_ids) if accelerator.is_main_process else None]
        broadcast_object_list(payload, from_process=0)
        completions, logprobs = payload[0]
        rows = slice(accelerator.process_index * len(prompt_ids), (accelerator.process_index + 1) * len(prompt_ids))
        return completions[rows], logprobs[rows]

    def _generate(self, trainer, prompt_ids):
        if trainer.state.global_step != self._synced_step:
            self.sync_weights()
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.engine.set_norms(norm_state(model))  # trained norms + this rollout's AQN draw
        return self.engine.generate(prompt_ids, sampling_options(trainer))


def make_vllm_rollout(trainer: GRPOTrainer) -> VLLMRollout:
    """The backend for ``use_vllm=True`` / ``rollout_backend="vllm"``: colocate or server, from ``args.vllm_mode``."""
    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not hasattr(model, "peft_config"):
        raise ValueError(
            "The vLLM backend serves LoRA adapters; full fine-tuning (quantization='none') cannot use it."
        )
    rank = lora_rank(model, model.active_adapter)
    fp32_norms = fp32_norm_names(norm_state(model))  # the norms trained or perturbed: fp32 in vLLM too
    if args.vllm_mode == "server":  # the server checks its own shapes and tensor parallelism when it starts
        from .vllm_client import VLLMServerClient

        client = VLLMServerClient(args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}",
                                  timeout=args.vllm_server_timeout)  # fmt: skip
        client.check_rank(rank)
        served = client.info()["quantization"]
        if served != ("nvfp4" if args.quantization == "nvfp4" else "none"):
            raise ValueError(
                f"The rollout server serves a {served!r} base but training uses quantization={args.quantization!r}; "
                "start the server on the checkpoint you train (e.g. the output of `trl-qerl quantize`)."
            )
        check_server_norms(client.info(), fp32_norms)
        return VLLMRollout(trainer, client, client.adapter_dir(), shared=True)
    if args.vllm_mode != "colocate":
        raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}.")
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(
            "Colocated vLLM runs one engine per training GPU: set vllm_tensor_parallel_size=1, or serve rollouts "
            "from separate GPUs with `trl-qerl vllm-serve --tensor-parallel-size N` (vllm_mode='server')."
        )
    require_vllm()
    checkpoint = _base_checkpoint(trainer, model)
    adapters = adapter_root(args.vllm_adapter_dir)
    engine = VLLMEngine(
        checkpoint,
        max_lora_rank=choose_max_lora_rank(rank, args.vllm_max_lora_rank),
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        fp32_norms=fp32_norms,
        **engine_options(trainer),
    )
    rollout = VLLMRollout(trainer, engine, adapters)
    weakref.finalize(rollout, shutil.rmtree, adapters, True)
    return rollout


def check_server_norms(info: dict[str, Any], fp32_norms: Sequence[str]) -> list[str]:
    """Warn (and return them) about norms the trainer sends in fp32 that a 16-bit rollout server holds in 16 bits."""
    if info.get("dtype") in ("float32", "float", "fp32"):
        return []
    held = info.get("fp32_norms") or ()
    missing = [name for name in fp32_norms if not matches(name, held)]
    if missing:
        logger.warning(
            "The rollout server holds %d of the norms that receive AQN noise or training in %s, not fp32 (noise below "
            "its precision vanishes there): %s. Start it with --fp32-norms covering them.",
            len(missing), info.get("dtype", "16-bit"), missing[:4],
        )  # fmt: skip
    return missing


def engine_options(trainer: GRPOTrainer) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from the trainer's config (``vllm_engine_kwargs`` wins)."""
    args = trainer.args
    options = {
        "dtype": "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "max_model_len": args.vllm_max_model_length,
        "max_num_seqs": args.per_device_train_batch_size * args.steps_per_generation,
        "enforce_eager": args.vllm_enforce_eager,
        "seed": args.seed + trainer.accelerator.process_index,
    }
    options.update(args.vllm_engine_kwargs or {})
    return options


def _base_checkpoint(trainer: GRPOTrainer, model) -> Path:
    """The checkpoint vLLM loads: ``vllm_checkpoint_dir`` when it holds one, else the base written there (or to a
    temporary directory removed when the trainer goes)."""
    args = trainer.args
    target = args.vllm_checkpoint_dir
    if target and (Path(target) / "config.json").exists():
        logger.info("vLLM loads the base checkpoint in %s", target)
        return Path(target)
    if target is None:
        target = tempfile.mkdtemp(prefix="trl-qerl-vllm-base-")
        weakref.finalize(trainer, shutil.rmtree, target, True)
    logger.info("Writing the base checkpoint for vLLM to %s", target)
    return save_base_checkpoint(model, target)
