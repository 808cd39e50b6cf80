"""What makes a saved run trustworthy: completion markers on checkpoints, atomic small writes, and a fingerprint
of the base model that an adapter or checkpoint was trained on.

* A checkpoint is complete once `CheckpointMarker` (a `TrainerCallback`; transformers calls ``on_save`` after the
  whole checkpoint is written) has put ``qerl_checkpoint.json`` into it; a process killed while saving leaves no
  marker, and `last_complete_checkpoint` skips such a directory with a warning instead of crashing on it.
  Checkpoints written without the callback count as complete when their ``trainer_state.json`` exists.
* A whole exported checkpoint (`trl-qerl quantize`, `merge_and_export`) is written by `atomic_directory`: into a
  temporary directory beside the target, renamed into place when complete, so the target holds the old checkpoint
  or the whole new one, never a mix; `check_output_dir` refuses a target that is a file, the input itself, or a
  non-empty directory (unless overwriting is asked for) before any work is done.
* Every save records the base model's fingerprint (``qerl_base.json``): a hash of the input embedding, which no
  mode quantises, with the architecture's shapes. Resuming onto another base raises; loading an adapter onto one
  warns (applying an adapter to a sibling model can be deliberate).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .nvfp4._files import write_atomically


logger = logging.getLogger(__name__)

MARKER = "qerl_checkpoint.json"
BASE_FINGERPRINT = "qerl_base.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def check_output_dir(
    output_dir: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), overwrite: bool = False
) -> Path:
    """Refuse, before any work, an output directory that would lose data or report a false success: an existing
    file, one of the ``inputs`` (or a directory inside or around one), a non-empty directory unless ``overwrite``,
    or a parent that cannot be written. Returns the path."""
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"{output} is an existing file, not a directory; give a directory path for the checkpoint.")
    resolved = output.resolve()
    for source in inputs:
        source = Path(source)
        if not source.exists():
            continue  # a Hub id
        source = source.resolve()
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise ValueError(
                f"The output {output} would overwrite the input {source}; write the checkpoint to a new directory."
            )
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ValueError(
            f"{output} exists and is not empty; choose a new directory, or overwrite it (--overwrite / "
            "overwrite=True): its whole content is then replaced."
        )
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"Cannot write into {parent}; choose an output directory you can write to.")
    return output


@contextmanager
def atomic_directory(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``output_dir``; when the block ends without an exception it
    replaces ``output_dir`` (whatever was there goes), otherwise it is removed. A process killed inside the block
    leaves ``output_dir`` untouched and a ``.<name>.partial-*`` directory, which the next call removes."""
    output = Path(output_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    for orphan in output.parent.glob(f".{output.name}.partial-*"):
        shutil.rmtree(orphan, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp's 0700 would make the checkpoint private to this user
        if output.exists():
            # a directory cannot be renamed over a non-empty one: move the old one aside, then drop it
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, retired / output.name)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class CheckpointMarker(TrainerCallback):
    """Marks every checkpoint complete once transformers has finished writing it (see `last_complete_checkpoint`)."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if directory.is_dir():
                write_atomically(directory / MARKER, json.dumps({"global_step": state.global_step, "complete": True}))


def is_complete_checkpoint(directory: str | os.PathLike) -> bool:
    directory = Path(directory)
    return (directory / MARKER).is_file() or (
        (directory / "trainer_state.json").is_file() and not _is_marked_run(directory.parent)
    )


def _is_marked_run(output_dir: Path) -> bool:
    """True if any checkpoint of this run carries a marker: then checkpoints without one are incomplete."""
    return any((path / MARKER).is_file() for path in output_dir.glob("checkpoint-*"))


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``; incomplete newer ones are named in a warning."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    steps = sorted(
        ((int(match.group(1)), path) for path in output_dir.iterdir() if (match := _CHECKPOINT.match(path.name))),
        reverse=True,
    )
    skipped = []
    for _, path in steps:
        if path.is_dir() and is_complete_checkpoint(path):
            if skipped:
                logger.warning(
                    "Skipping incomplete checkpoint(s) %s (interrupted while saving); resuming from %s.",
                    ", ".join(skipped), path.name,
                )  # fmt: skip
            return str(path)
        skipped.append(path.name)
    if skipped:
        logger.warning("No complete checkpoint in %s: %s are incomplete.", output_dir, ", ".join(skipped))
    return None


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """A fingerprint of the base model: SHA-256 of its input embedding's bytes (never quantised, so the same in
    every mode) and its shape. Equal fingerprints mean the same base weights, with near certainty."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings().weight.detach()
    sample = embedding[: min(256, embedding.shape[0])].to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(sample.numpy().tobytes()).hexdigest()
    return {"embedding_sha256": digest, "embedding_shape": list(embedding.shape)}


def write_base_fingerprint(directory: str | os.PathLike, model: nn.Module) -> None:
    write_atomically(Path(directory) / BASE_FINGERPRINT, json.dumps(base_fingerprint(model), indent=2))


def check_base_fingerprint(directory: str | os.PathLike, model: nn.Module, strict: bool) -> bool:
    """Compare ``directory``'s recorded base with ``model``'s; raise (``strict``) or warn on a mismatch. Returns
    False on a mismatch, True otherwise (also when nothing was recorded)."""
    path = Path(directory) / BASE_FINGERPRINT
    if not path.is_file():
        return True
    recorded, current = json.loads(path.read_text()), base_fingerprint(model)
    if recorded == current:
        return True
    message = (
        f"{directory} was trained on a different base model than the one loaded (input embeddings differ: "
        f"{recorded.get('embedding_shape')} vs {current['embedding_shape']}, or same shape, other weights). Load "
        "the base model it was trained on."
    )
    if strict:
        raise ValueError(message)
    logger.warning("%s Its outputs on this base are not what was trained.", message)
    return False
