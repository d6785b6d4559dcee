"""VLLMServerSampler against stand-in HTTP servers (no vLLM needed): requests spread over several servers
(request i on server i mod n), every push reloaded by all of them, URL lists checked, and the weight-transfer
choice ("nccl" refused where it cannot run, naming why; "auto" falls back to the reload path)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _at_exit import rmtree_at_exit
from safetensors.torch import save_file

from ludic_fast.rollout.sampler import SamplingConfig
from ludic_fast.rollout.vllm_server import VLLMServerSampler, split_urls
from ludic_fast.rollout.weight_transfer import nccl_transfer_unavailable


class FakeServer:
    """Answers /v1/models (model `name`), /v1/completions (token ids = [server index, prompt length]) and the
    reload endpoints; `calls` records (path, body)."""

    def __init__(self, index: int, name: str = "tiny"):
        self.calls: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._answer({"data": [{"id": name}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.calls.append((self.path, body))
                if self.path == "/v1/completions":
                    ids = [index, len(body["prompt"])]
                    self._answer({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5, -0.25]}}]})
                else:
                    self._answer({})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # shutdown() waits for the loop's next poll: 0.5 s by default, per server
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"model.w": torch.zeros(2)}, tmp_path / "model.safetensors")
    return str(tmp_path)


@pytest.fixture
def servers():
    pair = [FakeServer(0), FakeServer(1)]
    yield pair
    for s in pair:
        s.close()


def test_requests_are_spread_over_the_servers_and_pushes_reach_all(servers, checkpoint, tmp_path):
    a, b = servers
    sampler = VLLMServerSampler(f"{a.url},{b.url}/", eos_token_id=2, checkpoint=checkpoint,
                                weights_dir=str(tmp_path / "pushes"))
    assert sampler.urls == [a.url, b.url] and sampler.weight_transfer == "reload"
    prompts = [[5] * n for n in range(1, 6)]  # prompt i has length i + 1
    out = sampler.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=2), seed=3)
    assert [c.completion_ids for c in out] == [[0, 1], [1, 2], [0, 3], [1, 4], [0, 5]]  # request i on server i % 2
    assert sorted(len(body["prompt"]) for _, body in a.calls) == [1, 3, 5]
    assert sorted(len(body["prompt"]) for _, body in b.calls) == [2, 4]
    a.calls.clear()
    b.calls.clear()
    sampler.publish({"module.model.w": torch.ones(2)}, version=4)
    target = str(tmp_path / "pushes" / "v4")
    for server in (a, b):
        assert [p for p, _ in server.calls] == ["/collective_rpc", "/reset_prefix_cache"]
        assert server.calls[0][1]["kwargs"] == {"weights_path": target}
    assert sampler.version == 4


def test_servers_of_different_models_are_refused(checkpoint):
    a, b = FakeServer(0, "tiny"), FakeServer(1, "other")
    try:
        with pytest.raises(ValueError, match="different models"):
            VLLMServerSampler([a.url, b.url], eos_token_id=2, checkpoint=checkpoint)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("bad, match", [("", "one or more"), ("http://a:1,,http://b:2", "one or more"),
                                        ("a:1", "not an http"), (["http://a:1", "http://a:1/"], "twice")])
def test_split_urls_refuses_bad_lists(bad, match):
    with pytest.raises(ValueError, match=match):
        split_urls(bad)


def test_split_urls_accepts_a_list_or_commas():
    assert split_urls(" http://a:1/ , https://b:2") == ["http://a:1", "https://b:2"]
    assert split_urls(["http://a:1"]) == ["http://a:1"]


@pytest.mark.skipif(nccl_transfer_unavailable() is None, reason="the NCCL path can run here (GPUs + vLLM)")
def test_nccl_is_refused_naming_why_and_auto_reloads(servers, checkpoint):
    reason = nccl_transfer_unavailable()
    assert reason is not None and ("no CUDA" in reason or "not installed" in reason)
    with pytest.raises(ValueError, match=re.escape(f"weight_transfer='nccl': {reason}")):
        VLLMServerSampler(servers[0].url, eos_token_id=2, checkpoint=checkpoint, weight_transfer="nccl")
    auto = VLLMServerSampler(servers[0].url, eos_token_id=2, checkpoint=checkpoint, weight_transfer="auto")
    assert auto.weight_transfer == "reload" and auto.pushers == []
    with pytest.raises(ValueError, match="weight_transfer must be"):
        VLLMServerSampler(servers[0].url, eos_token_id=2, checkpoint=checkpoint, weight_transfer="ipc")


def test_nccl_address_is_refused_beside_reload(servers, checkpoint):
    """The NCCL rendezvous address means nothing to the reload path: refused there, not ignored."""
    with pytest.raises(ValueError, match="nccl_address is read only with weight_transfer='nccl' or 'auto'"):
        VLLMServerSampler(servers[0].url, eos_token_id=2, checkpoint=checkpoint, nccl_address="10.0.0.1")


def test_the_default_weights_folder_goes_at_exit_and_a_given_one_stays(servers, checkpoint, tmp_path, monkeypatch):
    """Each reload push leaves the last version's weights in weights_dir (a model's size): the temporary folder
    the sampler makes itself is removed at exit; a folder the caller gave is theirs and stays."""
    removals = rmtree_at_exit(monkeypatch)
    urls = [s.url for s in servers]
    own = VLLMServerSampler(urls, eos_token_id=1, checkpoint=checkpoint)
    own.publish({"model.w": torch.ones(2)}, version=1)
    given = VLLMServerSampler(urls, eos_token_id=1, checkpoint=checkpoint, weights_dir=str(tmp_path / "mine"))
    given.publish({"model.w": torch.ones(2)}, version=1)
    assert (own.weights_dir / "v1" / "model.safetensors").is_file() and len(removals) == 1
    for a, k in removals:
        shutil.rmtree(*a, **k)
    assert not own.weights_dir.exists() and (tmp_path / "mine" / "v1" / "model.safetensors").is_file()
