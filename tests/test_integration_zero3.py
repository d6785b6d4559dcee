"""DeepSpeed ZeRO-3 on a 2-process gloo group (DeepSpeed's CPU accelerator): the fused head reads a head weight
that ZeRO-3 partitions outside its module's forward. Through `call_head` the generic op (verl's fused
forward, which recomputes logits from W in backward) and the fused-loss op (Ludic's `compute_loss`, dW
formed in the forward) give every parameter the gradient of the unsharded model's own-logits loss,
averaged over the ranks' batches as ZeRO-3 averages them; with untied and tied heads and LoRA on lm_head.
And TRL end to end: FastGRPOTrainer under accelerate + ZeRO-3 takes the same training step as stock
GRPOTrainer under the same setup."""

from __future__ import annotations

import os

import pytest
import torch

from ludic_fast import losses, reference
from ludic_fast.distributed.local import run_local_group

pytest.importorskip("deepspeed", reason="deepspeed not installed")
transformers = pytest.importorskip("transformers", reason="transformers not installed")
peft = pytest.importorskip("peft", reason="peft not installed")

pytestmark = pytest.mark.timeout(600)
V = 89
WORLD = 2


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    """DeepSpeed picks its accelerator once, by probing CUDA, when a rank first imports it (with this module,
    before any worker code runs): name the CPU one in the environment the spawned ranks inherit."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _gloo_all_reduce() -> None:
    """In a rank, before DeepSpeed sets up its communication: no shared-memory all-reduce op. DeepSpeed compiles
    that op for CPU ranks (C++, about a minute) in every new environment; without it DeepSpeed all-reduces with
    torch.distributed (gloo here), which sums the same two ranks' gradients. These tests check our integration,
    not DeepSpeed's CPU kernels (GPU ranks use NCCL, never this op)."""
    import importlib

    # by module name: the attribute deepspeed.comm.torch is the torch package (deepspeed.comm re-exports it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _model(tied: bool, lora_head: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(5.0)
    if lora_head:
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
    return model


def _batch(rank: int) -> dict[str, torch.Tensor]:
    from test_integration_ludic import ludic_batch

    return ludic_batch(V, seed=10 + rank)


def _verl_objective(lp: torch.Tensor, ent: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss on per-position log p and H that weighs both (verl's rolled layout: position t scores t+1)."""
    mask = batch["action_mask"].roll(-1, -1)
    return ((lp * batch["weight"][:, None] + 0.3 * ent) * mask).sum() / mask.sum()


def _own_logits_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    if path == "ludic_cispo":
        return reference.CISPOLoss()(batch, logits=logits)[0]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["input_ids"].roll(-1, -1)[..., None]).squeeze(-1)
    return _verl_objective(lp, -(logp.exp() * logp).sum(-1), batch)


def _fused_loss(engine, batch: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    from ludic_fast.integrations import ludic as ludic_integration
    from ludic_fast.integrations import verl as verl_integration

    if path == "ludic_cispo":
        return ludic_integration.compute_loss(engine, losses.CISPOLoss(), batch)[0]
    verl_integration.patch_fused_forward(engine.module)
    try:
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], temperature=1.0)
    finally:
        verl_integration.unpatch_fused_forward(engine.module)
    return _verl_objective(out.log_probs, out.entropy, batch)


def _check(rank: int, tied: bool, lora_head: bool, path: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    single = _model(tied, lora_head)
    for r in range(WORLD):  # ZeRO-3 averages the ranks' gradients
        (_own_logits_loss(single, _batch(r), path) / WORLD).backward()
    want = {n: p.grad for n, p in single.named_parameters() if p.requires_grad}

    model = _model(tied, lora_head)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    head = model.get_output_embeddings()
    head_weight = head.base_layer.weight if lora_head else head.weight
    assert head_weight.numel() == 0, "the head weight is partitioned outside its module's forward"
    engine.backward(_fused_loss(engine, _batch(rank), path))
    got = {n: safe_get_full_grad(p) for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys()
    case = f"tied={tied} lora_head={lora_head} {path}"
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{case}, {n}: {m}")
    engine.destroy()


def _worker(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _gloo_all_reduce()
    for tied, lora_head in [(False, False), (True, False), (False, True)]:
        for path in ("verl_forward", "ludic_cispo"):
            _check(rank, tied, lora_head, path)


def _rank_start_method() -> str:
    """'fork' (the ranks inherit this process's imports: torch, transformers, deepspeed, peft) when DeepSpeed
    already chose its CPU accelerator here and CUDA is not started, else 'spawn' (fresh interpreters that choose
    it from DS_ACCELERATOR)."""
    from deepspeed.accelerator import get_accelerator

    return "fork" if get_accelerator().device_name() == "cpu" and not torch.cuda.is_initialized() else "spawn"


def test_fused_head_under_zero3_gets_the_unsharded_gradients():
    run_local_group(_worker, WORLD, start_method=_rank_start_method())


def _trl_step(cls, tok, output_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """One GRPO step (TRL's own generation, dapo loss, plain SGD with lr 1 so the update is the gradient)
    under accelerate + ZeRO-3: (parameter updates, gathered in full; the step's logged metrics)."""
    import datasets
    import trl
    from deepspeed.utils import safe_get_full_fp32_param

    from ludic_fast.embedded import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(len(tok), hidden_size=32, intermediate_size=64, tie_word_embeddings=False).float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "zero_allow_untested_optimizer": True}
    args = trl.GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                          logging_steps=1, beta=0.0, max_steps=1, learning_rate=1.0, optim="sgd", deepspeed=zero3,
                          seed=1, loss_type="dapo", disable_tqdm=True)
    data = datasets.Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                  args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    after = trainer.model_wrapped.module.named_parameters()
    return {n: safe_get_full_fp32_param(p).detach() - before[n] for n, p in after}, trainer.state.log_history[0]


def _trl_worker(rank: int, world: int, output_dir: str) -> None:
    _gloo_all_reduce()
    import trl

    from ludic_fast.embedded import build_char_tokenizer
    from ludic_fast.integrations.trl import FastGRPOTrainer

    # accelerate's launch check wants these; the process group already exists (file rendezvous)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      ACCELERATE_USE_DEEPSPEED="true", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    stock_update, stock_log = _trl_step(trl.GRPOTrainer, tok, output_dir)
    fast_update, fast_log = _trl_step(FastGRPOTrainer, tok, output_dir)
    assert fast_log["reward"] == stock_log["reward"]  # the same generations
    assert fast_log["entropy"] == pytest.approx(stock_log["entropy"], rel=1e-5)
    assert fast_log["grad_norm"] == pytest.approx(stock_log["grad_norm"], rel=1e-5) and stock_log["grad_norm"] > 0.1
    for name, want in stock_update.items():
        scale = float(want.abs().max())
        assert float((fast_update[name] - want).abs().max()) <= 1e-4 * scale + 1e-9, name


def test_fast_grpo_trainer_step_under_zero3_equals_stock_trl(tmp_path):
    pytest.importorskip("trl", reason="trl not installed")
    run_local_group(_trl_worker, WORLD, str(tmp_path))
