"""The generic to_dict / from_dict of `data.types`: every data class (found by listing the module) round-trips
exactly through JSON and msgpack, nested classes come back as their classes, the dict of an item is the one
written out by hand, and bad input is a TypeError naming the class."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest

from ludic_fast.data import types as T

_TRACE = T.TokenTrace([1, 2], [3, 4], [-0.25, -1.5], "length")
_STEP = T.Step(index=0, prev_obs={"q": [1, 2]}, action="a", next_obs=None, reward=1.0, truncated=True,
               info={"k": 1}, trace=_TRACE, ts_ns=123)
_LOGPS = T.ActorTokenLogps([-1.0, -2.0])
_ITEM = T.SAWItem([5, 6, 7], [1, 1, 1], [0, 1, 1], 0.5, meta={"rollout_id": "r"},
                  attachments=T.SampleAttachments(_LOGPS))
EXAMPLES = {
    T.TokenTrace: _TRACE,
    T.Step: _STEP,
    T.Rollout: T.Rollout(steps=[_STEP, dataclasses.replace(_STEP, index=1, trace=None)], meta={"g": "x"}, id="r1"),
    T.EnvSpec: T.EnvSpec("math", {"sample": {"q": "1+1"}}),
    T.ProtocolSpec: T.ProtocolSpec("single"),
    T.InferenceSpec: T.InferenceSpec(temperature=1.0, stop=["</s>"], return_chosen_logprobs=False),
    T.RolloutRequest: T.RolloutRequest(env=T.EnvSpec("e"), protocol=T.ProtocolSpec("p"), env_seed=3,
                                       inference=T.InferenceSpec(max_tokens=8), num_episodes=2, meta={"p": 7}),
    T.ActorTokenLogps: _LOGPS,
    T.SampleAttachments: T.SampleAttachments(_LOGPS),
    T.SAWItem: _ITEM,
    T.SAWBatch: T.SAWBatch(items=[_ITEM, T.SAWItem([1], [1], [1], -1.0)], meta={"num_samples": 2}),
}


def _data_classes() -> set[type]:
    return {obj for name in T.__all__ if dataclasses.is_dataclass(obj := getattr(T, name))}


def _json(d):
    return json.loads(json.dumps(d, allow_nan=False))


def _msgpack(d):
    return msgpack.unpackb(msgpack.packb(d), strict_map_key=False)


def _classes(obj) -> list[type]:
    """Classes of every data-class value nested in obj, in field order."""
    out = [type(obj)]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for v in value if isinstance(value, list) else [value]:
            if dataclasses.is_dataclass(v):
                out += _classes(v)
    return out


def test_every_data_class_has_an_example():
    assert set(EXAMPLES) == _data_classes()


@pytest.mark.parametrize("codec", [_json, _msgpack], ids=["json", "msgpack"])
@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_exact_round_trip(cls, codec):
    obj = EXAMPLES[cls]
    back = cls.from_dict(codec(obj.to_dict()))
    assert back == obj
    assert _classes(back) == _classes(obj)
    assert back.to_dict() == obj.to_dict()


def test_the_dict_of_an_item_nests_its_attachments():
    assert _ITEM.to_dict() == {
        "input_ids": [5, 6, 7],
        "attention_mask": [1, 1, 1],
        "action_mask": [0, 1, 1],
        "weight": 0.5,
        "meta": {"rollout_id": "r"},
        "attachments": {"actor_logps": {"token_logps": [-1.0, -2.0]}},
    }
    assert T.SAWItem([1], [1], [1], 1.0).to_dict()["attachments"] == {"actor_logps": None}


def test_to_dict_copies_what_it_writes():
    d = _STEP.to_dict()
    d["info"]["k"] = 2
    d["prev_obs"]["q"].append(3)
    assert _STEP.info == {"k": 1} and _STEP.prev_obs == {"q": [1, 2]}


def test_bad_input_names_the_class():
    with pytest.raises(TypeError, match="SAWItem has no field 'actor_logps'"):
        T.SAWItem.from_dict({**_ITEM.to_dict(), "actor_logps": [-1.0]})
    with pytest.raises(TypeError, match="TokenTrace.from_dict needs a dict, got list"):
        T.Step.from_dict({**_STEP.to_dict(), "trace": [1, 2]})
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'weight'"):
        T.SAWItem.from_dict({k: v for k, v in _ITEM.to_dict().items() if k != "weight"})
    with pytest.raises(ValueError, match="weight must be finite"):  # the constructor's validation runs
        T.SAWItem.from_dict({**_ITEM.to_dict(), "weight": float("inf")})
