"""trl-qerl: QeRL (quantisation-enhanced RL) for the Hugging Face stack.

NVFP4 4-bit base weights + LoRA + Adaptive Quantization Noise, trained with TRL's GRPO/DAPO.
"""

from .loading import from_pretrained
from .nvfp4.linear import NVFP4Linear
from .quantizer import NVFP4Config, NVFP4HfQuantizer


__version__ = "0.1.0.dev0"

__all__ = ["NVFP4Config", "NVFP4HfQuantizer", "NVFP4Linear", "from_pretrained", "__version__"]
