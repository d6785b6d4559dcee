"""Server mode: vLLM's OpenAI-compatible server as the rollout sampler, started by the run (`VLLMServer`) or
given by URL (`VLLMServerSampler(url, ...)`), with a weight-update path.

Sampling: one `/v1/completions` request per prompt (prompt token ids in, `return_token_ids`, `logprobs=0`),
sent concurrently; request i of a call seeded with s carries seed `request_seed(s, i)`, as in VLLMSampler, so
a GRPO group's copies are distinct samples and a call is reproducible. Sampling parameters the server could
default from the model's generation config (top-k, top-p, min-p, penalties) are sent switched off, and
behaviour logprobs are `log_softmax(z / T)` when the server runs with `--logprobs-mode processed_logprobs`
(VLLMServer starts it so; a server given by URL must be).

Weight update on one machine: `publish(params, version)` maps and checks the names as VLLMSampler does, writes
them to `<weights_dir>/v<version>/model.safetensors`, and asks the server to reload from there through vLLM's
development endpoints (`/collective_rpc` with `reload_weights(weights_path=...)`, then `/reset_prefix_cache`;
the server needs `VLLM_SERVER_DEV_MODE=1`, which VLLMServer sets, and must read `weights_dir`). Across
machines the weights travel over NCCL instead (vLLM's weight-transfer engine: `/init_weight_transfer_engine`,
`/update_weights`), which this module does not drive.
"""

from __future__ import annotations

import atexit
import json
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
from ludic_fast.rollout.sampler import Completion, SamplingConfig, cut_at_eos
from ludic_fast.rollout.vllm_sampler import (
    check_generate_args,
    check_push_names,
    checkpoint_tensor_names,
    map_weights_for_vllm,
    request_seed,
)


def _request(url: str, body: dict[str, Any] | None = None, *, timeout: float) -> Any:
    """POST `body` as JSON (GET without one); the decoded JSON answer, None for an empty one; RuntimeError
    naming the endpoint and the server's message on an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"vLLM server {url}: HTTP {exc.code}: {detail}") from None
    return json.loads(raw) if raw else None


class VLLMServerSampler:
    """`generate(prompts, sampling, seed)` and `publish(params, version)` against a running vLLM server.

    url: the server's base URL (http://host:port). checkpoint: the directory (or Hub name) of the checkpoint it
    serves, whose tensor names every push must match. weights_dir: where pushes are written for the server to
    read (default: a new temporary folder). max_concurrency: requests in flight at once.
    """

    def __init__(
        self,
        url: str,
        *,
        eos_token_id: int | list[int],
        checkpoint: str,
        weights_dir: str | None = None,
        max_concurrency: int = 64,
        timeout: float = 600.0,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.model_name = _request(f"{self.url}/v1/models", timeout=timeout)["data"][0]["id"]
        self.checkpoint_names = checkpoint_tensor_names(checkpoint)
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="ludic-fast-vllm-weights-"))
        self.eos_ids = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}
        self.max_concurrency = max_concurrency
        self.server: VLLMServer | None = None  # the server this engine was started with, kept alive beside it
        self.version = 0

    def _complete(self, prompt: list[int], sampling: SamplingConfig, seed: int | None) -> Completion:
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
        choice = _request(f"{self.url}/v1/completions", body, timeout=self.timeout)["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        ids, logps, reason = cut_at_eos(ids, logps, self.eos_ids)
        return Completion(list(prompt), ids, logps, reason)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> list[Completion]:
        """Completions of each prompt (token ids); request i sampled with seed `request_seed(seed, i)` when given."""
        check_generate_args(prompts, sampling)
        seeds = [None if seed is None else request_seed(seed, i) for i in range(len(prompts))]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            return list(pool.map(lambda p, s: self._complete(p, sampling, s), prompts, seeds))

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        """Write the mapped, checked weights under weights_dir and have the server reload them in place."""
        from safetensors.torch import save_file

        weights = map_weights_for_vllm(params)
        check_push_names(set(weights), self.checkpoint_names)
        target = self.weights_dir / f"v{int(version)}"
        target.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, target / "model.safetensors")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(target)}, "timeout": self.timeout}
        _request(f"{self.url}/collective_rpc", rpc, timeout=self.timeout)
        _request(f"{self.url}/reset_prefix_cache", {}, timeout=self.timeout)
        for old in self.weights_dir.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        self.version = int(version)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """vLLM's OpenAI-compatible server for `model`, started as a child process on `host`:`port` (default: a free
    port), with processed logprobs, the model's generation-config defaults off, the development endpoints on,
    and on a CPU chunked prefill off (as VLLMSampler). `extra_args` are more `vllm serve` flags (`--dtype`,
    `--max-model-len`, ...). Use as a context manager; `url` is its base URL; the log goes to `log_path`."""

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
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
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
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not ready after {timeout:.0f} s (log: {self.log_path})")

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

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
    """A VLLMServerSampler on the server at `url`, or on a VLLMServer started here for `model` with `engine_args`
    (kept as the engine's `server`, stopped when the process exits). `model`: the served checkpoint's folder."""
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

__all__ = ["VLLMServer", "VLLMServerSampler", "free_port", "server_sampler", "server_flags"]
