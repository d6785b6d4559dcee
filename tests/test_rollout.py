"""Rollouts: the transformers engine's behaviour logprobs under the losses' temperature semantics, GRPO
groups, DAPO dynamic sampling, tie jitter, deterministic resume, the eval loop, rewards and tasks."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest
import torch
from _trainer_fixtures import TOKENIZER, tiny_model

from ludic_fast import reference
from ludic_fast.data.credit import GroupNormalizedReturn
from ludic_fast.integrations.transformers import final_hidden_states, lm_head
from ludic_fast.rollout import (
    Completion,
    Evaluator,
    HFGenerateEngine,
    PromptAnswerTask,
    RolloutBatchSource,
    SamplingConfig,
    embedded_default_task,
    exact_match,
    format_reward,
    get_reward,
    numeric_match,
)
from ludic_fast.rollout.engine import cut_at_eos

EOS = TOKENIZER.eos_token_id


def _engine(model=None) -> HFGenerateEngine:
    return HFGenerateEngine(model or tiny_model(), pad_token_id=TOKENIZER.pad_token_id, eos_token_id=EOS)


# -------------------------------------------------------------------------------------- HF engine
def test_behaviour_logprobs_equal_the_heads_under_temperature():
    """Left-padded sampling at T=0.7 vs the right-padded teacher-forced head with temperature=0.7."""
    model = tiny_model()
    prompts = [TOKENIZER(p)["input_ids"] for p in ("1+2=", "13+4=", "7=")]
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=5)
    outs = _engine(model).generate(prompts, sampling, seed=3)
    for c in outs:
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            hidden = final_hidden_states(model, ids, torch.ones_like(ids))
            head = lm_head(model)
            want = reference.linear_logprobs(hidden[0, :-1], head.weight, ids[0, 1:], temperature=0.7).logprobs
        got = torch.tensor(c.logprobs)
        torch.testing.assert_close(got, want[len(c.prompt_ids) - 1:], rtol=1e-4, atol=1e-4)
        assert c.finish_reason == ("stop" if c.completion_ids[-1] == EOS else "length")
        assert c.finish_reason == "stop" or len(c.completion_ids) == sampling.max_new_tokens


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone():
    engine = _engine()
    prompts = [TOKENIZER("3+4=")["input_ids"]] * 6
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate(prompts, SamplingConfig(max_new_tokens=4), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = engine.generate(prompts, SamplingConfig(max_new_tokens=4), seed=7)
    assert a == b
    assert engine.model.training  # restored (the fixture model starts in train mode)


def test_cut_at_eos_and_sampling_validation():
    assert cut_at_eos([5, 2, 6], [-1.0, -2.0, -3.0], {2}) == ([5, 2], [-1.0, -2.0], "stop")
    assert cut_at_eos([5, 6], [-1.0, -2.0], {2}) == ([5, 6], [-1.0, -2.0], "length")
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="prompts"):
        _engine().generate([], SamplingConfig())


# ------------------------------------------------------------------------------------ batch source
class ScriptedEngine:
    """Answers prompt "a+b=" correctly for the members listed in `correct(prompt, member, call)`."""

    def __init__(self, correct):
        self.correct, self.calls, self.version = correct, 0, 5

    def generate(self, prompts, sampling, *, seed=None):
        self.calls += 1
        out = []
        for i, p in enumerate(prompts):
            text = TOKENIZER.decode(p)
            a, b = text.rstrip("=").split("+")
            ans = str(int(a) + int(b)) if self.correct(text, i, self.calls) else "x"
            ids = TOKENIZER(ans)["input_ids"] + [EOS]
            out.append(Completion(list(p), ids, [-0.5] * len(ids), "stop"))
        return out


def _source(engine, **kw):
    args = dict(engine=engine, task=embedded_default_task(), tokenizer=TOKENIZER,
                credit_assigner=GroupNormalizedReturn(4, normalize_adv=True), prompts_per_batch=3, group_size=4,
                sampling=SamplingConfig(max_new_tokens=3), seed=1)
    args.update(kw)
    return RolloutBatchSource(**args)


def test_groups_items_and_meta():
    batch = asyncio.run(_source(ScriptedEngine(lambda t, i, c: i % 2 == 0)).next_batch())
    assert len(batch.items) == 12
    gids = [it.meta["request_meta"]["group_id"] for it in batch.items]
    assert len(set(gids)) == 3 and all(gids[i] == gids[i - i % 4] for i in range(12))
    for it in batch.items:
        assert it.meta["policy_version"] == 5 and it.meta["prompt_id"].startswith("train-")
        assert len(it.actor_logps.token_logps) == sum(it.action_mask)
        assert it.meta["finish_reason"] == "stop"
    for g in range(3):
        weights = [it.weight for it in batch.items[4 * g: 4 * g + 4]]
        assert sum(weights) == pytest.approx(0.0, abs=1e-6) and max(weights) > 0
    assert batch.meta["avg_total_reward"] == pytest.approx(0.5)
    assert batch.meta["oversampling_factor"] == 1.0 and batch.meta["target_rollouts"] == 12


def test_dynamic_sampling_resamples_tied_groups_and_is_bounded():
    # round 1: only the first prompt's group is mixed; later rounds: every group is mixed
    engine = ScriptedEngine(lambda t, i, call: (i % 2 == 0) if (call > 1 or i < 4) else False)
    batch = asyncio.run(_source(engine, dynamic_sampling=True, max_rounds=4).next_batch())
    assert engine.calls == 2 and len(batch.items) == 12
    assert batch.meta["oversampling_factor"] == pytest.approx((3 + 2) / 3)
    never = ScriptedEngine(lambda t, i, call: False)
    batch = asyncio.run(_source(never, dynamic_sampling=True, max_rounds=3).next_batch())
    assert never.calls == 3 and batch.items == [] and batch.meta["oversampling_factor"] == 3.0


def test_tie_jitter_breaks_fully_tied_groups():
    batch = asyncio.run(_source(ScriptedEngine(lambda t, i, c: i < 4), tie_jitter=0.01).next_batch())
    rewards = [it.meta["total_reward"] for it in batch.items]
    for g, value in ((0, 1.0), (1, 0.0), (2, 0.0)):  # all right, all wrong, all wrong: every group tied
        grp = rewards[4 * g: 4 * g + 4]
        assert statistics.pstdev(grp) > 0 and all(abs(r - value) <= 0.01 for r in grp)
    assert batch.meta["avg_total_reward"] == pytest.approx(4 / 12)  # logged before jitter
    mixed = asyncio.run(_source(ScriptedEngine(lambda t, i, c: i % 2 == 0), tie_jitter=0.01).next_batch())
    assert [it.meta["total_reward"] for it in mixed.items] == [1.0, 0.0] * 6  # mixed groups untouched


def test_state_dict_resume_replays_the_same_batches():
    def run(n, state=None):
        src = _source(_engine())
        if state is not None:
            src.load_state_dict(json.loads(json.dumps(state)))
        batches = [asyncio.run(src.next_batch()) for _ in range(n)]
        return [[(it.input_ids, it.weight) for it in b.items] for b in batches], src.state_dict()

    full, _ = run(3)
    _, state = run(1)
    rest, _ = run(2, state)
    assert rest == full[1:]


def test_curriculum_retired_prompts_leave_the_next_epoch():
    class Retire:
        def active(self, ids):
            return [i for i in ids if i.endswith("0")]  # keep only a few ids

    src = _source(ScriptedEngine(lambda t, i, c: True), curriculum=Retire(), prompts_per_batch=2)
    seen = set()
    for _ in range(20):
        seen |= {it.meta["prompt_id"] for it in asyncio.run(src.next_batch()).items}
    assert seen and all(p.endswith("0") for p in seen)


# -------------------------------------------------------------------------------------------- eval
def test_evaluator_scores_greedy_completions():
    task = embedded_default_task()
    ev = Evaluator(engine=ScriptedEngine(lambda t, i, c: i % 4 != 0), task=task, tokenizer=TOKENIZER, batch_size=8,
                   samples=task.samples[:16])
    out = ev.evaluate()
    assert out["accuracy"] == pytest.approx(0.75) and out["reward"] == pytest.approx(0.75)
    assert out["num_samples"] == 16 and out["completion_truncated_rate"] == 0.0


# ---------------------------------------------------------------------------------- rewards, tasks
def test_rewards():
    assert exact_match(" 12 ", "12") == 1.0 and exact_match("12.", "12") == 0.0
    assert numeric_match("so the answer is 1,234.0", "1234") == 1.0 and numeric_match("none", "3") == 0.0
    assert format_reward(r"\d+")("42", "x") == 1.0 and format_reward(r"\d+")("4a", "x") == 0.0
    assert get_reward("format:[a-z]+")("abc", "") == 1.0
    with pytest.raises(ValueError, match="reward"):
        get_reward("fuzzy")


def test_tasks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"q": "2+2=", "a": 4}\n\n{"q": "1+1=", "a": "2", "id": "x"}\n')
    task = PromptAnswerTask.from_jsonl(path, reward="numeric", prompt_key="q", answer_key="a")
    assert [s["id"] for s in task.samples] == ["t-0", "x"]
    assert task.reward("4", task.samples[0]) == 1.0
    with pytest.raises(ValueError, match="missing"):
        PromptAnswerTask.from_jsonl(path)
    emb = embedded_default_task()
    assert len(emb.samples) == 80 and emb.eval_samples == emb.samples
    held = embedded_default_task(held_out_eval=True)
    assert not {s["prompt"] for s in held.eval_samples} & {s["prompt"] for s in held.samples}


def test_embedded_tokenizer_model_and_task(tmp_path):
    from ludic_fast.embedded import AdditionTask, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    ids = tok("12+ab=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "12+ab=" and tok.pad_token_id == 0 and tok.eos_token_id == 2
    tok.save_pretrained(tmp_path)  # a real transformers tokenizer: saveable, reloadable
    with pytest.raises(ValueError, match="repeat"):
        build_char_tokenizer("aa")
    a, b = build_tiny_model(len(tok), seed=4), build_tiny_model(len(tok), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    task = AdditionTask(max_operand=9, seed=1)
    train, held = task.samples("train", 80), task.samples("eval", 20)
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in held}
    assert all(int(s["answer"]) == sum(map(int, s["prompt"].rstrip("=").split("+"))) for s in train)
    with pytest.raises(ValueError, match="only"):
        task.samples("train", 81)
    with pytest.raises(ValueError, match="split"):
        task.samples("test", 1)
