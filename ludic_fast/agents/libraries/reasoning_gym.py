"""reasoning-gym datasets as RL tasks, scored by each dataset's own `score_answer`.

reasoning-gym (https://github.com/open-thought/reasoning-gym, `pip install ludic-fast[reasoning-gym]`) generates
item i of a dataset from `Random(seed + i)`: a dataset is its name, its configuration and its seed.
`reasoning_gym_task("leg_counting", seed=0, size=1000, min_animals=2)` is a `PromptAnswerTask` whose

- training rows are items 0..size-1 of the dataset of `seed`, and whose eval rows are items of a dataset of
  `eval_seed` (default: the first seed the training rows never use), so the generators' seeds of the two
  splits never meet (a ValueError when given ones do); an eval question equal to a training question is
  dropped as well;
- prompt is the question in the chat format, after reasoning-gym's own instruction (`prompt="tags"`: its
  default system prompt, the answer read from the completion's last `<answer>...</answer>`, SFT targets
  `<answer>answer</answer>`), or the question alone (`prompt="plain"`: the stripped completion is the answer);
- reward is `dataset.score_answer(answer, entry)`, partial credit kept (e.g. the base scorer's
  len(oracle) / len(answer) when the oracle answer is inside a longer one);
- per-task score is `components(completion, row)` = {"rg/<source dataset>": reward}, logged as
  `reward/rg/<name>` in the training batches and evaluation.

Several names separated by commas make one composite dataset (reasoning-gym's `composite`, equal weights,
each dataset with its default configuration); its scorer dispatches on the item's source dataset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ludic_fast.agents.libraries import import_library
from ludic_fast.rollout.tasks import PromptAnswerTask

PROMPTS = ("tags", "plain")


def _rg() -> Any:
    return import_library("reasoning_gym", "reasoning-gym", "reasoning-gym tasks")


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def create(names: str, *, seed: int, size: int, config: dict[str, Any] | None = None) -> Any:
    """The reasoning-gym dataset `names` (one name, or comma-separated names: a composite) of `seed` and `size`;
    ValueError naming an unknown dataset or option."""
    rg = _rg()
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    parts = [n.strip() for n in names.split(",")]
    for n in parts:
        if n not in DATASETS or n == "composite":
            raise ValueError(f"reasoning-gym has no dataset {n!r}; it has: {', '.join(sorted(DATASETS))}")
    config = dict(config or {})
    if len(parts) > 1:
        if config:
            raise ValueError(f"options {sorted(config)} apply to one dataset, not to the composite {names!r}")
        specs = [DatasetSpec(name=n, weight=1.0, config={}) for n in parts]
        return rg.create_dataset("composite", seed=seed, size=size, datasets=specs)
    fields = {f.name for f in dataclasses.fields(DATASETS[parts[0]][1])} - {"seed", "size"}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"reasoning-gym dataset {parts[0]!r} has no option(s) {', '.join(unknown)}; "
                         f"its options: {', '.join(sorted(fields))}")
    try:
        return rg.create_dataset(parts[0], seed=seed, size=size, **config)
    except (AssertionError, TypeError, ValueError) as exc:  # its configs validate with assert
        raise ValueError(f"reasoning-gym dataset {parts[0]!r} with {config}: {exc or type(exc).__name__}") from None


def seeds_used(dataset: Any) -> range:
    """The `Random` seeds the dataset's items draw from: seed + i for its items, seed + j + 1 + i for the
    items of a composite's j-th dataset."""
    extra = len(getattr(dataset, "datasets", None) or {})
    return range(dataset.seed, dataset.seed + len(dataset) + extra)


def extract_answer(completion: str) -> str | None:
    """reasoning-gym's own reader: the stripped text of the completion's last <answer>...</answer>, or None."""
    _rg()
    from reasoning_gym.utils import extract_answer as rg_extract

    return rg_extract(completion, tag_name="answer", strip=True)


def system_prompt() -> str:
    """reasoning-gym's default system prompt (think, then the answer inside <answer> tags)."""
    _rg()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


@dataclasses.dataclass
class ReasoningGymTask(PromptAnswerTask):
    """A `PromptAnswerTask` whose rows carry their reasoning-gym entry and whose reward is the dataset's own
    scorer (module docstring). Built by `reasoning_gym_task`."""

    datasets: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_format: str = "tags"

    def answer_of(self, completion: str) -> str | None:
        """What the scorer is given: the <answer> tag's text ("tags") or the stripped completion ("plain")."""
        return extract_answer(completion) if self.prompt_format == "tags" else completion.strip()

    def reward(self, completion: str, sample: dict[str, Any]) -> float:
        """`score_answer(answer_of(completion), entry)` of the dataset the row came from."""
        return float(self.datasets[sample["split"]].score_answer(self.answer_of(completion), sample["entry"]))

    def components(self, completion: str, sample: dict[str, Any]) -> dict[str, float]:
        """{"rg/<source dataset>": reward}: the per-task score."""
        return {f"rg/{sample['task']}": self.reward(completion, sample)}

    def hold_out(self, fraction: float, *, seed: int = 0) -> PromptAnswerTask:
        raise ValueError("a reasoning-gym task has its own eval split (eval_seed, eval_size); it is not held out")


def _rows(dataset: Any, split: str, name: str, prompt_format: str, skip: set[str] = frozenset()) -> list[dict]:
    rows = []
    head = system_prompt() + "\n\n" if prompt_format == "tags" else ""
    for i in range(len(dataset)):
        entry = dataset[i]
        if entry["question"] in skip:
            continue
        answer = str(entry["answer"])
        rows.append({
            "id": f"{name}-{split}-{i}", "prompt": head + entry["question"],
            "answer": f"<answer>{answer}</answer>" if prompt_format == "tags" else answer,
            "entry": entry, "split": split, "task": entry["metadata"].get("source_dataset", name),
        })
    return rows


def reasoning_gym_task(names: str, *, seed: int = 0, size: int = 1000, eval_seed: int | None = None,
                       eval_size: int = 100, prompt: str = "tags", **config: Any) -> ReasoningGymTask:
    """The task of reasoning-gym dataset(s) `names` with options `config` (module docstring)."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
    for flag, value in (("size", size), ("eval_size", eval_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive int, got {value!r}")
    train = create(names, seed=seed, size=size, config=config)
    used = seeds_used(train)
    if eval_seed is None:
        eval_seed = used.stop
    evals = create(names, seed=eval_seed, size=eval_size, config=config)
    overlap = set(used) & set(seeds_used(evals))
    if overlap:
        raise ValueError(f"eval_seed {eval_seed}: the eval items' generator seeds {seeds_used(evals)} meet the "
                         f"training items' {used}; pick an eval_seed >= {used.stop} (the default)")
    samples = _rows(train, "train", names, prompt)
    eval_samples = _rows(evals, "eval", names, prompt, skip={s["entry"]["question"] for s in samples})
    if not eval_samples:
        raise ValueError(f"every eval question of {names!r} is also a training question; raise eval_size or size")
    return ReasoningGymTask(samples, reward_fn=_unused_reward, name=f"reasoning_gym-{names.replace(',', '+')}",
                            eval_samples=eval_samples, datasets={"train": train, "eval": evals},
                            prompt_format=prompt)


def _unused_reward(completion: str, answer: str) -> float:
    raise TypeError("a reasoning-gym task is scored by task.reward(completion, row), which reads the row's entry")


__all__ = ["PROMPTS", "ReasoningGymTask", "create", "dataset_names", "extract_answer", "reasoning_gym_task",
           "seeds_used", "system_prompt"]
