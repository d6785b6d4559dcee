"""Multi-turn episodes with tools (ludic_fast.agents): token exactness, zero gradient on context, failures
isolated, limits, per-step credit and group normalisation; hand-derived numbers throughout."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from _chat_templates import REASONING_TEMPLATE

from ludic_fast.agents import (
    EnvBatchSource,
    EpisodeJob,
    EpisodeLimits,
    EpisodeRunner,
    StepResult,
    Tool,
    WeightedRewards,
    episode_items,
    trainable_groups,
)
from ludic_fast.agents.episode import render_ids
from ludic_fast.data.batching import collate_saw_items
from ludic_fast.data.credit import (
    EpisodicReturn,
    GAEReturn,
    GroupNormalizedReturn,
    MonteCarloReturn,
    PerStepReward,
)
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer
from ludic_fast.losses import CISPOLoss
from ludic_fast.rollout.sampler import Completion


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(ASCII_CHARACTERS)
    t.chat_template = REASONING_TEMPLATE
    return t


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedSampler:
    """For the prompt whose text contains a key (keys occur in no other text), that key's next scripted text
    (+ <eos> unless the text ends with '|cut'); log-prob of the i-th token = -0.01 (i + 1) - 0.1 turn."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.prompts = tok, {k: list(v) for k, v in scripts.items()}, []
        self.sampled: dict[str, list[list[int]]] = {k: [] for k in scripts}

    def generate(self, prompts, sampling, *, seed=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            key = next(k for k in self.scripts if k in text)
            reply = self.scripts[key].pop(0)
            ids = enc(self.tok, reply.removesuffix("|cut"))
            if not reply.endswith("|cut"):
                ids = ids + [self.tok.eos_token_id]
            ids = ids[: sampling.max_new_tokens]
            turn = len(self.sampled[key])
            lps = [-0.01 * (i + 1) - 0.1 * turn for i in range(len(ids))]
            self.sampled[key].append(ids)
            self.prompts.append((key, list(p)))
            out.append(Completion(list(p), ids, lps, "stop" if ids[-1] == self.tok.eos_token_id else "length"))
        return out


def calc(e: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        e: the expression, e.g. 12*34
    """
    a, b = e.split("*")
    return str(int(a) * int(b))


class QuizEnv:
    """Asks `question` (keyed by name); wrong answers get "no, again"; reward 1 on `answer`."""

    tools = [calc]

    def __init__(self, key: str, answer: str, rewards: tuple[float, ...] = ()):
        self.key, self.answer, self.rewards, self.steps = key, answer, list(rewards), 0

    def reset(self, seed):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{self.key}: 12*34?"}]

    def step(self, turn):
        self.steps += 1
        answer = turn.content.split("</think>")[-1].strip()
        if self.rewards:
            r = self.rewards.pop(0)
            return StepResult([{"role": "user", "content": "go on"}], reward=r, done=not self.rewards)
        if answer == self.answer:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "no, again"}], reward=0.0)


CALL = '<tool_call>{"name": "calc", "arguments": {"e": "12*34"}}</tool_call>'


def run(runner, jobs, seed=0):
    return asyncio.run(runner.run(jobs, seed=seed))


def play_quiz(tok, limits=None):
    sampler = ScriptedSampler(tok, {"q1": ["<think>use tool</think>" + CALL, "<think>so</think>407",
                                           "<think>oops</think>408"]})
    runner = EpisodeRunner(sampler, tok, limits=limits or EpisodeLimits(max_new_tokens=128))
    (ep,) = run(runner, [EpisodeJob(QuizEnv("q1", "408"), seed=7, meta={"group_id": "g"})])
    return sampler, ep


# ------------------------------------------------------------------------------------- token exactness
def test_trained_ids_equal_sampled_ids_under_a_template_that_rerenders_earlier_turns(tok):
    sampler, ep = play_quiz(tok)
    assert ep.status == "done" and ep.turns == 3 and ep.tool_calls == 1 and ep.rollout.total_reward == 1.0
    sampled = sampler.sampled["q1"]
    toks = ep.tokens
    # the sampler saw exactly the sequence being built: each prompt is the episode's prefix before that turn
    for (_, prompt), span in zip(sampler.prompts, toks.turns, strict=True):
        assert prompt == toks.ids[: span.start]
    # every action token is a sampled token, in order, with its sampling log-prob
    assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == [t for s in sampled for t in s]
    assert toks.action_logprobs == pytest.approx([-0.01 * (i + 1) - 0.1 * k for k, s in enumerate(sampled)
                                                  for i in range(len(s))])
    # context: the first prompt, then after each turn the template's "\n" and the next message's rendering
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1: 12*34?"}]
    schema = [Tool.from_function(calc).schema]
    prompt0 = render_ids(tok, first, tools=schema, add_generation_prompt=True)
    assert toks.ids[: toks.turns[0].start] == prompt0
    assert toks.ids[toks.turns[0].end : toks.turns[1].start] == enc(tok, "\n[T]408\n[A]")
    assert toks.ids[toks.turns[1].end : toks.turns[2].start] == enc(tok, "\n[U]no, again\n[A]")
    # the items carry the same ids and log-probs (per step and per episode)
    for per in ("step", "episode"):
        items = episode_items([ep], EpisodicReturn(), per=per)
        got = [t for it in items for t, m in zip(it.input_ids, it.action_mask) if m]
        assert got == [t for s in sampled for t in s]
        assert [x for it in items for x in it.actor_logps.token_logps] == toks.action_logprobs
    # the template does re-render: re-tokenising the conversation strips turn 1's reasoning
    rerendered = render_ids(tok, ep.messages, tools=schema, add_generation_prompt=False)
    assert rerendered != toks.ids[: toks.turns[-1].end + 1]
    assert "<think>use tool</think>" not in tok.decode(rerendered)


def test_context_tokens_get_zero_gradient_and_each_sampled_token_is_trained_once(tok):
    _, ep = play_quiz(tok)
    spans = ep.tokens.turns
    step_items = episode_items([ep], EpisodicReturn(), per="step")
    # per step: item k trains turn k's tokens only; together every sampled position exactly once
    counts = [0] * len(ep.tokens.ids)
    for k, it in enumerate(step_items):
        assert it.input_ids == ep.tokens.ids[: spans[k].end]
        for pos, m in enumerate(it.action_mask):
            counts[pos] += m
    assert counts == ep.tokens.action_mask[: len(counts)] + [0] * (len(counts) - len(ep.tokens.action_mask))
    assert sum(counts) == sum(len(s.logprobs) for s in spans)
    for items in (step_items, episode_items([ep], EpisodicReturn(), per="episode")):
        batch = collate_saw_items(items, pad_token_id=0)
        B, T = batch["input_ids"].shape
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(B, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        W = torch.randn(len(tok), 16, generator=gen, dtype=torch.float64)
        loss, _ = CISPOLoss()(batch, hidden=h, weight=W)
        loss.backward()
        scores_action = torch.zeros(B, T, dtype=torch.bool)
        scores_action[:, :-1] = batch["action_mask"][:, 1:] > 0  # position t scores token t+1
        grad_norm = h.grad.norm(dim=-1)
        assert torch.all(grad_norm[~scores_action] == 0)  # exactly zero on context
        assert torch.all(grad_norm[scores_action] > 0)


# ------------------------------------------------------------------------------------ faults isolated
class RaisingReset(QuizEnv):
    def reset(self, seed):
        raise RuntimeError("reset broke")


class HangingStep(QuizEnv):
    def step(self, turn):
        time.sleep(3)


class AsyncHangingStep(QuizEnv):
    async def step(self, turn):
        await asyncio.sleep(3)


def boom(e: str) -> str:
    """Always fails."""
    raise ValueError("tool broke")


class RaisingTool(QuizEnv):
    tools = [Tool.from_function(boom, name="calc")]


def test_raising_hanging_and_malformed_end_only_their_episode(tok):
    bad_json = '<tool_call>{"name": "calc", "arguments": </tool_call>'
    scripts = {"Q1": ["408"], "Q2": ["408"], "Q3": ["408"], "Q4": ["408"], "Q5": [CALL],
               "Q6": [bad_json, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "408"]}
    sampler = ScriptedSampler(tok, scripts)
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(env_timeout_s=0.3, tool_timeout_s=0.3, max_new_tokens=128,
                                                              format_penalty=-0.25))
    envs = [QuizEnv("Q1", "408"), RaisingReset("Q2", "408"), HangingStep("Q3", "408"),
            AsyncHangingStep("Q4", "408"), RaisingTool("Q5", "408"), QuizEnv("Q6", "408")]
    t0 = time.perf_counter()
    eps = run(runner, [EpisodeJob(e, seed=i, meta={"group_id": f"g{i}"}) for i, e in enumerate(envs)])
    assert time.perf_counter() - t0 < 2.5  # the hung calls were abandoned at their limit, not awaited
    ok, rr, hs, ah, rt, mf = eps
    assert ok.status == "done" and ok.rollout.total_reward == 1.0
    assert rr.status == "failed" and "env.reset: RuntimeError: reset broke" in rr.error and not rr.rollout.steps
    assert hs.status == "failed" and "timed out" in hs.error
    assert ah.status == "failed" and "timed out" in ah.error
    assert rt.status == "failed" and "tool broke" in rt.error
    # malformed calls: answered with error observations, penalised, and the episode goes on to finish
    assert mf.status == "done" and mf.tool_errors == 2 and mf.tool_calls == 2
    assert [s.reward for s in mf.rollout.steps] == [-0.25, -0.25, 1.0]
    assert mf.messages[3]["content"].startswith("error: tool call is not valid JSON")
    assert mf.messages[5]["content"] == "error: unknown tool 'nope'"
    kept, dropped = trainable_groups(eps)
    assert kept == [ok, mf] and dropped == 4


# ------------------------------------------------------------------------------------------- limits
def test_turn_and_token_limits(tok):
    never = {"T": ["1", "2", "3", "4"]}
    (ep,) = run(EpisodeRunner(ScriptedSampler(tok, never), tok, limits=EpisodeLimits(max_turns=2)),
                [EpisodeJob(QuizEnv("T", "408"), 0)])
    assert (ep.status, ep.reason, ep.turns) == ("truncated", "max_turns", 2)
    assert ep.rollout.steps[-1].truncated and not ep.rollout.steps[0].truncated
    prompt = len(render_ids(tok, QuizEnv("t", "").reset(0), tools=[Tool.from_function(calc).schema],
                            add_generation_prompt=True))
    # a budget that ends inside turn 2: it samples only what is left, then the episode is truncated
    limit = prompt + 2 + len(enc(tok, "\n[U]no, again\n[A]")) + 1
    sampler = ScriptedSampler(tok, {"t": ["1", "22222"]})
    (ep,) = run(EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_tokens=limit)), [EpisodeJob(QuizEnv("t", "x"), 0)])
    assert (ep.status, ep.reason) == ("truncated", "max_tokens") and len(ep.tokens.ids) == limit
    assert sampler.sampled["t"][1] == enc(tok, "2") and ep.rollout.steps[-1].trace.finish_reason == "length"
    # a turn cut by max_new_tokens without a stop token ends the episode
    (ep,) = run(EpisodeRunner(ScriptedSampler(tok, {"t": ["123456"]}), tok, limits=EpisodeLimits(max_new_tokens=3)),
                [EpisodeJob(QuizEnv("t", "x"), 0)])
    assert (ep.status, ep.reason, ep.turns) == ("truncated", "turn_length", 1)
    # a tool call cut there: the episode log shows what was written, marked cut (the parse leaves content "")
    (ep,) = run(EpisodeRunner(ScriptedSampler(tok, {"t": [CALL]}), tok, limits=EpisodeLimits(max_new_tokens=30)),
                [EpisodeJob(QuizEnv("t", "x"), 0)])
    assert (ep.status, ep.reason, ep.tool_calls) == ("truncated", "turn_length", 0)
    assert ep.to_record()["messages"][-1] == {"role": "assistant", "content": CALL[:30], "cut": True}
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0)


# ------------------------------------------------------------------------------------------- credit
def test_per_step_credit_on_a_three_step_episode(tok):
    sampler = ScriptedSampler(tok, {"c": ["a", "b", "c"]})
    (ep,) = run(EpisodeRunner(sampler, tok), [EpisodeJob(QuizEnv("c", "", rewards=(0.5, -1.0, 2.0)), 0)])
    assert [s.reward for s in ep.rollout.steps] == [0.5, -1.0, 2.0] and ep.status == "done"

    def weights(assigner):
        return [it.weight for it in episode_items([ep], assigner, per="step")]

    # w_t = sum_{k>=t} 0.9^(k-t) r_k: [0.5 - 0.9 + 0.81*2, -1 + 0.9*2, 2]
    assert weights(MonteCarloReturn(gamma=0.9)) == pytest.approx([1.22, 0.8, 2.0])
    assert weights(PerStepReward()) == [0.5, -1.0, 2.0]
    assert weights(EpisodicReturn()) == [1.5, 1.5, 1.5]
    # GAE(0.9, 0.5), V = 0: w_t = sum (0.45)^(k-t) r_k = [0.5 - 0.45 + 0.2025*2, -1 + 0.45*2, 2]
    assert weights(GAEReturn(gamma=0.9, lam=0.5)) == pytest.approx([0.455, -0.1, 2.0])
    with pytest.raises(ValueError, match="per='step'"):
        episode_items([ep], MonteCarloReturn(gamma=0.9), per="episode")


def test_group_normalisation_across_the_episodes_of_one_seed(tok, tmp_path):
    # two seeds x three episodes; the scripted answer decides each episode's return
    answers = iter(["408", "0", "408", "0", "0", "408"])

    class Env(QuizEnv):
        def __init__(self):
            super().__init__("g", "408")

    class Sampler(ScriptedSampler):
        def generate(self, prompts, sampling, *, seed=None):
            self.scripts["g"] = [next(answers) for _ in prompts]
            return super().generate(prompts, sampling, seed=seed)

    runner = EpisodeRunner(Sampler(tok, {"g": []}), tok, limits=EpisodeLimits(max_turns=1))
    def short(msgs, info):
        return -len([m for m in msgs if m["role"] == "assistant"][-1]["content"]) / 10

    length = WeightedRewards([("short", short, 1.0)])
    src = EnvBatchSource(make_env=Env, runner=runner, credit_assigner=GroupNormalizedReturn(3),
                         seeds_per_batch=2, group_size=3, per="episode", rewards=length,
                         episode_log=tmp_path / "episodes.jsonl", log_episodes=2)
    batch = asyncio.run(src.next_batch())
    # returns: correct = 1 - 0.3, wrong = 0 - 0.1; seed 1 [0.7, -0.1, 0.7] -> mean 0.4333; seed 2 [-0.1, -0.1, 0.7]
    got = [round(i.weight, 5) for i in batch.items]
    assert got == pytest.approx([0.26667, -0.53333, 0.26667, -0.26667, -0.26667, 0.53333], abs=1e-5)
    seeds = [i.meta["env_seed"] for i in batch.items]
    assert seeds[0] == seeds[1] == seeds[2] != seeds[3] == seeds[4] == seeds[5]
    assert len({i.meta["group_id"] for i in batch.items}) == 2
    assert batch.meta["episode_reward_short"] == pytest.approx((-0.3 * 3 - 0.1 * 3) / 6)
    assert batch.meta["episode_turns_mean"] == 1.0 and batch.meta["episode_truncated"] == 3.0
    lines = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["messages"][-1] == {"role": "assistant", "content": "408"}


def test_reward_functions_see_how_the_episode_ended(tok):
    """`truncated` with weight -1.5: the episode whose turn is cut at max_new_tokens (no stop token; the
    environment gives it nothing) returns 0 - 1.5, the one that answers 408 returns 1 + 0."""
    from ludic_fast.agents.rewards import truncated

    answers = iter(["408", "4080|cut"])
    seen = []

    class Sampler(ScriptedSampler):
        def generate(self, prompts, sampling, *, seed=None):
            self.scripts["t"] = [next(answers) for _ in prompts]
            return super().generate(prompts, sampling, seed=seed)

    def spy(msgs, info):
        seen.append((info["episode_status"], info["episode_reason"]))
        return 0.0

    runner = EpisodeRunner(Sampler(tok, {"t": []}), tok, limits=EpisodeLimits(max_turns=1, max_new_tokens=4))
    rewards = WeightedRewards([("truncated", truncated, -1.5), ("spy", spy, 1.0)])
    src = EnvBatchSource(make_env=lambda: QuizEnv("t", "408"), runner=runner, credit_assigner=EpisodicReturn(),
                         seeds_per_batch=1, group_size=2, per="episode", rewards=rewards)
    batch = asyncio.run(src.next_batch())
    assert [i.weight for i in batch.items] == [1.0, -1.5]
    assert seen == [("done", None), ("truncated", "turn_length")]


def test_tool_schema_from_signature_and_docstring():
    def lookup(city: str, days: int = 1, metric: bool = True) -> str:
        """Weather forecast.

        Args:
            city: the city's name
            days (int): how many days
        """
        return ""

    fn = Tool.from_function(lookup).schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Weather forecast."
    assert fn["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer", "description": "how many days"}, "metric": {"type": "boolean"}}}

    def bad(x: set) -> str:
        return ""

    with pytest.raises(TypeError, match="parameter x"):
        Tool.from_function(bad)


def test_episode_items_travel_through_the_pipeline_actor(tok):
    """The Redis pipeline's actor loop pushes multi-turn items; their payloads decode to the same items."""
    from ludic_fast.distributed.pipeline import decode_item, encode_item, run_pipeline_actor

    _, ep = play_quiz(tok)

    class Producer:
        actor_id, pushed, payloads = "a", 0, []

        def learner_done(self):
            return False

        def queued(self):
            return 0

        def push_round(self, items, version, *, stop_requested):  # a round goes onto the stream whole
            ids = [str(self.pushed + k) for k in range(len(items))]
            self.payloads += [encode_item(i, item_id=n, policy_version=version) for i, n in zip(items, ids)]
            self.pushed += len(ids)
            return ids

    producer = Producer()
    items = episode_items([ep], EpisodicReturn(), per="step")
    assert run_pipeline_actor(lambda version: items, producer, num_rounds=1) == 3
    for payload, item in zip(producer.payloads, items, strict=True):
        got = decode_item(payload)
        assert got.input_ids == item.input_ids and got.action_mask == item.action_mask
        assert got.actor_logps.token_logps == pytest.approx(item.actor_logps.token_logps)
        assert got.meta["episode_turns"] == 3
