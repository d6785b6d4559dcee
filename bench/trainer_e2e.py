"""Trainer end to end: step time, tokens/s and peak memory of one RL (CISPO) training step — forward, backward,
grad clipping, AdamW — on a Llama-architecture model built from a config (random init, seeded), for:

- `ours-padded`, `ours-packed`: `ludic_fast.trainer.Trainer` (fused-loss head), padded or packed micro-batch;
- `ours-padded+kernels`, `ours-packed+kernels`: the same with Liger-Kernel's body kernels (CUDA only);
- `ours-padded+compile`, `ours-packed+compile`: the same with each decoder layer under `torch.compile`
  (`TrainerConfig.compile_body`; its compile falls in the warm-up step; only when named in `--paths`);
- `reference`: the same Trainer with the micro-batch loss taken through the model's logits [B, T, V] and
  `ludic_fast.reference.CISPOLoss` (how Ludic master computes it);
- `trl`: stock TRL GRPOTrainer (`loss_type="cispo"`): `compute_loss` on the same sequences (prompt / completion
  split, the behaviour logprobs as `old_per_token_logps`), backward, the same clipping and AdamW step, on the same
  model object (so the same attention implementation, `--attn`, and the same weights' dtype; with
  `--dtype mixed-bf16` TRL gets `bf16=True`, its own switch for that recipe). TRL 1.16 computes the per-token
  logprobs with its own chunked LM head (no [B, T, V] logits); its optimizer is the one its trainer makes
  (`create_optimizer`: `GRPOConfig.optim`'s default, torch's fused AdamW, lr 1e-5 and weight decay 0.01 as
  ours), as a user who sets nothing gets;
- `trl+liger`: the same with `GRPOConfig(use_liger_kernel=True)`, which in TRL 1.16 patches Liger-Kernel's
  body kernels (RMSNorm, SwiGLU, RoPE) into the model — the like of `ours-*+kernels` (CUDA only);
- `trl-fast`: the same step with `ludic_fast.integrations.trl.FastGRPOTrainer` in place of `GRPOTrainer` (TRL's
  loss on ludic_fast's head: the drop-in for a TRL user who keeps TRL's trainer).

A packed path may name its attention after a colon, `ours-packed:sdpa_varlen`, `ours-packed:flex`: the
Trainer's `packed_attention` forced to it (`ludic_fast.integrations.packing`), to race the packed paths a rule
chooses between (on CUDA without flash-attn, "auto" takes flex attention); without one it takes "auto".

TRL's settings take effect as in `GRPOTrainer.train()`: transformers' `Trainer.train()` (5.17 to 5.24), not
the trainer's constructor, patches Liger's kernels in and turns activation checkpointing on, and a step timed
without `train()` would silently run without them; the bench does both as `train()` does before its first step.
Activation checkpointing is off for every path unless `--gradient-checkpointing` (GRPOConfig defaults it on:
the speed race gives TRL its faster setting; the flag races both paths with it, for `--find-max`).

Each path runs in its own process (its own peak memory: the CUDA allocator's peak, or peak RSS on CPU), one
micro-batch per step, one warm-up step, then `--steps` timed steps (CUDA-synchronised). `--find-max` doubles
the sequences per step until a path fails (out of memory) — on CUDA, once two peaks are known, it jumps to where
the peak, linear in the sequences, would reach 97 % of the device's memory — then bisects between the last fit
and the first failure to within an eighth of the fit, each attempt in its own process. For the Trainer paths the
table also shows `Trainer.memory_estimate` (the estimate `ludic-fast train` prints; the reference path's is
that of the fused head it replaces), to compare with the measured peak on a GPU.

    python bench/trainer_e2e.py                                  # CPU: small Llama, V=151936, 8 x 256 tokens
    python bench/trainer_e2e.py --device cuda                    # the Qwen2.5-0.5B shape, bf16, 16 x 1024 tokens
    python bench/trainer_e2e.py --device cuda --seqs 32 --paths ours-packed,reference
    python bench/trainer_e2e.py --device cuda --find-max         # largest sequences per step each path fits

Shapes: `small` (2 layers, D=256, untied), `qwen0.5b` (24 layers, D=896, intermediate 4864, 14 heads, 2 KV
heads, V=151936, tied — Qwen2.5-0.5B's dimensions). Sequence lengths are drawn in [(1 - spread) L, L]
(`--length-spread`, seeded), a quarter of each is prompt; tokens/s counts real tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import record_function

from ludic_fast.benchmark.worker import RESULT_PREFIX, PeakMemory
from ludic_fast.run.atomic_io import atomic_write_text

PATHS = ("ours-padded", "ours-packed", "ours-padded+kernels", "ours-packed+kernels", "ours-padded+compile",
         "ours-packed+compile", "reference", "trl", "trl+liger", "trl-fast")
#: --paths' default: every path but the compiled ones (a compile of minutes on the CPU; name them to race them)
DEFAULT_PATHS = tuple(p for p in PATHS if not p.endswith("+compile"))
SHAPES = {
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "tie_word_embeddings": True},
}
#: --dtype: the weights' dtype; "mixed-bf16" keeps fp32 weights and autocasts the forward to bf16 (ours:
#: TrainerConfig.mixed_precision_dtype, TRL: GRPOConfig(bf16=True)), as `ludic-fast train --dtype bf16` trains
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "mixed-bf16": torch.float32}


def split_path(path: str) -> tuple[str, str]:
    """(the path of PATHS, its packed attention): "ours-packed:flex" -> ("ours-packed", "flex"); "auto" where
    the path names none."""
    base, _, attention = path.partition(":")
    return base, attention or "auto"


def check_path(path: str) -> None:
    """SystemExit naming what is wrong with a path of --paths / --run."""
    from ludic_fast.integrations.packing import PACKED_ATTENTION_PATHS

    base, attention = split_path(path)
    if base not in PATHS:
        raise SystemExit(f"--paths: unknown path {base!r}; choose from {PATHS}")
    if ":" in path and "packed" not in base:
        raise SystemExit(f"--paths: {path!r}: only a packed path takes an attention after ':'")
    if attention not in PACKED_ATTENTION_PATHS:
        raise SystemExit(f"--paths: {path!r}: unknown packed attention {attention!r}; choose from "
                         f"{PACKED_ATTENTION_PATHS}")


def run_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments that choose the model, the batch and the paths (shared with bench/trainer_profile.py)."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: small on CPU, qwen0.5b on CUDA")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, help="override the shape's hidden size (intermediate = 2 x hidden)")
    p.add_argument("--layers", type=int, help="override the shape's layer count")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="weights' dtype, or mixed-bf16: fp32 weights + bf16 autocast "
                        "(default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attn", help="attention implementation (default: flash_attention_2 on CUDA with flash-attn, "
                                  "else sdpa)")
    p.add_argument("--seqs", type=int, help="sequences per step, one micro-batch (default: 8 CPU, 16 CUDA)")
    p.add_argument("--seq-len", type=int, help="longest sequence (default: 256 CPU, 1024 CUDA)")
    p.add_argument("--length-spread", type=float, default=0.5, help="lengths uniform in [(1 - spread) L, L]")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma-separated subset of {', '.join(PATHS)} (default: all but +compile); a packed "
                        "one may add ':ATTENTION'")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="every path recomputes each layer's activations in the backward (default: off for all)")
    return p


def _parser() -> argparse.ArgumentParser:
    p = run_arguments(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--find-max", action="store_true",
                   help="also double --seqs per path until it runs out of memory (CUDA), then bisect; report the "
                   "largest fit")
    p.add_argument("--find-max-seconds", type=float, default=240.0,
                   help="--find-max stops once this many seconds were spent on it, shared out among the "
                   "paths (default 240)")
    p.add_argument("--json", help="write the rows to this JSON file too (after every child)")
    p.add_argument("--markdown", help="write the table to this file too (after every child)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # one path in this process (internal)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Device-dependent defaults filled in place."""
    cuda = args.device == "cuda"
    args.shape = args.shape or ("qwen0.5b" if cuda else "small")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.seqs = args.seqs or (16 if cuda else 8)
    args.seq_len = args.seq_len or (1024 if cuda else 256)
    if args.attn is None:
        import importlib.util

        flash = cuda and importlib.util.find_spec("flash_attn") is not None
        args.attn = "flash_attention_2" if flash else "sdpa"
    if not 0.0 <= args.length_spread < 1.0:
        raise SystemExit(f"--length-spread must lie in [0, 1), got {args.length_spread}")
    for path in [*args.paths.split(","), *([args.run] if args.run else [])]:
        check_path(path)
    return args


def _model_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    shape = dict(SHAPES[args.shape])
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return LlamaConfig(vocab_size=args.vocab, max_position_embeddings=args.seq_len, pad_token_id=0,
                       attn_implementation=args.attn, **shape)


def _build_model(args: argparse.Namespace):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_model_config(args)).to(device=args.device, dtype=DTYPES[args.dtype])


def _items(args: argparse.Namespace) -> list:
    from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWItem

    g = torch.Generator().manual_seed(0)
    low = max(4, int(round((1 - args.length_spread) * args.seq_len)))
    items = []
    for i in range(args.seqs):
        n = int(torch.randint(low, args.seq_len + 1, (1,), generator=g)) if low < args.seq_len else args.seq_len
        prompt = max(1, n // 4)
        ids = torch.randint(3, args.vocab, (n,), generator=g).tolist()
        logps = (-torch.rand(n - prompt, generator=g) * 12).tolist()
        items.append(SAWItem(ids, [1] * n, [0] * prompt + [1] * (n - prompt), weight=1.0 if i % 2 else -1.0,
                             meta={"rollout_id": str(i)}, attachments=SampleAttachments(ActorTokenLogps(logps))))
    return items


class _FixedSource:
    """The same items every step, in a fresh list: the trainer replaces a batch's items (truncation, filters),
    never changes one in place (tests/test_bench_trainer_e2e.py), so no copy is made inside the timed step — as
    TRL's path gets its inputs built once outside it. (A deep copy of 16 x 1024 tokens took 8 ms a step.)"""

    def __init__(self, items):
        self.items = items

    async def next_batch(self):
        from ludic_fast.data.types import SAWBatch

        return SAWBatch(list(self.items))


def _ours_step(args: argparse.Namespace, path: str):
    from ludic_fast import reference
    from ludic_fast.algorithm import make_cispo
    from ludic_fast.trainer import Trainer, TrainerConfig

    class ReferencePathTrainer(Trainer):
        """The micro-batch loss through the model's logits and the reference (Ludic master's) CISPOLoss."""

        def micro_loss(self, batch):
            with self._autocast():
                logits = self.model(**self._model_inputs(batch)).logits
            return reference.CISPOLoss()(batch, logits=logits)

    base, attention = split_path(path)
    tokens = args.seqs * args.seq_len
    cfg = TrainerConfig(model_device=args.device, pad_token_id=0, sync_every_steps=0, max_seq_len=args.seq_len,
                        micro_token_budget=tokens, layout="packed" if "packed" in base else "padded",
                        packed_attention=attention, body_kernels=base.endswith("+kernels"),
                        compile_body=base.endswith("+compile"),
                        gradient_checkpointing=args.gradient_checkpointing,
                        mixed_precision_dtype="bf16" if args.dtype == "mixed-bf16" else None)
    cls = ReferencePathTrainer if base == "reference" else Trainer
    trainer = cls(model=_build_model(args), algo=make_cispo(group_size=2), batch_source=_FixedSource(_items(args)),
                  cfg=cfg)
    return trainer.train_step_sync, trainer.memory_estimate.total, trainer.model


def _trl_step(args: argparse.Namespace, liger: bool = False, fast: bool = False):
    """TRL's step: GRPOTrainer (`liger`: with use_liger_kernel) or, `fast`, FastGRPOTrainer."""
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ludic_fast.embedded import build_char_tokenizer
    from ludic_fast.integrations.trl import FastGRPOTrainer

    model = _build_model(args)
    items = _items(args)
    with tempfile.TemporaryDirectory() as out:
        trainer = (FastGRPOTrainer if fast else GRPOTrainer)(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(
                output_dir=out, per_device_train_batch_size=len(items), num_generations=len(items),
                max_completion_length=args.seq_len, report_to=[], use_cpu=args.device == "cpu",
                bf16=args.dtype == "mixed-bf16",
                save_strategy="no", loss_type="cispo", beta=0.0, use_liger_kernel=liger,
                gradient_checkpointing=args.gradient_checkpointing, learning_rate=1e-5, weight_decay=0.01,
            ),
            train_dataset=Dataset.from_list([{"prompt": "1+1="}] * len(items)),
            processing_class=build_char_tokenizer(),
        )
    _as_train_starts(trainer)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.train()
    inputs = _trl_inputs(items, args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = trainer.create_optimizer()  # its own default: GRPOConfig.optim, adamw_torch_fused

    def step() -> None:  # the engine's phase labels (ludic_fast.engine.trainer), for bench/trainer_profile.py
        with record_function("step/forward_loss"):
            loss = trainer.compute_loss(model, inputs)
        with record_function("step/backward"):
            loss.backward()
        with record_function("step/clip"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        with record_function("step/optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step, None, model


def _as_train_starts(trainer) -> None:
    """What transformers' `Trainer.train()` (5.17 to 5.24) does to the model before its first step, for the
    settings the bench gives TRL: Liger's kernels patched in (`use_liger_kernel`), activation checkpointing on
    (`gradient_checkpointing`, with its kwargs)."""
    args = trainer.args
    if args.use_liger_kernel:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, args.liger_kernel_config)
    if getattr(args, "activation_checkpointing", args.gradient_checkpointing):  # the former name until 5.17
        given = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
        kwargs = dict(given or {})
        layout = {"every_n_layers": kwargs.pop("every_n_layers", 1), "offload": kwargs.pop("offload", False)}
        if hasattr(trainer.model, "activation_checkpointing_enable"):
            trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **layout)
        else:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **layout)


def _trl_inputs(items: list, device: str) -> dict:
    """TRL's layout of the same sequences: left-padded prompts, right-padded completions, advantages [B],
    the behaviour logprobs of the completion tokens as old_per_token_logps."""
    prompts = [it.action_mask.index(1) for it in items]
    P, C = max(prompts), max(len(it.input_ids) - p for it, p in zip(items, prompts))
    B = len(items)
    out = {"prompt_ids": torch.zeros(B, P, dtype=torch.long), "prompt_mask": torch.zeros(B, P, dtype=torch.long),
           "completion_ids": torch.zeros(B, C, dtype=torch.long),
           "completion_mask": torch.zeros(B, C, dtype=torch.long), "old_per_token_logps": torch.zeros(B, C),
           "advantages": torch.tensor([it.weight for it in items], dtype=torch.float32)}
    for b, (it, p) in enumerate(zip(items, prompts)):
        c = len(it.input_ids) - p
        out["prompt_ids"][b, P - p:] = torch.tensor(it.input_ids[:p])
        out["prompt_mask"][b, P - p:] = 1
        out["completion_ids"][b, :c] = torch.tensor(it.input_ids[p:])
        out["completion_mask"][b, :c] = 1
        out["old_per_token_logps"][b, :c] = torch.tensor(it.actor_logps.token_logps)
    out = {k: v.to(device) for k, v in out.items()}
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_step(args: argparse.Namespace, path: str):
    """(step(), the Trainer's memory estimate or None, the model) of one path, built in this process."""
    if path.startswith("trl"):
        return _trl_step(args, liger=path == "trl+liger", fast=path == "trl-fast")
    return _ours_step(args, path)


def skip_reason(args: argparse.Namespace, path: str) -> str | None:
    """Why `path` cannot run here (None: it can)."""
    import importlib.util

    base, attention = split_path(path)
    if base.endswith(("+kernels", "+liger")) and args.device != "cuda":
        return "CUDA only (Liger-Kernel's kernels)"
    if attention == "flex" and args.device != "cuda":
        return "CUDA only (flex attention has no backward on CPU)"
    if base.startswith("trl") and importlib.util.find_spec("trl") is None:
        return "trl is not installed"
    if base.endswith(("+kernels", "+liger")) and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    return None


def run_path(args: argparse.Namespace, path: str) -> dict:
    """Build, warm up and time one path in this process; peak memory over the warm-up and timed steps."""
    from ludic_fast.integrations.packing import attention_implementation

    torch.set_num_threads(args.threads)
    memory = PeakMemory(args.device)
    step, estimate, model = build_step(args, path)
    memory.reset()
    step()  # warm-up (AdamW allocates its states here)
    times = []
    for _ in range(args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(it.input_ids) for it in _items(args))
    median = statistics.median(times)
    capacity = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    return {"path": path, "median_s": median, "min_s": min(times), "tokens": tokens, "tokens_per_s": tokens / median,
            "peak_bytes": memory.peak(), "estimate_bytes": estimate, "capacity_bytes": capacity,
            "attention": attention_implementation(model)}  # as run: the packed path may have moved it


def _child(args: argparse.Namespace, path: str, seqs: int | None = None, timeout: float | None = None) -> dict:
    """Run one path in a fresh process; {"skipped": reason} when it cannot run here or runs out of memory,
    {"skipped": "failed: ...", "failed": True} when it fails otherwise (the run goes on with the next path), and
    {"skipped": "time cap", "time_cap": True} when it is still running after `timeout` seconds (then killed)."""
    reason = skip_reason(args, path)
    if reason is not None:
        return {"path": path, "skipped": reason}
    argv = [*sys.argv[1:]] if args.argv is None else list(args.argv)
    argv = [a for a in argv if a != "--find-max"]
    if seqs is not None:
        argv += ["--seqs", str(seqs)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        proc = subprocess.run([sys.executable, __file__, *argv, "--run", path], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": path, "skipped": "time cap", "time_cap": True}
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if line is None:
        err = proc.stderr.strip()
        if "OutOfMemoryError" in err or "out of memory" in err:
            return {"path": path, "skipped": "out of memory"}
        print(f"[e2e] {path} failed (exit {proc.returncode}):\n{err[-1500:]}", file=sys.stderr, flush=True)
        last = err.splitlines()[-1][:200] if err else f"exit {proc.returncode}"
        return {"path": path, "skipped": f"failed: {last}", "failed": True}
    return json.loads(line[len(RESULT_PREFIX):])


def _largest_fit(args: argparse.Namespace, path: str, first: dict, deadline: float) -> str | None:
    """The largest sequences per step the path fits: from --seqs, double (on CUDA, once two peaks are known,
    jump to where the peak memory, linear in the sequences, reaches 97 % of the device's), then bisect between
    the last fit and the first failure until they are within an eighth of the fit; stop at the
    --find-max-seconds deadline (time.monotonic), an attempt still running then ended: the largest that ran,
    '>= n' when cut by the deadline."""
    if "skipped" in first:
        return None
    fit, fail = args.seqs, None
    peaks = {args.seqs: first.get("peak_bytes")}
    while fail is None or fail - fit > max(1, fit // 8):
        left = deadline - time.monotonic()
        if left <= 0:
            return f">= {fit} (time cap)"
        trial = (fit + fail) // 2 if fail is not None else _predicted_fit(peaks, first.get("capacity_bytes"), fit)
        row = _child(args, path, trial, timeout=left)  # an attempt past the deadline is ended there
        if row.get("time_cap"):
            return f">= {fit} (time cap)"
        if "skipped" in row:
            fail = trial
        else:
            fit, peaks[trial] = trial, row.get("peak_bytes")
    return str(fit)


def _predicted_fit(peaks: dict[int, int | None], capacity: int | None, fit: int) -> int:
    """The next size to try while nothing failed yet: twice the fit, or (a device capacity and two peaks known)
    the size whose peak, extrapolated linearly from the two largest, is 97 % of the capacity — at least an
    eighth above the fit."""
    known = sorted((n, b) for n, b in peaks.items() if b)
    if capacity is None or len(known) < 2:
        return fit * 2
    (n0, b0), (n1, b1) = known[-2:]
    slope = (b1 - b0) / (n1 - n0)
    if slope <= 0:
        return fit * 2
    return max(fit + max(1, fit // 8), int(n1 + (0.97 * capacity - b1) / slope))


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    """Markdown table of the rows (ratios against the reference path where it ran)."""
    cfg = _model_config(args)
    head = (f"CISPO training step, Llama ({cfg.num_hidden_layers} layers, D={cfg.hidden_size}, V={cfg.vocab_size}, "
            f"{'tied' if cfg.tie_word_embeddings else 'untied'}), {args.dtype}, attn {args.attn}, {args.device}, "
            f"{args.seqs} sequences of <= {args.seq_len} tokens (spread {args.length_spread}), "
            f"1 warm-up + {args.steps} steps"
            f"{', activation checkpointing' if args.gradient_checkpointing else ''}\n\n")
    ref = next((r for r in rows if r["path"] == "reference" and "skipped" not in r), None)
    fit = any("max_seqs" in r for r in rows)
    lines = ["| path | median step s | min step s | tokens/s | peak GiB | estimate GiB | step / reference |"
             + (" largest seqs/step |" if fit else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if fit else "")]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['path']} | {r['skipped']} | | | | | |" + (" |" if fit else ""))
            continue
        ratio = f"{r['median_s'] / ref['median_s']:.2f}" if ref else "-"
        estimate = f"{r['estimate_bytes'] / 2**30:.2f}" if r.get("estimate_bytes") else "-"
        extra = f" {r.get('max_seqs') or '-'} |" if fit else ""
        lines.append(f"| {r['path']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | {estimate} | {ratio} |{extra}")
    ran = [f"{r['path']} {r['attention']}" for r in rows if r.get("attention")]
    return head + "\n".join(lines) + (f"\n\nAttention as run: {', '.join(ran)}." if ran else "")


def main(argv: list[str] | None = None) -> int:
    args = resolve(_parser().parse_args(argv))
    args.argv = argv
    if args.run:
        print(RESULT_PREFIX + json.dumps(run_path(args, args.run)), flush=True)
        return 0
    rows: list[dict] = []

    def save(done: str) -> None:  # after every child: a run stopped midway keeps its rows (--json)
        print(f"[e2e] {done}", file=sys.stderr, flush=True)
        if args.json:
            payload = {"args": {k: v for k, v in vars(args).items() if k != "argv"}, "rows": rows}
            atomic_write_text(args.json, json.dumps(payload, indent=1))
        if args.markdown:
            atomic_write_text(args.markdown, table(args, rows) + "\n")

    for path in args.paths.split(","):  # every path's step first, then (--find-max) the largest batches
        row = _child(args, path)
        rows.append(row)
        save(f"{path}: {row['skipped']}" if "skipped" in row else f"{path}: median step {row['median_s']:.3f} s")
    end = time.monotonic() + args.find_max_seconds  # shared out among the paths that ran, in turn
    for i, row in enumerate(rows if args.find_max else ()):
        share = (end - time.monotonic()) / max(1, sum("skipped" not in r for r in rows[i:]))
        row["max_seqs"] = _largest_fit(args, row["path"], row, time.monotonic() + share)
        save(f"{row['path']}: largest sequences per step {row['max_seqs']}")
    print(table(args, rows))
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
