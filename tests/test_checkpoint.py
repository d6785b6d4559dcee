"""Checkpoints: layout, max_to_keep, weights + optimizer round trip, fallbacks, no unpickling, exact resume."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager, optimizer_from_flat, optimizer_to_flat
from ludic_fast.trainer import Trainer, TrainerConfig


def _model_and_opt():
    model = tiny_model()
    model.register_buffer("custom_buffer", torch.arange(3.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    opt.step()
    return model, opt


def test_layout_and_trainer_state(tmp_path):
    model, opt = _model_and_opt()
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), every_n_steps=1))
    path = mgr.save(model, opt, step=1, metadata={"algorithm": "cispo"})
    names = {p.name for p in path.iterdir()}
    expected = {"model.safetensors", "config.json", "optimizer.safetensors", "optimizer.json", "trainer_state.json"}
    assert expected <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl"))]
    state = json.loads((path / "trainer_state.json").read_text())
    assert state == {"step": 1, "algorithm": "cispo"}
    assert json.loads((tmp_path / "latest.json").read_text()) == {"last_checkpoint": "step_000001", "step": 1}


def test_max_to_keep_and_maybe_save(tmp_path):
    model, opt = _model_and_opt()
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), every_n_steps=2, max_to_keep=1))
    for step in (1, 2, 3, 4):
        mgr.maybe_save(model, opt, step=step)
    assert [p.name for _, p in mgr.checkpoints()] == ["step_000004"]
    mgr.save(model, opt, step=5)
    assert [p.name for _, p in mgr.checkpoints()] == ["step_000005"]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 5
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointConfig(str(tmp_path), max_to_keep=0)


def test_round_trip_weights_optimizer_buffer_without_unpickling(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path)))
    mgr.save(model, opt, step=7, tensors={"rng": torch.get_rng_state()})
    fresh = tiny_model(seed=3)
    fresh.register_buffer("custom_buffer", torch.zeros(3))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)

    def no_unpickling(*a, **k):
        raise AssertionError("checkpoint loading must not unpickle")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    state = mgr.load(fresh, fresh_opt, step=7)
    assert state["step"] == 7 and torch.equal(state["tensors"]["rng"], torch.get_rng_state())
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict(), fresh_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid in sa["state"]:
        for k, v in sa["state"][pid].items():
            assert torch.equal(v, sb["state"][pid][k])


def test_optimizer_flat_round_trip():
    _, opt = _model_and_opt()
    tensors, rest = optimizer_to_flat(opt.state_dict())
    json.dumps(rest)  # JSON-serialisable
    back = optimizer_from_flat(tensors, json.loads(json.dumps(rest)))
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    assert set(back["state"]) == set(opt.state_dict()["state"])


def test_resolution_fallbacks_and_stale_temp_dirs(tmp_path):
    model, opt = _model_and_opt()
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), max_to_keep=None))
    assert mgr.resolve() is None and mgr.load(model) == {"step": 0}
    mgr.save(model, opt, step=1)
    mgr.save(model, opt, step=2)
    (tmp_path / ".tmp-step_000003-x").mkdir()  # a write killed before its rename
    (tmp_path / "latest.json").write_text(json.dumps({"last_checkpoint": "step_000009", "step": 9}))
    assert mgr.resolve().name == "step_000002"  # latest.json points nowhere: highest complete step
    mgr.save(model, opt, step=3)
    assert not list(tmp_path.glob(".tmp-*"))
    assert mgr.resolve().name == "step_000003"
    with pytest.raises(FileNotFoundError):
        mgr.resolve(step=42)


class StatefulSource(ListSource):
    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _trainer(tmp_path, resume=None):
    items = make_items(12, seed=21)
    src = StatefulSource([items[:4], items[4:8], items[8:]])
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=32,
                        lr=1e-2, lr_scheduler="cosine", warmup_steps=1, total_steps=6)
    return Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=src, cfg=cfg,
                   checkpoint_config=CheckpointConfig(str(tmp_path), every_n_steps=2), resume_from=resume)


def test_resume_continues_exactly(tmp_path):
    full = _trainer(tmp_path / "a")
    losses = [s["train/loss"] for s in full.train_sync(5)]
    first = _trainer(tmp_path / "b")
    first.train_sync(3)  # checkpoints at steps 2 (kept) — step 3 is lost with the process
    resumed = _trainer(tmp_path / "b", resume="latest")
    assert resumed.step_idx == 2 and resumed.batch_source.i == 2
    again = [s["train/loss"] for s in resumed.train_sync(3)]
    assert again == losses[2:]
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_tied_embeddings_round_trip(tmp_path):
    from _trainer_fixtures import SMALL, TOKENIZER

    from ludic_fast.embedded import build_tiny_model

    model = build_tiny_model(len(TOKENIZER), tie_word_embeddings=True, **SMALL)
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path)))
    mgr.save(model, None, step=1)
    fresh = build_tiny_model(len(TOKENIZER), seed=5, tie_word_embeddings=True, **SMALL)
    mgr.load(fresh)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
