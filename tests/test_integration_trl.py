"""FastGRPOTrainer (ludic_fast.integrations.trl) against stock TRL 1.16 GRPOTrainer on CPU with a tiny model:
loss, gradients and metrics on a fixed batch for every loss_type and option; a 3-step run; the entropy
bonus and top-entropy masking against hand-written formulas on the model's own logits."""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl not installed")
datasets = pytest.importorskip("datasets", reason="datasets not installed")

from ludic_fast.embedded import build_char_tokenizer, build_tiny_model  # noqa: E402
from ludic_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
B, P, C = 4, 5, 6


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(cls, model, tok, tmp_path, **overrides):
    cfg = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B, max_completion_length=C,
        report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
        logging_steps=1, beta=0.0, temperature=0.8,
    )
    peft_config = overrides.pop("peft_config", None)
    cfg.update(overrides)
    ds = datasets.Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])
    return cls(model=model, reward_funcs=_reward, args=trl.GRPOConfig(**cfg), train_dataset=ds, processing_class=tok,
               peft_config=peft_config)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), hidden_size=32, intermediate_size=64, tie_word_embeddings=True).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peakier distributions: entropies spread out, ratios move
    return model


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    completion_ids = torch.randint(4, vocab, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0  # right padding
    completion_mask[2, :] = 0  # a truncated completion under mask_truncated_completions: no loss tokens
    tool_mask = torch.ones(B, C, dtype=torch.long)
    tool_mask[3, 1:3] = 0
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "num_items_in_batch": completion_mask.sum() * 2,
        "tool_mask": tool_mask,
    }


def _with_logps(batch, stock, model, noise_seed=11):
    """old / ref / sampling logps and vLLM IS ratios around the model's current logps (so ratios clip)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        lp, _, _ = stock._get_per_token_logps_and_entropies(model, ids, am, C)
    g = torch.Generator().manual_seed(noise_seed)
    noise = lambda s: s * torch.randn(B, C, generator=g)  # noqa: E731
    return {
        **batch,
        "old_per_token_logps": lp + noise(0.3),
        "ref_per_token_logps": lp + noise(0.5),
        "sampling_per_token_logps": lp + noise(0.3),
        "importance_sampling_ratio": torch.exp(noise(0.2)).clamp(max=2.0),
    }


@pytest.fixture(scope="module")
def pair(base_model, tok, tmp_path_factory):
    """(stock trainer, fast trainer) on two identical copies of the tiny model."""
    tmp = tmp_path_factory.mktemp("trl")
    stock = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model), tok, tmp / "stock")
    fast = _trainer(FastGRPOTrainer, copy.deepcopy(base_model), tok, tmp / "fast")
    return stock, fast


def _configure(trainer, settings):
    args = copy.copy(trainer.args)
    trainer.args = args
    for key, value in settings.items():
        if key in ("use_vllm", "vllm_importance_sampling_correction", "loss_type", "importance_sampling_level",
                   "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", "epsilon_low",
                   "epsilon_high", "beta", "use_adaptive_entropy"):
            setattr(trainer, key, value)
        if hasattr(args, key):
            setattr(args, key, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.current_gradient_accumulation_steps = settings.get("ga", 2)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def _loss_and_grads(trainer, compute, inputs, train=True):
    model = trainer.model
    model.train(train)
    model.zero_grad(set_to_none=True)
    loss = compute(model, inputs)
    if train:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


BASE = dict(epsilon_low=0.2, epsilon_high=0.2, beta=0.0, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
            entropy_coef=0.0, use_vllm=False, vllm_importance_sampling_correction=False, delta=None,
            importance_sampling_level="token", use_adaptive_entropy=False)

CASES = {f"{lt}": dict(loss_type=lt) for lt in LOSS_TYPES}
CASES.update({
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "cispo_sequence": dict(loss_type="cispo", importance_sampling_level="sequence"),
    "dapo_delta_eps_high": dict(loss_type="dapo", delta=1.4, epsilon_high=0.28),
    "dapo_beta_kl": dict(loss_type="dapo", beta=0.04),
    "grpo_beta_kl_no_bias_correction": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=False),
    "cispo_vllm_is": dict(loss_type="cispo", epsilon_high=1.5, use_vllm=True, vllm_importance_sampling_correction=True),
    "vespo_is": dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=True),
    "dapo_off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "grpo_top_entropy": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "dapo_entropy_bonus": dict(loss_type="dapo", entropy_coef=0.03),
    "bnpo_top_entropy_bonus_kl": dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.05, beta=0.02),
    "grpo_adaptive_entropy": dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.02,
                                  entropy_target=10.0),
    "dapo_ga1": dict(loss_type="dapo", ga=1),
})


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_trainer_equals_stock_trl(pair, case):
    stock, fast = pair
    settings = {**BASE, **CASES[case]}
    for trainer in pair:
        _configure(trainer, settings)
        if trainer.use_adaptive_entropy:
            trainer._last_world_entropy = 1.0  # below the target: the bonus applies
    inputs = _with_logps(_batch(stock.model.config.vocab_size), stock, stock.model)
    loss_s, grads_s = _loss_and_grads(stock, stock._compute_loss, inputs)
    loss_f, grads_f = _loss_and_grads(fast, fast.compute_loss, inputs)
    assert math.isfinite(float(loss_s)) and abs(float(loss_s)) > 1e-4
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_s.keys()
    for name, g in grads_s.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=name)
    metrics_s, metrics_f = stock._metrics["train"], fast._metrics["train"]
    assert set(metrics_f) == set(metrics_s)
    for key, values in metrics_s.items():
        assert metrics_f[key] == pytest.approx(values, rel=1e-4, abs=1e-6, nan_ok=True), key
    if settings["use_adaptive_entropy"]:
        assert fast.entropy_coef == pytest.approx(stock.entropy_coef)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo_sequence"])
def test_fast_trainer_eval_mode_equals_stock(pair, loss_type):
    stock, fast = pair
    settings = {**BASE, **CASES[loss_type]}
    for trainer in pair:
        _configure(trainer, settings)
    inputs = _with_logps(_batch(stock.model.config.vocab_size), stock, stock.model)
    with torch.no_grad():
        loss_s, _ = _loss_and_grads(stock, stock._compute_loss, inputs, train=False)
        loss_f, _ = _loss_and_grads(fast, fast.compute_loss, inputs, train=False)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
    assert fast._metrics["eval"]["entropy"] == pytest.approx(stock._metrics["eval"]["entropy"], rel=1e-5)


def _reference_terms(model, inputs, temperature):
    """lp, H [B, C] from the model's own logits (plain PyTorch)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, -C - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    H = -(logp.exp() * logp).sum(-1)
    return lp, H


def _grads_of(model, scalar):
    model.zero_grad(set_to_none=True)
    scalar.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_entropy_bonus_changes_the_gradient_by_coef_times_grad_mean_entropy(pair):
    """grad(loss with coef c) - grad(loss with coef 0) = -c * grad(sum H m / sum m) / GA."""
    _, fast = pair
    inputs = _with_logps(_batch(fast.model.config.vocab_size), fast, fast.model)
    coef, ga = 0.5, 2
    grads = {}
    for c in (0.0, coef):
        _configure(fast, {**BASE, "loss_type": "dapo", "entropy_coef": c, "ga": ga})
        grads[c] = _loss_and_grads(fast, fast.compute_loss, inputs)[1]
    fast.model.train()
    _, H = _reference_terms(fast.model, inputs, fast.temperature)
    m = (inputs["completion_mask"] * inputs["tool_mask"]).float()
    expected = _grads_of(fast.model, -coef * (H * m).sum() / m.sum() / ga)
    for name, g in expected.items():
        torch.testing.assert_close(grads[coef][name] - grads[0.0][name], g, rtol=1e-3, atol=1e-6, msg=name)


def test_top_entropy_masking_keeps_only_high_entropy_tokens(pair):
    """cispo with top_entropy_quantile q: the gradient is that of the loss over tokens with H >= quantile(1-q)."""
    _, fast = pair
    inputs = _with_logps(_batch(fast.model.config.vocab_size), fast, fast.model)
    q, ga = 0.3, 1
    _configure(fast, {**BASE, "loss_type": "cispo", "epsilon_high": 5.0, "top_entropy_quantile": q, "ga": ga})
    _, grads = _loss_and_grads(fast, fast.compute_loss, inputs)
    fast.model.train()
    lp, H = _reference_terms(fast.model, inputs, fast.temperature)
    m = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    threshold = torch.quantile(H.detach()[m], 1 - q)
    keep = (m & (H.detach() >= threshold)).float()
    assert 0 < keep.sum() < m.sum()
    ratio = torch.exp(lp.detach() - inputs["old_per_token_logps"]).clamp(max=5.0)
    adv = inputs["advantages"][:, None]
    normaliser = inputs["num_items_in_batch"].float() * ga / fast.args.steps_per_generation
    expected = _grads_of(fast.model, (-ratio * adv * lp * keep).sum() / normaliser)
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-6, msg=name)


def test_multimodal_inputs_are_rejected(pair):
    _, fast = pair
    _configure(fast, {**BASE, "loss_type": "dapo"})
    inputs = {**_batch(fast.model.config.vocab_size), "pixel_values": torch.zeros(1)}
    with pytest.raises(ValueError, match="multimodal"):
        fast.compute_loss(fast.model, inputs)


def test_three_step_training_run(base_model, tok, tmp_path):
    """TRL's own generation, a reference model for the KL term (loaded from a saved copy), 3 optimizer steps."""
    base_model.save_pretrained(tmp_path / "model")
    trainer = _trainer(FastGRPOTrainer, str(tmp_path / "model"), tok, tmp_path, max_steps=3, learning_rate=1e-2,
                       loss_type="dapo", entropy_coef=0.01, beta=0.02)
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["entropy"]) and "kl" in entry
    assert not torch.equal(trainer.model.lm_head.weight.detach(), before)


def test_fast_trainer_with_peft_lora_equals_stock(base_model, tok, tmp_path):
    """LoRA adapters through TRL's peft_config (the model is a PeftModel): same loss and adapter gradients."""
    peft = pytest.importorskip("peft", reason="peft not installed")
    trainers = []
    for cls in (trl.GRPOTrainer, FastGRPOTrainer):
        cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              init_lora_weights=False)
        torch.manual_seed(5)  # identical adapter init
        trainer = _trainer(cls, copy.deepcopy(base_model), tok, tmp_path / cls.__name__, peft_config=cfg)
        _configure(trainer, {**BASE, "loss_type": "cispo", "epsilon_high": 1.2})
        trainers.append(trainer)
    stock, fast = trainers
    inputs = _with_logps(_batch(stock.model.config.vocab_size), stock, stock.model)
    loss_s, grads_s = _loss_and_grads(stock, stock._compute_loss, inputs)
    loss_f, grads_f = _loss_and_grads(fast, fast.compute_loss, inputs)
    assert grads_s and all("lora" in n for n in grads_s)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_s.keys()
    for name, g in grads_s.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_example_trl_grpo_shows_a_gradient():
    """examples/trl_grpo.py: its graded reward varies within groups, so every step has a non-zero gradient."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.graded_sum_reward(" 12", "12") == 1.0 and example.graded_sum_reward("1a", "12") == 0.25
    steps = example.main(["--steps", "2"])
    assert len(steps) == 2
    assert all(s["grad_norm"] > 0 and s["reward_std"] > 0 for s in steps)
