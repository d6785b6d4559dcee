"""Sharded (torch.distributed.checkpoint) checkpoints on 2 gloo ranks (CPU, forked ranks): a checkpoint written by
FSDP2 or DDP ranks loads in one process and the reverse, model, optimizer state and a parameter outside the model
equal to the writer's; RNG per rank; the Hugging Face export of an FSDP2 model is the full model."""

from __future__ import annotations

import json

import pytest
import torch

from ludic_fast.distributed.launch import wrap_model
from ludic_fast.distributed.local import run_local_group
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.run.checkpoint import CheckpointConfig
from ludic_fast.run.sharded_checkpoint import ShardedCheckpointManager, export_hf

pytestmark = pytest.mark.timeout(120)
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


def _setup(seed: int):
    """A tiny model, a value head beside it and AdamW over both after one step on a fixed batch."""
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=seed, **SMALL)
    head = torch.nn.Linear(16, 1)
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.weight)
    return model, head


def _train_once(model, head) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-2)
    ids = torch.arange(2, 14).reshape(2, 6)
    h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    (head(h).sum() + model(input_ids=ids).logits.square().mean()).backward()
    opt.step()
    return opt


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _flat_state(model, head, opt) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment by parameter name (whole tensors)."""
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()] + ["head.weight", "head.bias"]
    params = [*model.parameters(), *head.parameters()]
    out = {}
    for name, p in zip(names, params):
        out[name] = _full(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if p in opt.state:
                out[f"{name}.{key}"] = _full(opt.state[p][key])
    return out


def _save_worker(rank: int, world: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    model, head = _setup(seed=0)
    wrapped = wrap_model(model, mode, "cpu")
    opt = _train_once(wrapped, head)
    torch.manual_seed(100 + rank)
    mgr = ShardedCheckpointManager(CheckpointConfig(out), extra=list(head.parameters()))
    mgr.save(wrapped, opt, step=3, metadata={"data": [1, 2]},
             tensors={"rng.torch_cpu": torch.get_rng_state(), "ref.w": torch.ones(2)})
    torch.save(_flat_state(model, head, opt), f"{out}/expected_rank{rank}.pt")


def _load_worker(rank: int, world: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    model, head = _setup(seed=5)
    wrapped = wrap_model(model, mode, "cpu")
    opt = _train_once(wrapped, head)  # states exist, then are overwritten
    state = ShardedCheckpointManager(CheckpointConfig(out), extra=list(head.parameters())).load(wrapped, opt)
    assert state["step"] == 3 and state["data"] == [1, 2]
    expected = torch.load(f"{out}/expected.pt", weights_only=True)
    got = _flat_state(model, head, opt)
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0,
                                   msg=lambda m, k=k: f"{mode} rank {rank}: {k}: {m}")


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_two_ranks_save_one_process_loads(tmp_path, mode):
    run_local_group(_save_worker, 2, mode, str(tmp_path), start_method="fork")
    expected = torch.load(tmp_path / "expected_rank0.pt", weights_only=True)
    # both ranks hold the same whole state
    for k, v in torch.load(tmp_path / "expected_rank1.pt", weights_only=True).items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)
    ckpt = tmp_path / "step_000003"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    assert {"rng_rank0.safetensors", "rng_rank1.safetensors", "tensors.safetensors"} <= {p.name for p in ckpt.iterdir()}
    model, head = _setup(seed=5)
    opt = _train_once(model, head)
    state = ShardedCheckpointManager(CheckpointConfig(str(tmp_path)), extra=list(head.parameters())).load(model, opt)
    assert state["step"] == 3 and state["data"] == [1, 2]
    torch.testing.assert_close(state["tensors"]["ref.w"], torch.ones(2))
    torch.manual_seed(100)
    torch.testing.assert_close(state["tensors"]["rng.torch_cpu"], torch.get_rng_state())  # rank 0's generator
    got = _flat_state(model, head, opt)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_one_process_save_two_fsdp2_ranks_load(tmp_path):
    model, head = _setup(seed=0)
    opt = _train_once(model, head)
    ShardedCheckpointManager(CheckpointConfig(str(tmp_path)), extra=list(head.parameters())).save(
        model, opt, step=3, metadata={"data": [1, 2]})
    torch.save(_flat_state(model, head, opt), tmp_path / "expected.pt")
    run_local_group(_load_worker, 2, "fsdp2", str(tmp_path), start_method="fork")


def _export_worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    model, _ = _setup(seed=0)
    written = export_hf(wrap_model(model, "fsdp2", "cpu"), out)
    assert (written is not None) == (rank == 0)


def test_hf_export_of_an_fsdp2_model_is_the_whole_model(tmp_path):
    from transformers import AutoModelForCausalLM

    run_local_group(_export_worker, 2, str(tmp_path / "hf"), start_method="fork")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    model, _ = _setup(seed=0)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_load_refuses_a_whole_model_checkpoint(tmp_path):
    from ludic_fast.run.checkpoint import CheckpointManager

    model, _ = _setup(seed=0)
    CheckpointManager(CheckpointConfig(str(tmp_path))).save(model, None, step=1)
    with pytest.raises(ValueError, match="not a sharded"):
        ShardedCheckpointManager(CheckpointConfig(str(tmp_path))).load(model)
