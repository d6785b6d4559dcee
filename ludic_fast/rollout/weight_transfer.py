"""Weights from the trainer to a vLLM server over NCCL, through vLLM's weight-transfer API.

vLLM's server (started with `--weight-transfer-config '{"backend": "nccl"}'` and VLLM_SERVER_DEV_MODE=1, as
`VLLMServer` sets it) exposes
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`: the trainer
opens an NCCL group with the server's workers (the trainer is rank 0, the server's W workers ranks 1..W), then
each push announces the tensors' names, dtypes and shapes over HTTP while it broadcasts their bytes over NCCL;
the workers load them with the model's own `load_weights`. No byte goes through a file, Redis or HTTP.
`NCCLWeightPusher` drives vLLM's trainer-side engine for one server; the HTTP calls are ours
(`VLLMServerSampler(weight_transfer="nccl")` uses it, one pusher per server).

It needs CUDA on both sides and a vLLM with `vllm.distributed.weight_transfer` (present in 0.32 and later),
and the trainer and each server on different GPUs (NCCL refuses two ranks on one device);
`nccl_transfer_unavailable()` says why it cannot run here (on vLLM's CPU build: no CUDA).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from ludic_fast.rollout.http import request_json


def nccl_transfer_unavailable() -> str | None:
    """None when the NCCL weight transfer can run in this process, else the reason (one line)."""
    try:
        has_api = importlib.util.find_spec("vllm.distributed.weight_transfer.nccl_engine") is not None
    except ModuleNotFoundError:
        has_api = False
    if not has_api:
        return "vLLM's weight-transfer API (vllm.distributed.weight_transfer, vLLM >= 0.32) is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: vLLM's NCCL weight transfer needs GPUs for the trainer and the servers"
    return None


#: the server routes HTTPControl calls (vLLM's `vllm/entrypoints/rl/online/api_router.py`, VLLM_SERVER_DEV_MODE=1)
ROUTES = ("/get_world_size", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
          "/finish_weight_update", "/shutdown_weight_transfer_engine")


class HTTPControl:
    """vLLM's weight-sync control plane (its `VLLMWeightSyncClient` protocol) over the server's HTTP routes."""

    def __init__(self, url: str, *, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, route: str, body: dict[str, Any]) -> None:
        request_json(f"{self.url}/{route}", body, timeout=self.timeout)

    def world_size(self) -> int:
        """The server's worker count (tensor x pipeline x data parallel): its ranks in the NCCL group."""
        return int(request_json(f"{self.url}/get_world_size", timeout=self.timeout)["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine", {})


@lru_cache(maxsize=1)
def _dict_source_class() -> type:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        """The tensors of the current push, in a fixed order (metadata and iteration agree)."""

        def __init__(self) -> None:
            self.weights: dict[str, Tensor] = {}

        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

        def __iter__(self) -> Iterator[tuple[str, Tensor]]:
            return iter(self.weights.items())

    return DictSource


class NCCLWeightPusher:
    """One vLLM server's NCCL group with this trainer: built once (`init_weight_transfer_engine`; the trainer is
    rank 0, the server's workers, as many as `/get_world_size` reports, ranks 1..W), then `push(weights)` per
    version. `master_address`: this trainer's address as the server reaches it."""

    def __init__(self, url: str, *, master_address: str, master_port: int, timeout: float = 600.0):
        reason = nccl_transfer_unavailable()
        if reason is not None:
            raise RuntimeError(f"weight_transfer='nccl': {reason}")
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.source = _dict_source_class()()
        control = HTTPControl(url, timeout=timeout)
        info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=1 + control.world_size(), rank=0)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=control, source=self.source)

    def push(self, weights: Mapping[str, Tensor]) -> None:
        """Broadcast `weights` (checkpoint names) to the server's workers, which load them in place."""
        with torch.no_grad():
            self.source.weights = {n: t.detach().to(self.device).contiguous() for n, t in weights.items()}
        try:
            self.engine.send_weights()
        finally:
            self.source.weights = {}

    def close(self) -> None:
        self.engine.shutdown()
