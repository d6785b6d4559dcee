"""Server mode on a real vLLM (`make test`: .venv-vllm, vLLM's CPU build): VLLMServer starts vLLM's OpenAI server on
loopback for the SFT'd tiny Llama; VLLMServerEngine samples through it (distinct, reproducible seeded groups;
log-probs equal the model's log_softmax(z / T)) and pushes weights through its weight-update path (the engine
then scores with the new weights; wrong names are refused before anything is written)."""

from __future__ import annotations

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _vllm import ENGINE_CORE_RUNS_MODEL, EOS, needs_vllm, tiny_sft_model

from ludic_fast.rollout.engine import SamplingConfig
from ludic_fast.rollout.vllm_server import VLLMServer, VLLMServerEngine, VLLMServerSampler

TOL = 1e-4  # fp32 server vs the fp32 model, as in test_vllm_engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(engine on the first server, trainer-side model, prompts, checkpoint, the second server's URL): two servers
    of the saved SFT'd model, started at once (each start keeps about one core busy)."""
    needs_vllm()
    model, tok, prompts = tiny_sft_model()
    path = tmp_path_factory.mktemp("tiny_llama_served")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    args = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]

    def start(name: str) -> VLLMServer:
        return VLLMServer(str(path), extra_args=args, log_path=str(path / f"{name}.log"), env=ENGINE_CORE_RUNS_MODEL)

    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start, name) for name in ("server", "second")]
    with contextlib.ExitStack() as stack:
        first, second = (stack.enter_context(f.result()) for f in starts)  # a start that failed raises here
        for srv in (first, second):  # vLLM's IPC sockets in the server's own directory, not the temp dir
            assert any(p.is_socket() for p in Path(srv.ipc_dir).iterdir()), srv.ipc_dir
        engine = VLLMServerEngine(first.url, eos_token_id=EOS, checkpoint=str(path),
                                  weights_dir=str(tmp_path_factory.mktemp("pushes")))
        yield engine, model, prompts, str(path), second.url
    assert not any(Path(srv.ipc_dir).exists() for srv in (first, second))  # removed by close()


def _max_diff(model, completions, temperature: float) -> float:
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].double() / temperature
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0]
            worst = max(worst, float((torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max()))
    return worst


def test_server_samples_distinct_reproducible_groups_with_the_models_logprobs(server):
    engine, model, prompts, *_ = server
    group = [[7, 14]] * 8  # "3+": an uncertain continuation at T = 2 (see test_vllm_engine)
    sampling = SamplingConfig(temperature=2.0, max_new_tokens=12)
    first, again = engine.generate(group, sampling, seed=11), engine.generate(group, sampling, seed=11)
    texts = [tuple(c.completion_ids) for c in first]
    assert len(set(texts)) >= 5, texts
    assert texts == [tuple(c.completion_ids) for c in again]
    assert _max_diff(model, first, 2.0) < TOL
    greedy = engine.generate(prompts[:8], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert {c.finish_reason for c in greedy} == {"stop"} and all(c.completion_ids[-1] == EOS for c in greedy)
    assert _max_diff(model, greedy, 1.0) < TOL


def test_server_weight_push_switches_to_the_new_weights_and_refuses_wrong_names(server):
    engine, model, prompts, *_ = server
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    with pytest.raises(ValueError, match="is not a tensor of the served checkpoint"):
        engine.publish({"module.module." + k: v for k, v in new.named_parameters()}, version=1)
    assert engine.version == 0 and not list(engine.weights_dir.glob("v*"))
    try:
        engine.publish({"module." + k: v for k, v in new.named_parameters()}, version=1)  # DDP names
        completions = engine.generate(prompts[:12], sampling, seed=2)
        assert _max_diff(new, completions, 1.0) < TOL
        assert _max_diff(model, completions, 1.0) > 1e-2
        assert engine.version == 1 and [p.name for p in engine.weights_dir.glob("v*")] == ["v1"]
    finally:
        engine.publish(dict(model.named_parameters()), version=2)
    assert _max_diff(model, engine.generate(prompts[:8], sampling, seed=2), 1.0) < TOL


def test_two_servers_spread_the_requests_and_both_take_a_push(server, tmp_path):
    """The module's second server beside the first: a seeded call over both samples what it samples on one
    (request i keeps its seed, and the servers hold the same weights), and a push reaches both."""
    engine, model, prompts, checkpoint, second = server
    both = VLLMServerSampler([engine.url, second], eos_token_id=EOS, checkpoint=checkpoint,
                             weights_dir=str(tmp_path / "pushes"))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    spread = both.generate(prompts[:6], sampling, seed=5)
    assert [c.completion_ids for c in spread] == [c.completion_ids for c in engine.generate(prompts[:6], sampling,
                                                                                              seed=5)]
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.1)
    try:
        both.publish(dict(new.named_parameters()), version=3)
        for url in both.urls:  # each server alone now samples from the new weights
            alone = VLLMServerSampler(url, eos_token_id=EOS, checkpoint=checkpoint)
            assert _max_diff(new, alone.generate(prompts[:4], sampling, seed=2), 1.0) < TOL
    finally:
        both.publish(dict(model.named_parameters()), version=4)


def test_nccl_weight_transfer_switches_the_servers_weights(tmp_path):
    """vLLM's weight-transfer API over NCCL: the trainer on GPU 0, a server on GPU 1 (NCCL refuses two ranks on
    one device). Skips where it cannot run: on vLLM's CPU build there is no CUDA."""
    from ludic_fast.rollout.weight_transfer import nccl_transfer_unavailable

    reason = nccl_transfer_unavailable()
    if reason is not None:
        pytest.skip(f"NCCL weight transfer cannot run here: {reason}")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL weight transfer needs 2 GPUs (trainer, server); {torch.cuda.device_count()} visible")
    needs_vllm()
    model, tok, prompts = tiny_sft_model()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    args = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--gpu-memory-utilization", "0.2",
            "--weight-transfer-config", '{"backend": "nccl"}']
    with VLLMServer(str(tmp_path / "m"), extra_args=args, env={"CUDA_VISIBLE_DEVICES": "1"},
                    log_path=str(tmp_path / "server.log")) as srv:
        torch.cuda.set_device(0)
        engine = VLLMServerSampler(srv.url, eos_token_id=EOS, checkpoint=str(tmp_path / "m"), weight_transfer="nccl")
        assert engine.weight_transfer == "nccl"
        new = copy.deepcopy(model)
        with torch.no_grad():
            for p in new.parameters():
                p.mul_(1.1)
        engine.publish({"module." + k: v.cuda() for k, v in new.named_parameters()}, version=1)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
        completions = engine.generate(prompts[:8], sampling, seed=2)
        assert _max_diff(new, completions, 1.0) < 1e-3  # fp32 on a GPU (TF32 off by default in vLLM's fp32 path)
        assert _max_diff(model, completions, 1.0) > 1e-2


def test_the_nccl_paths_routes_and_weight_source_match_the_installed_vllm(server):
    """What the NCCL path can be checked against on a CPU: every route HTTPControl calls is one of vLLM's RL
    routes, the real server answers /get_world_size (1 worker), and the push's WeightSource satisfies vLLM's
    contract (metadata and iteration agree, vLLM's own iter_groups walks every tensor once, in order)."""
    from vllm.entrypoints.rl.online.api_router import router

    from ludic_fast.rollout.vllm_sampler import map_weights_for_vllm
    from ludic_fast.rollout.weight_transfer import ROUTES, HTTPControl, _dict_source_class

    engine, model, *_ = server
    assert set(ROUTES) <= {r.path for r in router.routes}
    assert HTTPControl(engine.url, timeout=60).world_size() == 1
    source = _dict_source_class()()
    source.weights = map_weights_for_vllm(dict(model.named_parameters()))
    names = list(source.weights)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [
        (n, t.dtype, tuple(t.shape)) for n, t in source.weights.items()]
    walked = [n for group, tensors in source.iter_groups() for n in group]
    assert walked == names and set(names) == engine.checkpoint_names
