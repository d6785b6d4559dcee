"""kill -9 in the middle of a checkpoint write, then resume: the previous checkpoint loads and the continued
run's losses and curriculum history equal an uninterrupted run's (CPU, deterministic, separate processes).

The run: the embedded tiny task with rollouts from transformers `generate` (tie jitter on, so the untrained
model's all-zero groups survive the zero-variance filter), the ScaleRL preset (its No-Positive-Resampling
curriculum history is part of the checkpoint), a checkpoint after every step."""

from __future__ import annotations

import textwrap

from _kill_resume import kill_mid_write_then_resume

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from _kill_resume import stall_checkpoint_write
    from ludic_fast.algorithm import make_scalerl
    from ludic_fast.run.checkpoint import CheckpointConfig
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
    from ludic_fast.rollout import HFGenerateEngine, RolloutBatchSource, SamplingConfig, embedded_default_task
    from ludic_fast.trainer import Trainer, TrainerConfig

    out, mode, steps, crash_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
    algo = make_scalerl(group_size=4)
    engine = HFGenerateEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    source = RolloutBatchSource(engine=engine, task=embedded_default_task(), tokenizer=tok,
                                credit_assigner=algo.credit_assigner, prompts_per_batch=4, group_size=4,
                                sampling=SamplingConfig(temperature=1.0, max_new_tokens=3), seed=0,
                                curriculum=algo.curriculum, tie_jitter=0.1)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=tok, lr=3e-3, max_seq_len=16, micro_token_budget=64)
    if mode == "crash":
        stall_checkpoint_write(crash_step)
    trainer = Trainer(model=model, algo=algo, batch_source=source, cfg=cfg, publisher=engine,
                      checkpoint_config=CheckpointConfig(out, every_n_steps=1, max_to_keep=2),
                      resume_from="latest" if mode == "resume" else None)
    start = trainer.step_idx
    for _ in range(steps - start):
        stats = trainer.train_step_sync()
        print("STEP " + json.dumps({"step": trainer.step_idx, "loss": stats["train/loss"],
                                    "reward": stats["train/avg_total_reward"]}), flush=True)
    print("FINAL " + json.dumps({"start": start, "curriculum": algo.curriculum.state_dict()}), flush=True)
    """
)


def test_kill_during_checkpoint_write_then_resume(tmp_path):
    full_steps, full_final, resumed_steps, resumed_final = kill_mid_write_then_resume(tmp_path, CHILD, 4, 3)
    for s in (3, 4):
        assert resumed_steps[s] == full_steps[s]
    assert resumed_final["curriculum"] == full_final["curriculum"]
    assert resumed_final["curriculum"]["history"]  # the history is not trivially empty
