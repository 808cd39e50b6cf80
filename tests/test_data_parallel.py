"""Data-parallel QeRL training on 2 CPU processes (gloo), the code path `accelerate launch --num_processes N` takes on
GPUs: the replicas stay identical after every step, a checkpoint written by 2 processes resumes on 2 (the same run
as never stopping: AQN schedule, optimizer and RNG continue) and on 1, and the saved adapter is the one in memory."""

import os
import shutil
import sys

import pytest
import torch
import torch.multiprocessing as mp
from _tiny import free_port, tiny_chat_checkpoint

from trl_qerl.replica_check import diverged_tensors, trainable_fingerprint


pytestmark = pytest.mark.slow


def _train(rank: int, world: int, port: int, workdir: str, output: str, resume: bool, results) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from trl_qerl.config import QeRLConfig
    from trl_qerl.data import tiny_arithmetic_dataset
    from trl_qerl.lora import nvfp4_lora_config
    from trl_qerl.rewards import completion_text
    from trl_qerl.trainer import QeRLGRPOTrainer

    def varied(completions, **kwargs):
        return [len(set(completion_text(c))) / 10 for c in completions]

    record = {"fingerprints": {}, "logs": {}}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            record["fingerprints"][state.global_step] = trainable_fingerprint(model)[1]

    args = QeRLConfig(
        output_dir=output, max_steps=4, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        save_strategy="steps", save_steps=2, use_cpu=True, gradient_checkpointing=False, logging_steps=1,
        report_to="none", aqn_num_stages=4, aqn_sigma_start=1e-2, aqn_sigma_end=1e-3, seed=0, learning_rate=1e-3,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = QeRLGRPOTrainer(
        os.path.join(workdir, "tiny"),
        reward_funcs=varied,
        args=args,
        train_dataset=tiny_arithmetic_dataset("train", limit=32),
        peft_config=nvfp4_lora_config(r=4),
        callbacks=[Record()],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    record["logs"] = {e["step"]: (e["aqn/stage"], e["aqn/sigma"], e["loss"]) for e in trainer.state.log_history
                      if "loss" in e}  # fmt: skip
    record["world"] = trainer.accelerator.num_processes
    if rank == 0 and not resume:
        saved = load_file(os.path.join(output, "checkpoint-4", "adapter_model.safetensors"))
        memory = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        record["saved"], record["memory"] = saved, memory
    results[rank] = record
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run(world: int, workdir, output, resume: bool) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_train, args=(world, free_port(), str(workdir), str(output), resume, results), nprocs=world)
    return dict(results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dp")
    tiny_chat_checkpoint(workdir / "tiny")
    full = _run(2, workdir, workdir / "full", resume=False)
    # resume from the checkpoint the 2-process run wrote at step 2, on 2 processes and on 1
    for name in ("resumed2", "resumed1"):
        (workdir / name).mkdir()
        shutil.copytree(workdir / "full" / "checkpoint-2", workdir / name / "checkpoint-2")
    return {"full": full, "resumed2": _run(2, workdir, workdir / "resumed2", resume=True),
            "resumed1": _run(1, workdir, workdir / "resumed1", resume=True)}  # fmt: skip


def test_both_ranks_train_on_two_processes_and_stay_identical_after_every_step(runs):
    full = runs["full"]
    assert full[0]["world"] == 2 and sorted(full[0]["fingerprints"]) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        names = [str(i) for i in range(len(full[0]["fingerprints"][step]))]
        assert not diverged_tensors(names, [full[0]["fingerprints"][step], full[1]["fingerprints"][step]])
    assert not torch.equal(full[0]["fingerprints"][1], full[0]["fingerprints"][4])  # and they do train


def test_the_saved_adapter_is_the_one_in_memory(runs):
    record = runs["full"][0]
    saved, memory = record["saved"], record["memory"]
    lora = {n: t for n, t in memory.items() if "lora_" in n}
    assert lora
    for name, tensor in lora.items():
        key = name.replace(".default", "")
        assert key in saved, key
        assert torch.equal(saved[key].float(), tensor.float())


def test_resume_on_two_processes_continues_the_same_run(runs):
    full, resumed = runs["full"][0], runs["resumed2"][0]
    assert sorted(resumed["fingerprints"]) == [3, 4]
    for step in (3, 4):
        stage, sigma, _ = full["logs"][step]
        assert resumed["logs"][step][:2] == (stage, sigma)  # the AQN schedule continues
        # optimizer, scheduler, RNG (sampling and noise) and data order continue: the very same weights
        assert torch.equal(resumed["fingerprints"][step], full["fingerprints"][step]), step


def test_resume_on_one_process_continues_the_schedule(runs):
    full, resumed = runs["full"][0], runs["resumed1"][0]
    assert resumed["world"] == 1 and sorted(resumed["fingerprints"]) == [3, 4]
    for step in (3, 4):
        assert resumed["logs"][step][:2] == full["logs"][step][:2]


def _diverge(rank: int, port: int, results) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist
    from _tiny import tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.replica_check import ReplicaCheck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = get_peft_model(quantize_model(tiny_model("qwen2", dtype=torch.float32)), nvfp4_lora_config(r=4))
    state = type("State", (), {"global_step": 7})()
    ReplicaCheck().on_step_end(None, state, None, model=model)  # identical: passes
    if rank == 1:
        with torch.no_grad():
            model.base_model.model.model.layers[1].self_attn.v_proj.lora_B.default.weight.add_(1e-6)
    try:
        ReplicaCheck().on_step_end(None, state, None, model=model)
        results[rank] = None
    except RuntimeError as error:
        results[rank] = str(error)
    dist.destroy_process_group()


def test_replicas_that_diverge_stop_training_with_the_tensor_named():
    results = mp.Manager().dict()
    mp.spawn(_diverge, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        assert "After step 7 the data-parallel ranks hold different trainable weights in 1 tensor(s)" in results[rank]
        assert "layers.1.self_attn.v_proj.lora_B.default.weight" in results[rank]


def test_the_cli_trains_on_two_processes_under_a_torch_distributed_launcher(tmp_path):
    """What `accelerate launch --config_file recipes/accelerate/multi_gpu.yaml` runs on GPUs (torch.distributed.run
    under the hood), here on 2 CPU processes: accelerate's own launcher has no multi-process CPU mode without MPI."""
    import json
    import subprocess

    from trl_qerl.data import tiny_assets

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "trl_qerl.cli", "train", "--model_name_or_path", str(tiny_assets()),
               "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4",
               "--num_generations", "4", "--max_completion_length", "8", "--report_to", "none", "--save_steps", "1",
               "--lora_r", "4", "--use_cpu", "true", "--logging_steps", "1"]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert len([entry for entry in state["log_history"] if "num_tokens" in entry]) == 2
    # two processes trained: each saved its RNG state into the checkpoint
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint-2").glob("rng_state*")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_the_accelerate_config_is_valid_and_data_parallel():
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).parents[1] / "recipes" / "accelerate" / "multi_gpu.yaml"
    config = load_config_from_file(str(path))
    assert str(config.distributed_type) in ("MULTI_GPU", "DistributedType.MULTI_GPU")
    assert (config.num_machines, config.num_processes, config.use_cpu) == (1, 2, False)


def test_sharded_training_is_not_compared():
    from types import SimpleNamespace

    from trl_qerl.replica_check import shards_parameters

    assert shards_parameters(SimpleNamespace(fsdp="full_shard"))
    zero3 = SimpleNamespace(fsdp=None, hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: True))
    assert shards_parameters(zero3)
    zero2 = SimpleNamespace(fsdp=[], hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: False))
    assert not shards_parameters(zero2) and not shards_parameters(SimpleNamespace())
