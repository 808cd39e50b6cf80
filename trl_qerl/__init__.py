"""trl-qerl: QeRL (quantisation-enhanced RL) for the Hugging Face stack.

NVFP4 4-bit base weights + LoRA + Adaptive Quantization Noise, trained with TRL's GRPO/DAPO::

    from trl_qerl import QeRLConfig, QeRLGRPOTrainer
    trainer = QeRLGRPOTrainer(model="Qwen/Qwen2.5-7B-Instruct", reward_funcs=[...],
                              args=QeRLConfig(output_dir="out"), train_dataset=dataset)

Names load on first use (``import trl_qerl`` itself imports neither torch nor transformers, so ``trl-qerl --help``
answers at once); the first name used from the package registers the NVFP4 quantizer with transformers. A model loaded with `NVFP4A16Config` (or `from_pretrained`) takes LoRA through plain PEFT
(``peft.get_peft_model``, ``PeftModel.from_pretrained``) and TRL (``GRPOTrainer(..., peft_config=LoraConfig(...))``)
with nothing else from this package.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .nvfp4._deprecation import deprecated_names


__version__ = "0.1.0.dev0"

# name -> module defining it. Each entry imports `.quantizer` first (below), which registers it with transformers.
_LAZY = {
    "NVFP4A16Config": ".quantizer",
    "NVFP4A16HfQuantizer": ".quantizer",
    "quantize_model": ".quantizer",
    "NVFP4A16Linear": ".nvfp4.linear",
    "NVFP4WeightError": ".nvfp4.linear",
    "from_pretrained": ".loading",
    "QeRLConfig": ".config",
    "QeRLGRPOTrainer": ".trainer",
    "AQNCallback": ".noise",
    "NoiseSchedule": ".noise",
    "get_peft_model": ".lora",
    "load_adapter": ".lora",
    "merge_and_export": ".lora",
    "nvfp4_lora_config": ".lora",
    "accuracy_reward": ".rewards",
    "format_reward": ".rewards",
    "build_math_dataset": ".data",
}

if TYPE_CHECKING:
    from .config import QeRLConfig
    from .data import build_math_dataset
    from .loading import from_pretrained
    from .lora import get_peft_model, load_adapter, merge_and_export, nvfp4_lora_config
    from .noise import AQNCallback, NoiseSchedule
    from .nvfp4.linear import NVFP4A16Linear, NVFP4WeightError
    from .quantizer import NVFP4A16Config, NVFP4A16HfQuantizer, quantize_model
    from .rewards import accuracy_reward, format_reward
    from .trainer import QeRLGRPOTrainer


# Deprecated for one release: transformers exports unrelated classes with these names (W4A4 NVFP4 for Blackwell).
_deprecated = deprecated_names(
    __name__,
    {"NVFP4Config": "NVFP4A16Config", "NVFP4HfQuantizer": "NVFP4A16HfQuantizer", "NVFP4Linear": "NVFP4A16Linear"},
    lambda name: __getattr__(name),
)


def __getattr__(name: str):
    if name in _LAZY:
        import_module(".quantizer", __name__)  # registers the quantizer: any use of the package may load a model
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    return _deprecated(name)  # a renamed class with a FutureWarning, else AttributeError


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "NVFP4A16Config",
    "NVFP4A16HfQuantizer",
    "NVFP4A16Linear",
    "NVFP4WeightError",
    "from_pretrained",
    "quantize_model",
    "__version__",
    "AQNCallback",
    "NoiseSchedule",
    "QeRLConfig",
    "QeRLGRPOTrainer",
    "accuracy_reward",
    "build_math_dataset",
    "format_reward",
    "get_peft_model",
    "load_adapter",
    "merge_and_export",
    "nvfp4_lora_config",
]
