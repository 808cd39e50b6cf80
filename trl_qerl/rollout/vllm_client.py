"""The trainer's side of ``trl-qerl vllm-serve``: `VLLMServerClient` makes the same three calls as a local
`VLLMEngine` (``load_adapter``, ``set_norms``, ``generate``) over HTTP, JSON or raw safetensors only."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from .vllm_checkpoint import choose_max_lora_rank


API_KEY_ENV = "TRL_QERL_VLLM_API_KEY"


class ServerError(RuntimeError):
    """The rollout server answered with an error."""


class VLLMServerClient:
    """The trainer's side of ``trl-qerl vllm-serve``; the same calls as a local `VLLMEngine`."""

    def __init__(self, base_url: str, timeout: float = 240.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._info: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._request("GET", "/info")
        return self._info

    def check_rank(self, rank: int) -> None:
        """Raise if the server cannot serve adapters of this rank."""
        choose_max_lora_rank(rank, self.info()["max_lora_rank"])

    def adapter_dir(self) -> Path:
        """Where the trainer writes adapters: the server's adapter directory (a filesystem both can see)."""
        path = Path(self.info()["adapter_dir"])
        if not path.is_dir():
            raise ServerError(
                f"The rollout server reads adapters from {path}, which this machine cannot see; run the trainer on the "
                "same machine as `trl-qerl vllm-serve` (or give both a shared --adapter-dir)."
            )
        return path

    def load_adapter(self, path: str) -> None:
        path = Path(path)
        if path.parent.resolve() != Path(self.info()["adapter_dir"]).resolve():
            raise ValueError(f"{path} is not inside the server's adapter directory {self.info()['adapter_dir']}.")
        self._request("POST", "/adapter", json.dumps({"name": path.name}).encode())

    def set_norms(self, values: dict[str, torch.Tensor]) -> None:
        body = save_safetensors({name: value.detach().cpu().contiguous() for name, value in values.items()})
        self._request("POST", "/norms", body, content_type="application/octet-stream")

    def generate(self, prompt_ids, sampling):
        answer = self._request(
            "POST", "/generate", json.dumps({"prompt_ids": prompt_ids, "sampling": sampling}).encode()
        )
        return answer["completion_ids"], answer["logprobs"]

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
        request = urllib.request.Request(self.base_url + path, data=body, method=method)
        request.add_header("Content-Type", content_type)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise ServerError(f"{method} {path} -> HTTP {error.code}: {detail}") from None
        except urllib.error.URLError as error:
            raise ServerError(
                f"Cannot reach the rollout server at {self.base_url} ({error.reason}). Start it with "
                "`trl-qerl vllm-serve --model <checkpoint>` and point vllm_server_base_url at it."
            ) from None
