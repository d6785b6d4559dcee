"""reasoning-gym tasks (ludic_fast.agents.libraries.reasoning_gym): the reward is the dataset's own score_answer,
partial credit included; the eval split comes from disjoint generator seeds; each dataset's score is logged."""

from __future__ import annotations

import asyncio

import pytest

rg = pytest.importorskip("reasoning_gym",
                         reason="reasoning-gym is not installed (pip install 'ludic-fast[reasoning-gym]')")

from reasoning_gym.utils import extract_answer  # noqa: E402

from ludic_fast.agents.libraries.reasoning_gym import reasoning_gym_task  # noqa: E402
from ludic_fast.data.credit import GroupNormalizedReturn  # noqa: E402
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model  # noqa: E402
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS  # noqa: E402
from ludic_fast.rollout.hf_sampler import HFSampler  # noqa: E402
from ludic_fast.rollout.sampler import Completion, SamplingConfig  # noqa: E402
from ludic_fast.rollout.sources import Evaluator, RolloutBatchSource  # noqa: E402

TOK = build_char_tokenizer(ASCII_CHARACTERS)
SMALL = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)


def variants(answer: str) -> list[str]:
    """Completions around the oracle answer: exact, inside longer text (partial credit under the base scorer),
    wrong, empty, with surrounding spaces."""
    return [answer, f"so {answer} it is", f"{answer}!", answer[::-1] + "x", "", f"  {answer}  ", answer[:-1]]


@pytest.fixture(scope="module")
def engine():
    model = build_tiny_model(len(TOK), max_position_embeddings=512, seed=3)
    return HFSampler(model, pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)


def sampled(engine, task, n: int = 6) -> list[str]:
    """Completions the embedded tiny model (random init) samples for the first n prompts."""
    prompts = [TOK(s["prompt"], add_special_tokens=False)["input_ids"] for s in task.samples[:n]]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=6), seed=0)
    return [TOK.decode(c.completion_ids, skip_special_tokens=True) for c in out]


@pytest.mark.parametrize("name,config", [("chain_sum", SMALL), ("spell_backward", {}), ("word_sorting", {}),
                                         ("leg_counting", {})])
def test_reward_is_the_datasets_own_score_answer(engine, name, config):
    task = reasoning_gym_task(name, seed=11, size=6, eval_size=4, prompt="plain", **config)
    fresh = rg.create_dataset(name, seed=11, size=6, **config)  # the library's dataset, built independently
    seen = []
    model_text = sampled(engine, task)
    for i, row in enumerate(task.samples):
        entry = fresh[i]
        assert row["entry"]["question"] == entry["question"] and row["answer"] == entry["answer"]
        for c in variants(entry["answer"]) + model_text:
            want = fresh.score_answer(c.strip(), entry)
            assert task.reward(c, row) == pytest.approx(want, abs=0.0)
            assert task.components(c, row) == {f"rg/{name}": want}
            seen.append(want)
    assert 1.0 in seen and 0.0 in seen


def test_partial_credit_is_kept():
    task = reasoning_gym_task("leg_counting", seed=0, size=3, eval_size=2, prompt="plain")
    row = task.samples[0]
    r = task.reward(f"so {row['answer']} it is", row)  # reasoning-gym's base scorer: len(oracle) / len(answer)
    assert r == pytest.approx(len(row["answer"]) / len(f"so {row['answer']} it is"))
    assert 0.0 < r < 1.0
    spell = reasoning_gym_task("spell_backward", seed=0, size=3, eval_size=2, prompt="plain")
    row = spell.samples[0]  # its own scorer's partial credit
    assert 0.0 < spell.reward(f"so {row['answer']} it is", row) < 1.0


def test_tags_prompt_reads_the_answer_tag_like_reasoning_gym():
    task = reasoning_gym_task("chain_sum", seed=5, size=4, eval_size=2, **SMALL)
    fresh = rg.create_dataset("chain_sum", seed=5, size=4, **SMALL)
    row, entry = task.samples[0], fresh[0]
    assert row["prompt"].endswith(entry["question"]) and "<answer>" in row["prompt"]  # its system prompt first
    assert row["answer"] == f"<answer>{entry['answer']}</answer>"  # the SFT target
    for c in [f"thinking... <answer>{entry['answer']}</answer>",
              f"<answer>1</answer><answer>{entry['answer']}</answer>", entry["answer"],
              f"<answer> {entry['answer']}0 </answer>", "<answer></answer>"]:
        assert task.reward(c, row) == fresh.score_answer(extract_answer(c), entry)
    assert task.reward(row["answer"], row) == 1.0 and task.reward(entry["answer"], row) == 0.0


def test_eval_split_comes_from_disjoint_seeds():
    task = reasoning_gym_task("chain_sum", seed=100, size=50, eval_size=30, prompt="plain", **SMALL)
    evals = rg.create_dataset("chain_sum", seed=150, size=30, **SMALL)  # the default eval seed: seed + size
    train_q = {s["entry"]["question"] for s in task.samples}
    expected = [evals[i] for i in range(30) if evals[i]["question"] not in train_q]
    assert [s["entry"]["question"] for s in task.eval_samples] == [e["question"] for e in expected]
    assert len(expected) < 30  # single-digit sums repeat: the duplicates were dropped
    assert not train_q & {s["entry"]["question"] for s in task.eval_samples}
    # the eval rows are scored by their own dataset
    row = task.eval_samples[0]
    assert task.reward(row["answer"], row) == 1.0
    with pytest.raises(ValueError, match="eval_seed 120.*meet the training"):
        reasoning_gym_task("chain_sum", seed=100, size=50, eval_seed=120, **SMALL)
    # a composite of k datasets draws from seeds seed .. seed + size + k: its default eval seed starts after them
    comp = reasoning_gym_task("leg_counting,spell_backward", seed=0, size=5, eval_size=3)
    assert comp.datasets["eval"].seed == 7


def test_bad_names_and_options_are_one_line_errors():
    with pytest.raises(ValueError, match="no dataset 'chain_sums'"):
        reasoning_gym_task("chain_sums")
    with pytest.raises(ValueError, match="has no option.* bogus; its options: allow_negation"):
        reasoning_gym_task("chain_sum", bogus=1)
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        reasoning_gym_task("chain_sum", min_terms=5, max_terms=2)
    with pytest.raises(ValueError, match="apply to one dataset"):
        reasoning_gym_task("chain_sum,leg_counting", min_terms=2)
    with pytest.raises(ValueError, match="prompt must be one of"):
        reasoning_gym_task("chain_sum", prompt="xml")
    with pytest.raises(ValueError, match="own eval split"):
        reasoning_gym_task("chain_sum", size=4, eval_size=2).hold_out(0.5)


class AnswerFirstHalf:
    """Answers each prompt's oracle for the first half of a group, "?" for the rest (a stub sampler)."""

    version = 0

    def __init__(self, task):
        self.answers = {s["prompt"]: s["answer"] for s in task.samples + task.eval_samples}

    def generate(self, prompts, sampling, *, seed=None):
        out = []
        for i, p in enumerate(prompts):
            text = self.answers[TOK.decode(p)] if i % 2 == 0 else "?"
            ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
            out.append(Completion(list(p), ids, [-0.1] * len(ids), "stop"))
        return out


def test_per_dataset_score_is_logged_in_batches_and_evaluation():
    task = reasoning_gym_task("spell_backward,chain_sum", seed=0, size=8, eval_size=6, prompt="plain")
    engine = AnswerFirstHalf(task)
    source = RolloutBatchSource(sampler=engine, task=task, tokenizer=TOK, chat_template=False,
                                credit_assigner=GroupNormalizedReturn(2), prompts_per_batch=8, group_size=2,
                                sampling=SamplingConfig(max_new_tokens=32))
    batch = asyncio.run(source.next_batch())
    by_task: dict[str, list[float]] = {}
    for item in batch.items:
        (name,) = item.meta["reward_components"]
        by_task.setdefault(name, []).append(item.meta["reward"])
    names = sorted(by_task)
    assert names == ["rg/chain_sum", "rg/spell_backward"]
    for n in names:  # half the completions right (1), half "?" (0 under both scorers)
        assert batch.meta[f"reward/{n}"] == pytest.approx(sum(by_task[n]) / len(by_task[n])) == pytest.approx(0.5)
    metrics = Evaluator(sampler=engine, task=task, tokenizer=TOK, chat_template=False).evaluate()
    evals = task.eval_samples
    for n in names:
        rows = [i for i, s in enumerate(evals) if f"rg/{s['task']}" == n]
        assert metrics[f"reward/{n}"] == pytest.approx(sum(i % 2 == 0 for i in rows) / len(rows))


def test_cli_trains_a_reasoning_gym_task_and_logs_its_score(tmp_path, capsys):
    from ludic_fast.cli import train as train_cli
    from ludic_fast.run.loggers import read_jsonl

    task = ["--task", "reasoning_gym:chain_sum", "--task-arg", "prompt=plain", "--task-arg", "size=16",
            "--task-arg", "eval_size=8", *[f"--task-arg={k}={v}" for k, v in SMALL.items()]]
    fast = ["--sft-steps", "2", "--rl-steps", "2", "--prompts-per-batch", "2", "--group-size", "2", "--eval-every",
            "2", "--max-new-tokens", "3", "--logger", "none", "--threads", "1", "--no-plot"]
    assert train_cli.main(["train", *task, *fast, "--output-dir", str(tmp_path)]) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert len(train) == 2 and all(r["train/reward/rg/chain_sum"] == r["train/avg_total_reward"] for r in train)
    assert any("eval/reward/rg/chain_sum" in r for r in records)
    for bad, says in [(["--reward", "numeric"], "--reward does not apply to a reasoning_gym: task"),
                      (["--task-arg", "bogus=1"], "has no option(s) bogus"),
                      (["--task", "reasoning_gym:nope"], "no dataset 'nope'")]:
        assert train_cli.main(["train", *task, *fast, *bad, "--output-dir", str(tmp_path / "x")]) == 2
        assert says in capsys.readouterr().err
    assert train_cli.main(["train", "--task-arg", "size=3", *fast, "--output-dir", str(tmp_path / "y")]) == 2
    assert "--task-arg applies to a reasoning_gym:NAME task" in capsys.readouterr().err
