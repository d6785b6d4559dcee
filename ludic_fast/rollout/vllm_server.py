"""Server mode: vLLM's OpenAI-compatible server as the rollout sampler, started by the run (`VLLMServer`) or
given by URL (`VLLMServerSampler(url, ...)`), with a weight-update path.

Sampling: one `/v1/completions` request per prompt (prompt token ids in, `return_token_ids`, `logprobs=0`),
sent concurrently; request i of a call seeded with s carries seed `request_seed(s, i)`, as in VLLMSampler, so
a GRPO group's copies are distinct samples and a call is reproducible. Sampling parameters the server could
default from the model's generation config (top-k, top-p, min-p, penalties) are sent switched off, and
behaviour logprobs are `log_softmax(z / T)` when the server runs with `--logprobs-mode processed_logprobs`
(VLLMServer starts it so; a server given by URL must be).

Several servers: `VLLMServerSampler([url1, url2, ...])` (or "url1,url2") sends request i of a call to server
i mod n and pushes every version to all of them.

Weight update (`publish(params, version)`, names mapped and checked as VLLMSampler does), two paths:
- "reload" (default; one machine, or a disk every server reads): the weights are written to
  `<weights_dir>/v<version>/model.safetensors` and each server reloads them through vLLM's development
  endpoints (`/collective_rpc` with `reload_weights(weights_path=...)`, then `/reset_prefix_cache`; the server
  needs `VLLM_SERVER_DEV_MODE=1`, which VLLMServer sets).
- "nccl": vLLM's weight-transfer API (`ludic_fast.rollout.weight_transfer`): an NCCL broadcast from the
  trainer's GPU to each server's workers, announced over `/update_weights`; GPUs only.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.rollout.http import request_json
from ludic_fast.rollout.sampling import Completion, SamplingConfig, cut_at_eos
from ludic_fast.rollout.vllm_sampler import (
    check_generate_args,
    check_push_names,
    checkpoint_tensor_names,
    map_weights_for_vllm,
    request_seed,
)

log = logging.getLogger(__name__)


WEIGHT_TRANSFERS = ("reload", "nccl", "auto")


class VLLMServerSampler:
    """`generate(prompts, sampling, seed)` and `publish(params, version)` against one or more running vLLM servers.

    url: a server's base URL (http://host:port), a list of them, or several joined by commas; request i of a
    call goes to server i mod n (so a seeded call is reproducible), every push goes to all of them.
    checkpoint: the directory (or Hub name) of the checkpoint they serve, whose tensor names every push must
    match. weight_transfer: "reload" (write `<weights_dir>/v<version>/model.safetensors`, have each server
    reload it: one disk the servers read), "nccl" (vLLM's weight-transfer API, `rollout.weight_transfer`: GPUs,
    servers started with `--weight-transfer-config '{"backend": "nccl"}'`; refused where it cannot run, naming
    why) or "auto" ("nccl" where it can run, else "reload"; `self.weight_transfer` says which).
    nccl_address: this trainer's address as the servers reach it (NCCL rendezvous; default 127.0.0.1), read
    only by "nccl" and "auto" (refused beside "reload").
    weights_dir: where reload pushes are written (default: a new temporary folder, removed at exit).
    max_concurrency: requests in flight at once, over all servers.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        eos_token_id: int | list[int],
        checkpoint: str,
        weights_dir: str | None = None,
        max_concurrency: int = 64,
        timeout: float = 600.0,
        weight_transfer: str = "reload",
        nccl_address: str | None = None,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {WEIGHT_TRANSFERS}, got {weight_transfer!r}")
        if nccl_address is not None and weight_transfer == "reload":
            raise ValueError("nccl_address is read only with weight_transfer='nccl' or 'auto', not 'reload'")
        self.urls = split_urls(url)
        self.url = self.urls[0]
        self.timeout = timeout
        names = {u: request_json(f"{u}/v1/models", timeout=timeout)["data"][0]["id"] for u in self.urls}
        if len(set(names.values())) != 1:
            raise ValueError(f"url: the servers serve different models: {names}")
        self.model_name = names[self.url]
        self.checkpoint_names = checkpoint_tensor_names(checkpoint)
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="ludic-fast-vllm-weights-"))
        if weights_dir is None:  # ours: the last push's copy of the weights goes when the process ends
            atexit.register(shutil.rmtree, self.weights_dir, ignore_errors=True)
        self.eos_ids = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}
        self.max_concurrency = max_concurrency
        self.server: VLLMServer | None = None  # the server this engine was started with, kept alive beside it
        self.version = 0
        self.weight_transfer, self.pushers = self._open_transfer(weight_transfer, nccl_address or "127.0.0.1")

    def _open_transfer(self, mode: str, address: str) -> tuple[str, list[Any]]:
        from ludic_fast.rollout.weight_transfer import NCCLWeightPusher, nccl_transfer_unavailable

        reason = nccl_transfer_unavailable() if mode != "reload" else None
        if mode == "reload" or (mode == "auto" and reason is not None):
            if mode == "auto":
                log.info("weight_transfer='auto': reloading from %s (%s)", self.weights_dir, reason)
            return "reload", []
        if reason is not None:
            raise ValueError(f"weight_transfer='nccl': {reason}")
        pushers = [NCCLWeightPusher(u, master_address=address, master_port=free_port(address), timeout=self.timeout)
                   for u in self.urls]
        return "nccl", pushers

    def _complete(self, url: str, prompt: list[int], sampling: SamplingConfig, seed: int | None) -> Completion:
        body = {
            "model": self.model_name,
            "prompt": list(prompt),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": seed,
            "logprobs": 0,
            "stop_token_ids": sorted(self.eos_ids),
            "return_token_ids": True,
        }
        choice = request_json(f"{url}/v1/completions", body, timeout=self.timeout)["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        ids, logps, reason = cut_at_eos(ids, logps, self.eos_ids)
        return Completion(list(prompt), ids, logps, reason)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> list[Completion]:
        """Completions of each prompt (token ids); request i sampled with seed `request_seed(seed, i)` when given,
        on server `urls[i % len(urls)]`."""
        check_generate_args(prompts, sampling)
        seeds = [None if seed is None else request_seed(seed, i) for i in range(len(prompts))]
        urls = [self.urls[i % len(self.urls)] for i in range(len(prompts))]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            return list(pool.map(lambda u, p, s: self._complete(u, p, sampling, s), urls, prompts, seeds))

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        """Load the mapped, checked weights into every server (NCCL broadcast, or a reload from weights_dir),
        then reset their prefix caches."""
        weights = map_weights_for_vllm(params)
        check_push_names(set(weights), self.checkpoint_names)
        if self.weight_transfer == "nccl":
            for pusher in self.pushers:
                pusher.push(weights)
            self._on_every_server(lambda u: request_json(f"{u}/reset_prefix_cache", {}, timeout=self.timeout))
        else:
            self._reload(weights, int(version))
        self.version = int(version)

    def _reload(self, weights: dict[str, Tensor], version: int) -> None:
        from safetensors.torch import save_file

        target = self.weights_dir / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, target / "model.safetensors")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(target)}, "timeout": self.timeout}

        def reload(url: str) -> None:
            request_json(f"{url}/collective_rpc", rpc, timeout=self.timeout)
            request_json(f"{url}/reset_prefix_cache", {}, timeout=self.timeout)

        self._on_every_server(reload)
        for old in self.weights_dir.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def _on_every_server(self, fn: Any) -> None:
        """`fn(url)` on every server at once; the first error is raised after all have answered."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            for future in [pool.submit(fn, u) for u in self.urls]:
                future.result()


def split_urls(url: str | Sequence[str]) -> list[str]:
    """The server URLs of `url` (one, a list, or several joined by commas), without trailing slashes; ValueError
    for none, a repeat or one that is not http(s)://."""
    items = url.split(",") if isinstance(url, str) else list(url)
    urls = [u.strip().rstrip("/") for u in items if isinstance(u, str) and u.strip()]
    if not urls or len(urls) != len(items):
        raise ValueError(f"url: one or more http(s):// server URLs, got {url!r}")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"url: {bad[0]!r} is not an http(s):// URL")
    if len(set(urls)) != len(urls):
        raise ValueError(f"url: a server is listed twice in {url!r}")
    return urls


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """vLLM's OpenAI-compatible server for `model`, started as a child process on `host`:`port` (default: a free
    port), with processed logprobs, the model's generation-config defaults off, the development endpoints on,
    and on a CPU chunked prefill off (as VLLMSampler). `extra_args` are more `vllm serve` flags (`--dtype`,
    `--max-model-len`, ...); `env`: more environment variables (e.g. CUDA_VISIBLE_DEVICES). Use as a context
    manager; `url` is its base URL; the log goes to `log_path`. vLLM's processes talk over ZeroMQ IPC sockets
    in `VLLM_RPC_BASE_PATH` (default: the temp dir), which a server stopped by a signal leaves behind (3 a start,
    vLLM 0.32): unless `env` or the environment sets it, they go to `ipc_dir`, a directory of this server's own
    that `close()` removes."""

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        seed: int = 0,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 900.0,
        log_path: str | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.model = model
        self.url = f"http://{host}:{port or free_port(host)}"
        port_ = self.url.rsplit(":", 1)[1]
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", port_, "--seed", str(seed), "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
        ]
        if not torch.cuda.is_available():
            cmd.append("--no-enable-chunked-prefill")
        cmd += list(extra_args)
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="ludic-fast-vllm-server-", suffix=".log")[1])
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.ipc_dir = None if "VLLM_RPC_BASE_PATH" in env else tempfile.mkdtemp(prefix="ludic-fast-vllm-ipc-")
        if self.ipc_dir is not None:
            env["VLLM_RPC_BASE_PATH"] = self.ipc_dir
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        atexit.register(self.close)  # never outlive the run
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} before serving: {tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"vLLM server not ready after {timeout:.0f} s (log: {self.log_path})")

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s) and remove `ipc_dir`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """`vllm serve` flags of vllm.LLM-style engine arguments: `{"max_num_seqs": 8, "enforce_eager": True}` ->
    `["--max-num-seqs", "8", "--enforce-eager"]` (False: `--no-<flag>`; lists and dicts as JSON)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    return flags


def server_sampler(
    model: str, *, url: str | None, eos_token_id: int | list[int], seed: int = 0,
    engine_args: Mapping[str, Any] | None = None,
) -> VLLMServerSampler:
    """A VLLMServerSampler on the server(s) at `url` (one URL or several joined by commas), or on a VLLMServer
    started here for `model` with `engine_args` (kept as the engine's `server`, stopped when the process exits).
    `model`: the served checkpoint's folder."""
    server = None
    if url is None:
        server = VLLMServer(model, seed=seed, extra_args=server_flags(engine_args or {}))
        url = server.url
    elif engine_args:
        raise ValueError("engine_args: a server given by URL was started with its own engine arguments")
    sampler = VLLMServerSampler(url, eos_token_id=eos_token_id, checkpoint=model)
    sampler.server = server
    return sampler


__getattr__ = renamed_attributes(__name__, globals(),
                                 {"VLLMServerEngine": "VLLMServerSampler", "server_engine": "server_sampler"})

__all__ = ["VLLMServer", "VLLMServerSampler", "free_port", "server_sampler", "server_flags", "split_urls",
           "request_json", "WEIGHT_TRANSFERS"]
