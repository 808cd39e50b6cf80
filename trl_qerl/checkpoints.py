"""What makes a saved run trustworthy: completion markers on checkpoints, atomic small writes, and a fingerprint
of the base model that an adapter or checkpoint was trained on.

* A checkpoint is complete once `CheckpointMarker` (a `TrainerCallback`; transformers calls ``on_save`` after the
  whole checkpoint is written) has put ``qerl_checkpoint.json`` into it; a process killed while saving leaves no
  marker, and `last_complete_checkpoint` skips such a directory with a warning instead of crashing on it.
  Checkpoints written without the callback count as complete when their ``trainer_state.json`` exists.
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
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback


logger = logging.getLogger(__name__)

MARKER = "qerl_checkpoint.json"
BASE_FINGERPRINT = "qerl_base.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename: readers see the old
    file or the whole new one, never a truncated one."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


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
