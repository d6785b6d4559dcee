"""Input checks of `ludic-fast train|demo`, run before anything is built or trained.

Every problem is a `UsageError` whose message is one line naming the flag, or the file and line; the
CLI prints it as `ludic-fast <command>: error: <message>` and exits with status 2 (argparse's convention).
Optional packages that are missing name the pip extra that installs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from ludic_fast.rollout.rewards import reward_from_specs
from ludic_fast.rollout.sampler import SAMPLERS


class UsageError(ValueError):
    """A bad command-line input; `str(exc)` is the one-line message."""


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`prog: error: msg (see --help)`, exit 2) and which reads
    negative numbers in any float spelling (`--lr -1e-5`) as values, so the range check can name them."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


#: numeric flags: attribute -> (predicate, what it must be). Flags absent from the namespace are skipped.
_NUMBER_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v > 0, "> 0"),
    "sft_lr": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "max_grad_norm": (lambda v: v > 0, "> 0"),
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "tie_jitter": (lambda v: v >= 0, ">= 0"),
    "sft_steps": (lambda v: v >= 0, ">= 0"),
    "rl_steps": (lambda v: v >= 0, ">= 0"),
    "sft_batch_size": (lambda v: v >= 1, ">= 1"),
    "prompts_per_batch": (lambda v: v >= 1, ">= 1"),
    "group_size": (lambda v: v >= 1, ">= 1"),
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "max_rounds": (lambda v: v >= 1, ">= 1"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
    "max_seq_len": (lambda v: v >= 2, ">= 2"),
    "micro_token_budget": (lambda v: v >= 1, ">= 1"),
    "lora_r": (lambda v: v >= 0, ">= 0 (0 = full fine-tuning)"),
    "max_lag": (lambda v: v >= 0, ">= 0"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0 = no evaluation)"),
    "eval_holdout": (lambda v: 0 < v < 1, "in (0, 1)"),
    "checkpoint_every": (lambda v: v >= 0, ">= 0 (0 = no checkpoints)"),
    "max_to_keep": (lambda v: v >= 1, ">= 1"),
    "threads": (lambda v: v >= 0, ">= 0 (0 = torch's default)"),
    # offline presets
    "offline_steps": (lambda v: v >= 1, ">= 1"),
    "pref_batch_size": (lambda v: v >= 1, ">= 1"),
    "beta": (lambda v: v > 0, "> 0"),
    "teacher_steps": (lambda v: v >= 0, ">= 0"),
    "distill_temperature": (lambda v: v > 0, "> 0"),
    "hard_weight": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "on_policy_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}

#: optional packages a flag needs -> (module, pip requirement naming the extra)
_EXTRAS = {
    "lora": ("peft", "pip install 'ludic-fast[lora]'"),
    "wandb": ("wandb", "pip install 'ludic-fast[wandb]'"),
}


def comma_numbers(text: str) -> list[float]:
    """An argparse type: comma-separated numbers ("1,0.5")."""
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def as_flags(message: str, args: argparse.Namespace) -> str:
    """`message` with every identifier that is an attribute of `args` written as its flag
    ("micro_token_budget (100) must be >= max_seq_len" -> "--micro-token-budget (100) must be >= --max-seq-len")."""
    names = vars(args)
    return re.sub(r"\b[a-z][a-z0-9_]*\b", lambda m: _flag(m.group(0)) if m.group(0) in names else m.group(0), message)


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in `_NUMBER_RULES` that is set must be finite and satisfy its rule."""
    for attr, (ok, rule) in _NUMBER_RULES.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not math.isfinite(value) or not ok(value):
            raise UsageError(f"{_flag(attr)} must be {rule}, got {value}")


def require_package(module: str, install: str, what: str) -> None:
    """UsageError naming `install` when `module` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{what} needs the optional package {module}: {install}")


def check_device(device: str) -> None:
    """A device torch knows; CUDA only when available."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def check_file(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: not a file")


def check_output_dir(path: str | Path, flag: str) -> Path:
    """Create the folder `path` (and its parents) and prove it writable by creating a file in it."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
    return out


def _offline() -> bool:
    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in flags)


def check_pretrained(name: str, flag: str, *, files: tuple[str, ...] = ("config.json",)) -> None:
    """`name` is a local directory, in the Hugging Face cache, or (online) a model on the Hub; else one line
    saying which, before anything is downloaded or loaded."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in files):
            raise UsageError(f"{flag} {name}: directory without {' or '.join(files)} (not a saved model)")
        return
    if path.exists() or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise UsageError(f"{flag} {name}: no such model directory")
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(name, f), str) for f in files):
        return
    hint = f"download it where the Hub is reachable (`huggingface-cli download {name}`) or pass a local directory"
    if _offline():
        raise UsageError(f"{flag} {name}: not in the local Hugging Face cache and offline mode is on; {hint}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=10)
    except GatedRepoError:
        raise UsageError(f"{flag} {name}: a gated model; accept its licence and `huggingface-cli login`") from None
    except RepositoryNotFoundError:
        raise UsageError(f"{flag} {name}: no such model on the Hugging Face Hub (nor a local directory)") from None
    except Exception as exc:  # noqa: BLE001 - any connection failure: the Hub is unreachable
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        msg = f"{flag} {name}: not cached and the Hugging Face Hub is unreachable ({reason}); {hint}"
        raise UsageError(msg) from None


def check_sampler(args: argparse.Namespace) -> None:
    """--sampler names a registered sampler or a loadable `module:attr`; a sampler flag (`--vllm-arg`,
    `--vllm-url`) goes with a sampler that reads it; the sampler's optional package is installed."""
    name = getattr(args, "engine", "hf")
    try:
        entry = SAMPLERS.resolve(name)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--sampler: {exc}") from None
    for dest in dict.fromkeys(d for e in SAMPLERS for d in e.flags):
        if getattr(args, dest, None) and dest not in entry.flags:
            readers = [e.name for e in SAMPLERS if dest in e.flags]
            raise UsageError(f"{_flag(dest)} needs --sampler {' or '.join(readers)}")
    if getattr(args, "vllm_url", None) and getattr(args, "vllm_arg", None):
        raise UsageError("--vllm-arg cannot reach a server given by --vllm-url (it runs with its own engine arguments)")
    if entry.package and not (entry.package_unless and getattr(args, entry.package_unless, None)):
        require_package(*entry.package, what=f"--sampler {entry.name}")


def check_args(args: argparse.Namespace) -> None:
    """All checks that need no model or data loaded: numbers, files, device, optional packages, models."""
    check_numbers(args)
    check_device(args.device)
    if getattr(args, "reward_weights", None) is not None and len(args.reward_weights) != len(args.reward or ["exact"]):
        raise UsageError(f"--reward-weights: one weight per --reward ({len(args.reward or ['exact'])}), "
                         f"got {len(args.reward_weights)}")
    try:
        reward_from_specs(args.reward or ["exact"], getattr(args, "reward_weights", None))
    except (ValueError, TypeError, re.error) as exc:
        raise UsageError(f"--reward: {exc}") from None
    for attr in ("task", "eval_task", "sft_data", "pref_data"):
        value = getattr(args, attr, None)
        if value is not None and not (attr == "task" and (value == "embedded" or value.startswith("reasoning_gym:"))):
            check_file(value, _flag(attr))
    check_sampler(args)
    if getattr(args, "lora_r", 0) > 0:
        require_package(*_EXTRAS["lora"], what="--lora-r")
    if getattr(args, "wandb", False):
        require_package(*_EXTRAS["wandb"], what="--wandb")
    if args.model != "embedded":
        check_pretrained(args.model, "--model")
    if args.tokenizer:
        check_pretrained(args.tokenizer, "--tokenizer", files=("tokenizer_config.json", "tokenizer.json"))
    if getattr(args, "preset", None) == "distill" and args.teacher != "embedded":
        check_pretrained(args.teacher, "--teacher")


def check_task_tokens(rows: list[dict[str, Any]], tokenizer: Any, *, embedded: bool) -> None:
    """Every prompt and answer encodes without the tokenizer's unknown token (one line naming the row)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    if embedded:
        vocab = "the embedded tokenizer's alphabet (printable ASCII; the embedded task's: digits, + - * = : |, "
        vocab += "space, a-z)"
    else:
        vocab = "the tokenizer's vocabulary (it encodes to the unknown token)"
    for row in rows:
        for field in ("prompt", "answer"):
            text = str(row[field])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if unk in ids:
                bad = next((c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]), None)
                where = row.get("source", f"row {row.get('id')}")
                what = f"character {bad!r}" if bad is not None else "text"
                raise UsageError(f"{where}: {field} {text!r}: {what} is not in {vocab}")


__all__ = [
    "UsageError",
    "OneLineParser",
    "as_flags",
    "check_args",
    "check_numbers",
    "check_output_dir",
    "check_device",
    "check_pretrained",
    "check_task_tokens",
    "require_package",
]
