"""DistributedDataParallel over NVFP4 + LoRA models (2 CPU processes, gloo): the frozen packed tensors must not be
broadcast (gloo cannot send fp8), LoRA gradients must be all-reduced."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _tiny import free_port


def _worker(rank: int, port: int, results):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _tiny import tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.nvfp4.linear import exclude_packed_tensors_from_ddp
    from trl_qerl.quantizer import quantize_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = get_peft_model(quantize_model(tiny_model("qwen2", dtype=torch.float32)), nvfp4_lora_config(r=4))
    exclude_packed_tensors_from_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(rank))  # different data per rank
    ddp(tokens, labels=tokens).loss.backward()
    grad = next(p.grad for n, p in model.named_parameters() if "lora_A" in n and p.grad is not None)
    results[rank] = grad.clone()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_skips_packed_tensors_and_averages_lora_gradients():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2)
    assert torch.equal(results[0], results[1])  # all-reduced: identical on both ranks despite different data
