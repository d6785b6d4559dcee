"""Weight-push cost of each path: bytes through Redis per published step, Redis's peak memory, and the time of
one publish + one actor's load, for the embedded tiny Llama and synthetic state dicts of a few MiB (the per-byte
slope, from which the 0.5B and 7B times are predicted).

Paths:
- `blob-hash` (before): the whole safetensors blob in one hash, replaced in one MULTI/EXEC, read in one HGETALL
  (ludic-fast's publisher until the notice + chunks design; re-implemented here for the comparison);
- `redis-chunks` (now, default): `RedisWeightPublisher` + `RedisWeightSubscriber`, 16 MiB chunks + notice;
- `file` (now): `RedisWeightPublisher(store="file")`: the bytes on local disk, only the notice through Redis;
- `vllm-reload` (`--vllm`): `VLLMServerSampler.publish` to a vLLM server started here (file + reload_weights),
  for the tiny Llama and a wider one (hidden 512, 4 layers) for the per-byte slope;
- `nccl`: vLLM's weight-transfer API; printed as not run with its reason where it cannot run (CPU).

Each Redis path runs on its own fresh `redis-server` (loopback, no persistence), publishes `--repeats` versions
and has one subscriber load each; bytes are the server's `total_net_input_bytes + total_net_output_bytes` per
step, peak is `used_memory_peak - used_memory` at start. Times: median (min-max) of the repeats.
Prediction: a least-squares line time = a + b * bytes over the measured sizes, evaluated at bf16 Qwen2.5-0.5B
(494M parameters, 0.99 GB) and Qwen2.5-7B (7.62B parameters, 15.2 GB).

    python bench/weight_push.py                 # Redis paths (needs redis-server)
    python bench/weight_push.py --vllm          # + the reload into a vLLM server (.venv-vllm)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import redis
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ludic_fast.distributed.pipeline import PipelineKeys
from ludic_fast.distributed.publish import RedisWeightPublisher, RedisWeightSubscriber
from ludic_fast.embedded import build_tiny_model
from ludic_fast.rollout.weight_transfer import nccl_transfer_unavailable

PREDICT = {"Qwen2.5-0.5B bf16": 494_032_768 * 2, "Qwen2.5-7B bf16": 7_615_616_512 * 2}


class Server:
    def __init__(self, workdir: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--dir", workdir, "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)
        for _ in range(400):
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)

    def stats(self) -> tuple[int, int]:
        info = self.client.info()
        return info["total_net_input_bytes"] + info["total_net_output_bytes"], info["used_memory_peak"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def blob_hash_pair(url: str, keys: PipelineKeys):
    """The pre-notice publisher and subscriber (whole blob in one hash, 64 MiB fields)."""
    client = redis.Redis.from_url(url)

    def publish(params, version):
        blob = st_save({k: v.contiguous() for k, v in params.items()})
        parts = [blob[i : i + 64 * 2**20] for i in range(0, len(blob), 64 * 2**20)] or [b""]
        mapping = {"version": version, "parts": len(parts), **{str(i): p for i, p in enumerate(parts)}}
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.weights)
        pipe.hset(keys.weights, mapping=mapping)
        pipe.execute()

    def poll():
        data = client.hgetall(keys.weights)
        return st_load(b"".join(data[str(i).encode()] for i in range(int(data[b"parts"]))))

    return publish, poll


def measure_redis_path(path: str, params: dict, repeats: int, workdir: str) -> dict:
    server = Server(workdir)
    keys = PipelineKeys("bench")
    try:
        if path == "blob-hash":
            publish, poll = blob_hash_pair(server.url, keys)
        else:
            kw = {"store": "file", "store_dir": os.path.join(workdir, "store")} if path == "file" else {}
            pub = RedisWeightPublisher(server.url, keys=keys, **kw)
            sub = RedisWeightSubscriber(server.url, lambda s, v: None, keys=keys)
            publish, poll = pub.publish, sub.poll
        net0, _ = server.stats()
        mem0 = server.client.info()["used_memory"]
        t_pub, t_load = [], []
        for v in range(repeats):
            t0 = time.perf_counter()
            publish(params, v)
            t1 = time.perf_counter()
            poll()
            t_load.append(time.perf_counter() - t1)
            t_pub.append(t1 - t0)
        net1, peak = server.stats()
        return {"bytes_per_step": (net1 - net0) / repeats, "peak_extra": peak - mem0, "publish": t_pub,
                "load": t_load}
    finally:
        server.close()


def tiny_model(**overrides) -> torch.nn.Module:
    """The embedded tiny Llama (random init, seeded) with the embedded tokenizer's vocabulary; `overrides` widen it."""
    from ludic_fast.embedded import build_char_tokenizer

    tok = build_char_tokenizer()
    return build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=2, bos_token_id=tok.bos_token_id,
                            **overrides)


WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 8}  # the same Llama, ~40 MB in fp32: the reload's per-byte slope


def measure_vllm_reload(repeats: int, workdir: str, **overrides) -> dict:
    from ludic_fast.embedded import build_char_tokenizer
    from ludic_fast.rollout.vllm_server import VLLMServer, VLLMServerSampler

    tok = build_char_tokenizer()
    model = tiny_model(**overrides)
    path = os.path.join(workdir, "served")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    args = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]
    with VLLMServer(path, extra_args=args, log_path=os.path.join(workdir, "server.log")) as srv:
        sampler = VLLMServerSampler(srv.url, eos_token_id=2, checkpoint=path, weights_dir=os.path.join(workdir, "w"))
        state = {k: v.detach() for k, v in model.named_parameters()}
        times = []
        for v in range(repeats):
            t0 = time.perf_counter()
            sampler.publish(state, v + 1)
            times.append(time.perf_counter() - t0)
    return {"bytes": len(st_save({k: v.contiguous() for k, v in state.items()})), "push": times}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a, b of time = a + b * bytes."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes-mib", type=int, nargs="*", default=[8, 32, 96],
                   help="synthetic fp32 state dicts for the per-byte slope")
    p.add_argument("--vllm", action="store_true", help="also time the reload into a vLLM server started here")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be >= 2")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tiny = {k: v.detach() for k, v in tiny_model().named_parameters()}
    sets = {"tiny": tiny}
    for mib in args.sizes_mib:
        sets[f"{mib} MiB"] = {f"layer{i}.weight": torch.randn(mib * 2**20 // 4 // 8) for i in range(8)}
    print(f"# machine: {os.cpu_count()} CPUs, load average {os.getloadavg()} at start; torch {torch.__version__}")
    print("| path | state | bytes | Redis bytes/step | Redis peak extra | publish | one actor's load |")
    print("|---|---|---|---|---|---|---|")
    slopes: dict[str, list[tuple[int, float]]] = {}
    for name, params in sets.items():
        size = len(st_save({k: v.contiguous() for k, v in params.items()}))
        for path in ("blob-hash", "redis-chunks", "file"):
            with tempfile.TemporaryDirectory(prefix="ludic-bench-") as workdir:
                r = measure_redis_path(path, params, args.repeats, workdir)
            print(f"| {path} | {name} | {size:,} | {r['bytes_per_step']:,.0f} | {r['peak_extra']:,} | "
                  f"{spread(r['publish'])} | {spread(r['load'])} |", flush=True)
            total = [a + b for a, b in zip(r["publish"], r["load"])]
            slopes.setdefault(path, []).append((size, statistics.median(total)))
        sha = hashlib.sha256(st_save({k: v.contiguous() for k, v in params.items()})).hexdigest()[:12]
        print(f"|  | {name} sha256 {sha} |  |  |  |  |  |")
    if args.vllm:
        print()
        for name, overrides in (("tiny Llama", {}), ("wide tiny Llama", WIDE)):
            with tempfile.TemporaryDirectory(prefix="ludic-bench-") as workdir:
                r = measure_vllm_reload(args.repeats, workdir, **overrides)
            print(f"vllm-reload ({name}, {r['bytes']:,} bytes, one server): {spread(r['push'])}", flush=True)
            slopes.setdefault("vllm-reload", []).append((r["bytes"], statistics.median(r["push"])))
    reason = nccl_transfer_unavailable()
    print(f"\nnccl (vLLM weight-transfer API): {'not run: ' + reason if reason else 'available; not timed here'}")
    print("\nPredicted publish + one load, from time = a + b * bytes over the measured sizes:")
    for path, pts in slopes.items():
        a, b = fit(pts)
        preds = ", ".join(f"{m}: {(a + b * n):.1f} s" for m, n in PREDICT.items())
        print(f"- {path}: a = {a * 1e3:.2f} ms, b = {b * 1e9:.2f} s/GB -> {preds}")
    print(f"\n# load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
