"""Types: validation on construction and JSON / msgpack round trips."""

from __future__ import annotations

import json
import math

import msgpack
import pytest

from ludic_fast.data.types import (
    ActorTokenLogps,
    EnvSpec,
    InferenceSpec,
    ProtocolSpec,
    Rollout,
    RolloutRequest,
    SampleAttachments,
    SAWBatch,
    SAWItem,
    Step,
    TokenTrace,
    group_id_of,
)


def _item(**kw):
    base = dict(input_ids=[1, 2, 3], attention_mask=[1, 1, 1], action_mask=[0, 1, 1], weight=0.5)
    base.update(kw)
    return SAWItem(**base)


def test_token_trace_validates_types_and_logprob_length():
    TokenTrace([1, 2], [3, 4], [-0.1, -0.2], "stop")
    with pytest.raises(TypeError, match="completion_token_ids"):
        TokenTrace([1], [3.5])
    with pytest.raises(ValueError, match="completion_logprobs has 1 entries"):
        TokenTrace([1], [3, 4], [-0.1])


def test_step_rejects_non_finite_reward():
    with pytest.raises(ValueError, match="reward of step 0 must be finite"):
        Step(index=0, prev_obs=None, action=None, next_obs=None, reward=math.nan)
    with pytest.raises(TypeError, match="reward"):
        Step(index=0, prev_obs=None, action=None, next_obs=None, reward="1")


def test_rollout_total_reward_is_sum_of_step_rewards():
    steps = [Step(index=i, prev_obs=None, action=None, next_obs=None, reward=r) for i, r in enumerate([0.5, -1, 2])]
    assert Rollout(steps=steps).total_reward == 1.5


def test_actor_token_logps_type_checked():
    with pytest.raises(TypeError, match="must be a List\\[float\\]"):
        ActorTokenLogps(["x"])
    assert ActorTokenLogps([-1, -0.5]).token_logps == [-1.0, -0.5]


def test_saw_item_validation():
    item = _item(attachments=SampleAttachments(ActorTokenLogps([-1.0, -2.0])))
    assert item.actor_logps.token_logps == [-1.0, -2.0]
    with pytest.raises(ValueError, match="action_mask has length 2"):
        _item(action_mask=[0, 1])
    with pytest.raises(ValueError, match="attention_mask must contain only 0 and 1"):
        _item(attention_mask=[1, 2, 1])
    with pytest.raises(ValueError, match="weight must be finite"):
        _item(weight=math.inf)
    with pytest.raises(ValueError, match="input_ids must not be empty"):
        SAWItem([], [], [], 1.0)


def test_request_validation():
    with pytest.raises(ValueError, match="EnvSpec.kind"):
        EnvSpec("")
    with pytest.raises(TypeError, match="protocol must be a ProtocolSpec"):
        RolloutRequest(env=EnvSpec("e"), protocol=EnvSpec("p"))
    with pytest.raises(ValueError, match="num_episodes"):
        RolloutRequest(env=EnvSpec("e"), protocol=ProtocolSpec("p"), num_episodes=0)
    with pytest.raises(ValueError, match="top_p"):
        InferenceSpec(top_p=0.0)


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_round_trips(codec):
    encode, decode = (
        (lambda d: json.dumps(d), json.loads)
        if codec == "json"
        else (lambda d: msgpack.packb(d), lambda b: msgpack.unpackb(b, strict_map_key=False))
    )
    trace = TokenTrace([1, 2], [3], [-0.25], "length")
    rollout = Rollout(
        steps=[Step(index=0, prev_obs="q", action="a", next_obs=None, reward=1.0, info={"k": 1}, trace=trace)],
        meta={"request_meta": {"group_id": "g"}},
    )
    request = RolloutRequest(
        env=EnvSpec("math", {"sample": {"q": "1+1"}}),
        protocol=ProtocolSpec("single"),
        env_seed=3,
        inference=InferenceSpec(temperature=1.0, stop=["</s>"]),
        meta={"prompt_id": 7},
    )
    item = _item(meta={"rollout_id": "r"}, attachments=SampleAttachments(ActorTokenLogps([-1.0, -2.0])))
    batch = SAWBatch(items=[item, _item()], meta={"num_samples": 2})
    for obj in (trace, rollout, request, item, batch):
        assert type(obj).from_dict(decode(encode(obj.to_dict()))) == obj


def test_group_id_of_reads_request_meta_then_flat_meta():
    assert group_id_of({"request_meta": {"group_id": "a"}, "group_id": "b"}) == "a"
    assert group_id_of({"group_id": 5}) == "5"
    assert group_id_of({}) is None


def test_numpy_scalars_become_python_numbers():
    np = pytest.importorskip("numpy")
    item = SAWItem(list(np.array([4, 5])), [1, 1], [0, 1], np.float32(0.5),
                   attachments=SampleAttachments(ActorTokenLogps([np.float64(-1.5)])))
    assert type(item.input_ids[0]) is int and type(item.weight) is float
    assert type(item.actor_logps.token_logps[0]) is float
    json.dumps(item.to_dict())
    with pytest.raises(TypeError, match="input_ids must be a List\\[int\\]"):
        SAWItem([1.0, 2.0], [1, 1], [0, 1], 0.5)
