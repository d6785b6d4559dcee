"""Trainer: Ludic's trainer cases on a tiny Llama, the fused gradient against the
reference loss on the model's logits, non-finite steps skipped bit-identically, LR schedule, reference model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _trainer_fixtures import TOKENIZER, ListSource, make_items, tiny_model

from ludic_fast import reference
from ludic_fast.algorithm import RLAlgorithm, make_cispo, make_dapo, make_scalerl, make_sft
from ludic_fast.data.batching import collate_saw_items, group_index_of
from ludic_fast.data.credit import ConstantCredit
from ludic_fast.data.types import SAWBatch
from ludic_fast.losses import CISPOLoss
from ludic_fast.run.stats import default_reducers
from ludic_fast.trainer import Trainer, TrainerConfig, lr_lambda


def _cfg(**kw) -> TrainerConfig:
    base = dict(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=64, lr=1e-2)
    base.update(kw)
    return TrainerConfig(**base)


def _trainer(items, algo=None, **kw) -> Trainer:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in TrainerConfig.__dataclass_fields__}
    return Trainer(model=tiny_model(), algo=algo or make_cispo(group_size=1), batch_source=ListSource([items]),
                   cfg=_cfg(**cfg_kw), **kw)


class _Publisher:
    def __init__(self):
        self.calls = []

    def publish(self, params, version):
        self.calls.append((set(params), version))


# ------------------------------------------------------------------------------------- validation
def test_config_validation():
    with pytest.raises(ValueError, match="micro_token_budget"):
        _cfg(micro_token_budget=4, max_seq_len=5)
    with pytest.raises(ValueError, match="pad_token_id"):
        TrainerConfig(model_device="cpu")
    assert TrainerConfig(model_device="cpu", pad_token_id=TOKENIZER).pad_token_id == TOKENIZER.pad_token_id
    with pytest.raises(ValueError, match="total_steps"):
        _cfg(lr_scheduler="cosine")
    assert _cfg(memory_budget="512MiB").memory_budget == 512 * 2**20
    with pytest.raises(ValueError, match="memory_budget"):
        _cfg(memory_budget="big")
    with pytest.raises(ValueError, match="PolicyPublisher"):
        Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([[]]),
                cfg=_cfg(sync_every_steps=1))


# ------------------------------------------------------------------------------ gradient == reference
# The step's gradient (split into micro-batches) vs reference CISPO on the full logits is
# tests/gpu/test_gpu_trainer.py::test_step_gradient_equals_reference_loss_on_logits (CPU variant in `make test`).


def test_micro_batch_split_does_not_change_gradient():
    items = make_items(6, seed=2)
    grads = []
    for budget in (10, 60):
        trainer = _trainer(items, micro_token_budget=budget, max_seq_len=10)
        trainer.accumulate_gradients(SAWBatch(items=list(items)))
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("make", [make_dapo, make_scalerl], ids=["dapo_token_mean", "scalerl_prompt_mean"])
def test_token_and_prompt_means_are_macro_batch_means_under_any_split(make):
    """DAPO's token mean and ScaleRL's prompt mean over the whole step, however the length sort splits the
    items (and their prompts) into micro-batches: the gradient equals the one-micro-batch gradient and the
    reference loss on the full batch's logits."""
    items = make_items(9, seed=5, groups=3)
    algo = make(group_size=3)
    grads = []
    for budget in (10, 90):
        trainer = _trainer(items, algo=algo, micro_token_budget=budget, max_seq_len=10)
        _, _, sizes, _ = trainer.accumulate_gradients(SAWBatch(items=list(items)))
        assert (len(sizes) > 2) == (budget == 10)
        grads.append({n: p.grad for n, p in trainer.model.named_parameters()})
    ref_model = tiny_model()
    batch = collate_saw_items(items, pad_token_id=0, group_index=group_index_of(items))
    logits = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref_loss = {"dapo": reference.TokenSurrogateLoss("ppo", 0.2, 0.28, aggregation="token_mean"),
                "scalerl": reference.ScaleRLLoss(eps_max=4.0)}[algo.name]
    ref_loss(batch, logits=logits)[0].backward()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(grads[0][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------- non-finite steps
def test_nan_batch_skips_step_and_leaves_weights_bit_identical():
    items = make_items(4, seed=3)

    def poison(batch: SAWBatch) -> SAWBatch:
        bad = copy.copy(batch.items[1])
        bad.weight = float("nan")  # after construction: bypasses SAWItem's finiteness check
        batch.items[1] = bad
        return batch

    algo = RLAlgorithm("poisoned", ConstantCredit(1.0), CISPOLoss(), poison)
    trainer = _trainer(items, algo=algo)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    opt_before = copy.deepcopy(trainer.optimizer.state_dict())
    stats = trainer.train_step_sync()
    assert stats["train/step_skipped"] == 1.0 and stats["train/skipped_steps"] == 1.0
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert trainer.optimizer.state_dict()["state"] == opt_before["state"] == {}
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.scheduler.last_epoch == 0
    # the next clean batch trains normally
    algo.preprocess = None
    stats = trainer.train_step_sync()
    assert stats["train/step_skipped"] == 0.0 and stats["train/skipped_steps"] == 1.0
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_non_finite_gradient_with_finite_loss_is_skipped():
    trainer = _trainer(make_items(3, seed=13))
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    handle = trainer.model.lm_head.weight.register_hook(lambda g: g * float("inf"))
    stats = trainer.train_step_sync()
    handle.remove()
    assert stats["train/step_skipped"] == 1.0 and math.isfinite(stats["train/loss"])
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


# ------------------------------------------------------------------------------ Ludic trainer cases
def test_truncated_item_trains_and_reducer_counts_it():
    items = make_items(1, seed=4)
    items[0] = make_items(1, seed=4)[0]
    long = make_items(1, seed=5)[0]
    long.input_ids, long.attention_mask = long.input_ids + [5] * 8, long.attention_mask + [1] * 8
    long.action_mask = long.action_mask + [1] * 8
    long.attachments.actor_logps.token_logps.extend([-3.0] * 8)
    trainer = _trainer([long], max_seq_len=8, micro_token_budget=16, reducers=default_reducers())
    stats = trainer.train_step_sync()
    assert "train/loss" in stats
    assert stats["train/seq_len_truncated_rate"] == 1.0


def test_max_lag_drops_stale_items():
    class MeanWeight:
        def __call__(self, batch, **kw):
            w = batch["weight"].mean()
            h = kw["hidden"]
            return (h.sum() * 0.0 + w), {"loss": w.detach()}

    stale, fresh = make_items(2, seed=6)
    stale.meta["policy_version"], stale.weight = -1, 3.0
    fresh.meta["policy_version"], fresh.weight = 0, 1.0
    trainer = _trainer([stale, fresh], algo=RLAlgorithm("m", ConstantCredit(1.0), MeanWeight()), max_lag=0)
    assert trainer.train_step_sync()["train/loss"] == pytest.approx(1.0)


def test_item_weighted_stats_across_micro_batches():
    """Ludic's integration case: lengths [1,1,1,5]-like chunks [3 items, 1 item] with loss = mean(weight)."""

    class MeanWeight:
        def __call__(self, batch, **kw):
            w = batch["weight"].mean()
            return kw["hidden"].sum() * 0.0 + w, {"loss": w.detach()}

    items = make_items(4, seed=7)
    for it in items[:3]:
        it.input_ids, it.attention_mask, it.action_mask = it.input_ids[:3], [1] * 3, [0, 1, 1]
        it.attachments.actor_logps = None
        it.weight = 3.0
    items[3].input_ids = items[3].input_ids[:2] + [7, 8, 9, 10, 11, 12, 13]
    items[3].attention_mask, items[3].action_mask = [1] * 9, [0, 0] + [1] * 7
    items[3].attachments.actor_logps, items[3].weight = None, 1.0
    trainer = _trainer(items, algo=RLAlgorithm("m", ConstantCredit(1.0), MeanWeight()), micro_token_budget=9,
                       max_seq_len=9)
    assert trainer.train_step_sync()["train/loss"] == pytest.approx((3 * 3 + 1 * 1) / 4)


def test_preprocess_runs_and_params_change():
    calls = []

    def four(batch):
        calls.append(1)
        for it in batch.items:
            it.weight = 4.0
        return batch

    algo = make_sft()
    algo.preprocess = four
    trainer = _trainer(make_items(3, seed=8), algo=algo)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step_sync()
    assert calls
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_publish_every_two_steps_with_filter():
    pub = _Publisher()
    trainer = _trainer(make_items(3, seed=9), publisher=pub, sync_every_steps=2)
    trainer.train_step_sync()
    assert pub.calls == []
    trainer.train_step_sync()
    assert len(pub.calls) == 1 and pub.calls[0][1] == 2
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= pub.calls[0][0]
    pub2 = _Publisher()
    filtered = _trainer(make_items(3, seed=9), publisher=pub2, sync_every_steps=1,
                        param_filter=lambda name, t: name == "model.embed_tokens.weight")
    filtered.train_step_sync()
    assert pub2.calls[0][0] == {"model.embed_tokens.weight"}


# ---------------------------------------------------------------------------------------- schedules
def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(_cfg(lr_scheduler="cosine", warmup_steps=2, total_steps=6))
    assert [round(f(s), 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    lin = lr_lambda(_cfg(lr_scheduler="linear", total_steps=4))
    assert [lin(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


# ---------------------------------------------------------------------------------- reference model
def test_reference_logps_match_reference_head_and_reset():
    items = make_items(3, seed=10)
    ref = tiny_model(seed=1)
    trainer = _trainer(items, ref_model=ref, kl_target=1e-9, algo=make_cispo(group_size=1, kl_coeff=0.1))
    batch = collate_saw_items(items, pad_token_id=0)
    got = trainer.reference_logps(batch)
    with torch.no_grad():
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = torch.zeros_like(got)
    want[:, 1:] = reference.compute_token_logp(logits, batch["input_ids"]) * batch["action_mask"][:, 1:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    stats = trainer.train_step_sync()  # KL of behaviour vs ref > 1e-9: the reference is reset to the policy
    assert stats["train/ref_resets"] == 1.0
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), trainer.ref_model.named_parameters()):
        assert torch.equal(p, q), n


def test_mix_reset_and_entropy_floor():
    ref = tiny_model(seed=1)
    trainer = _trainer(make_items(2, seed=11), ref_model=ref, entropy_floor=100.0, ref_reset="mix", ref_mix_alpha=0.25)
    ref0 = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.reset_reference()
    for n, p in trainer.ref_model.named_parameters():
        policy = dict(trainer.model.named_parameters())[n]
        torch.testing.assert_close(p, 0.75 * ref0[n] + 0.25 * policy.detach())


# ------------------------------------------------------------------------------ model features
def test_gradient_checkpointing_and_lora_train():
    peft = pytest.importorskip("peft", reason="peft not installed")
    trainer = _trainer(make_items(3, seed=12), gradient_checkpointing=True,
                       lora_config=peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step_sync()
    assert stats["train/step_skipped"] == 0.0
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
