"""Probe for Nsight Compute (not project code): the decode kernel's LoRA build on 7B gate/up and down at 8 rows, as
the fused step launches it (the chooser's instance), a few launches each.

    ncu --clock-control none --set full -k regex:nvfp4_mma_kernel -c 4 python ncu_probe.py
"""

import torch

from trl_qerl.nvfp4 import cuda_mma, kernels
from trl_qerl.nvfp4.format import quantize


torch.manual_seed(0)
for rows, k in (([18944, 18944], 3584), ([3584], 18944)):
    weights = [tuple(t.cuda() for t in quantize(torch.randn(n, k) * 0.02)) for n in rows]
    lora_b = [torch.randn(n, 32, device="cuda") * 0.01 for n in rows]
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(8, 32 * len(rows), device="cuda")
    choice = kernels.CHOOSER.choose_with_lora(x, weights, 32)
    print(rows, k, choice, flush=True)
    for _ in range(2):
        cuda_mma.matmul(x, weights, choice, lora=cuda_mma.LoraInputs(hidden, lora_b, [2.0] * len(rows)))
torch.cuda.synchronize()
