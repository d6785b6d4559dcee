"""The pipeline RL actor (examples/pipeline_rl) sampling with vLLM's OpenAI server (`--engine vllm-server`, started
by the actor) while the learner trains: weights travel learner -> Redis -> actor -> the server's update path.
On a real vLLM and redis-server (`make test`: .venv-vllm with vLLM's CPU build)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _vllm import ENGINE_CORE_RUNS_MODEL, needs_vllm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "pipeline_rl"


@pytest.fixture
def redis_url(tmp_path):
    needs_vllm()
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("needs redis-server (apt-get install redis-server)")
    redis = pytest.importorskip("redis", reason="needs the [redis] extra")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 20
    while True:
        try:
            if client.ping():
                break
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


def test_pipeline_actor_samples_with_a_vllm_server_and_loads_each_published_version(redis_url):
    # --max-lag 0: step 2 trains only on items of version 1, so the learner cannot finish before the actor has
    # loaded it (with a lag allowed, a learner slower than the actor's rounds trained both steps on version-0 items
    # and the actor stopped without a load: "pushed 24 items; last policy version 0", make test, loaded machine)
    common = ["--redis-url", redis_url, "--prefix", "vl", "--prompts-per-batch", "4", "--group-size", "2",
              "--max-lag", "0", "--device", "cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ENGINE_CORE_RUNS_MODEL}  # the actor's server
    learner = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "learner.py"), *common, "--sft-steps", "0", "--rl-steps", "2",
         "--eval-every", "0", "--logger", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    actor = subprocess.run(
        [sys.executable, str(EXAMPLES / "actor.py"), *common, "--actor-id", "v0", "--engine", "vllm-server",
         "--vllm-arg", "enforce_eager=true", "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    out, _ = learner.communicate(timeout=600)
    assert actor.returncode == 0, actor.stdout + actor.stderr[-3000:]
    assert learner.returncode == 0, out
    assert "done: 2 steps" in out and "'malformed': 0" in out, out
    pushed = int(re.search(r"\[actor v0\] pushed (\d+) items", actor.stdout).group(1))
    assert pushed >= 16, actor.stdout
    # the server received every version the actor saw (0, then the learner's steps), through its update path
    assert re.search(r"last policy version [12]\b", actor.stdout), actor.stdout
