"""Rollout throughput of VLLMSampler vs the transformers sampler (HFSampler) on the same model and sampling,
and the mismatch of vLLM's behaviour log-probs against the trainer's fp32 recomputation, side by side in one run.

The model is the embedded tiny Llama (`ludic_fast.embedded`, random init, seeded; `--lm-head-scale` sharpens its
next-token distributions), saved to a temporary folder and served by vLLM (vLLM's CPU build on a CPU). Both
engines sample `--prompts` completions of the embedded task's prompts (cycled) at `--temperature`, at most
`--max-new-tokens` each, with the same seed; tokens/s counts the sampled tokens, after one warm-up call each,
the median of `--repeats` timed calls. Mismatch: max and mean |vLLM logprob - log_softmax(z / T)[y]| over every
sampled token, z the fp32 model's logits (what the trainer recomputes with fp32 master weights).

    python bench/vllm_rollout.py                      # fp32 engine (needs vllm: .venv-vllm on a CPU)
    python bench/vllm_rollout.py --dtype bfloat16     # the engine in bf16 against the fp32 trainer
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.rollout import HFSampler, SamplingConfig, embedded_default_task
from ludic_fast.rollout.vllm_sampler import VLLMSampler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the vLLM engine's dtype")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lm-head-scale", type=float, default=20.0)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (sampling)")
    return args


def timed(engine, prompts, sampling, repeats: int) -> tuple[float, list]:
    """(median sampled tokens per second over `repeats` calls after a warm-up, the last call's completions)."""
    engine.generate(prompts, sampling, seed=0)
    rates, out = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling, seed=r + 1)
        rates.append(sum(len(c.completion_ids) for c in out) / (time.perf_counter() - t0))
    return statistics.median(rates), out


@torch.no_grad()
def logprob_mismatch(model, completions, temperature: float) -> tuple[float, float]:
    """(max, mean) |behaviour logprob - log_softmax(z / T)[y]| over all sampled tokens, z the fp32 model's logits."""
    diffs = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0]
        diffs.append((torch.tensor(c.logprobs) - ref).abs())
    flat = torch.cat(diffs)
    return float(flat.max()), float(flat.mean())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(args.lm_head_scale)
    rows = embedded_default_task(seed=0).samples
    prompts = [tok.encode(rows[i % len(rows)]["prompt"], add_special_tokens=False) for i in range(args.prompts)]
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    threads = torch.get_num_threads()
    hf_rate, _ = timed(HFSampler(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
                       prompts, sampling, args.repeats)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        engine = VLLMSampler(path, eos_token_id=tok.eos_token_id, seed=0, dtype=args.dtype,
                            max_model_len=model.config.max_position_embeddings, enforce_eager=args.enforce_eager,
                            kv_cache_memory_bytes=256 << 20)
        vllm_rate, completions = timed(engine, prompts, sampling, args.repeats)
    worst, mean = logprob_mismatch(model, completions, args.temperature)
    print(f"embedded tiny Llama, {args.prompts} prompts x <= {args.max_new_tokens} new tokens, T={args.temperature}, "
          f"torch threads {threads}, vLLM dtype {args.dtype}{' (eager)' if args.enforce_eager else ''}")
    print("| engine | sampled tokens/s | vs transformers |")
    print("|---|---:|---:|")
    print(f"| transformers generate (fp32) | {hf_rate:,.0f} | 1.00x |")
    print(f"| vLLM ({args.dtype}) | {vllm_rate:,.0f} | {vllm_rate / hf_rate:.2f}x |")
    print(f"vLLM {args.dtype} logprobs vs the fp32 trainer's log_softmax(z / T): max abs diff {worst:.2e}, "
          f"mean {mean:.2e}")


if __name__ == "__main__":
    main()
