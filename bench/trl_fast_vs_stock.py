"""One GRPO loss forward + backward: ludic_fast's FastGRPOTrainer against stock TRL 1.16 GRPOTrainer.

Both trainers get the same model (a one-layer Llama-architecture model with a large vocabulary, built
from a config, seeded, tied embeddings) and the same batch; each runs in its own process so peak memory
is its own. Reported side by side: median wall time of `compute_loss(...).backward()` and the process's
peak RSS (and its rise over the RSS just before the timed calls), with ratios fast / stock.

    .venv/bin/python bench/trl_fast_vs_stock.py --repeats 3           # V=151936, D=896, N=2048 tokens
    .venv/bin/python bench/trl_fast_vs_stock.py --vocab 32000 --completion 64 --loss-type cispo

On-policy inputs (no old logprobs, TRL's default single iteration), beta=0, the default loss "dapo".
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ludic_fast.embedded import build_char_tokenizer
    from ludic_fast.integrations.trl import FastGRPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=1,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64, tie_word_embeddings=True,
        max_position_embeddings=args.prompt + args.completion,
    )
    model = LlamaForCausalLM(config)
    cls = FastGRPOTrainer if args.worker == "fast" else GRPOTrainer
    with tempfile.TemporaryDirectory() as out:
        trainer = cls(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(
                output_dir=out, per_device_train_batch_size=args.batch, num_generations=args.batch,
                max_completion_length=args.completion, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, save_strategy="no", loss_type=args.loss_type, beta=0.0,
            ),
            train_dataset=Dataset.from_list([{"prompt": "1+1="}] * args.batch),
            processing_class=build_char_tokenizer(),
        )
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(1)
    B, P, C = args.batch, args.prompt, args.completion
    inputs = {
        "prompt_ids": torch.randint(0, args.vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(0, args.vocab, (B, C), generator=g),
        "completion_mask": torch.ones(B, C, dtype=torch.long),
        "advantages": torch.randn(B, generator=g),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    model = trainer.model.train()
    base_rss = _rss_bytes()
    times, losses = [], []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_norm = float(torch.linalg.vector_norm(model.lm_head.weight.grad))
    return {"impl": args.worker, "seconds": statistics.median(times), "all_seconds": times, "peak_rss": peak,
            "peak_rise": peak - base_rss, "loss": losses[0], "lm_head_grad_norm": grad_norm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["stock", "fast"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    argv = [a for a in sys.argv[1:]]
    results = {}
    for impl in ("stock", "fast"):
        proc = subprocess.run([sys.executable, __file__, *argv, "--worker", impl], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{impl} worker failed:\n{proc.stderr[-4000:]}")
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    s, f = results["stock"], results["fast"]
    gib = 2.0**30
    n_tokens = args.batch * args.completion
    print(f"GRPO loss fwd+bwd, loss_type={args.loss_type}, N={n_tokens} completion tokens, D={args.hidden}, "
          f"V={args.vocab}, fp32, {args.threads} threads, median of {args.repeats}")
    print(f"{'':24}{'stock TRL':>12}{'FastGRPO':>12}{'fast/stock':>12}")
    print(f"{'time [s], median':24}{s['seconds']:12.2f}{f['seconds']:12.2f}{f['seconds'] / s['seconds']:12.2f}")
    s_min, f_min = min(s["all_seconds"]), min(f["all_seconds"])
    print(f"{'time [s], min':24}{s_min:12.2f}{f_min:12.2f}{f_min / s_min:12.2f}")
    print(f"{'peak RSS [GiB]':24}{s['peak_rss'] / gib:12.2f}{f['peak_rss'] / gib:12.2f}"
          f"{f['peak_rss'] / s['peak_rss']:12.2f}")
    print(f"{'peak rise in loss [GiB]':24}{s['peak_rise'] / gib:12.2f}{f['peak_rise'] / gib:12.2f}"
          f"{f['peak_rise'] / max(s['peak_rise'], 1):12.2f}")
    print(f"{'loss':24}{s['loss']:12.6f}{f['loss']:12.6f}")
    print(f"{'|grad lm_head|':24}{s['lm_head_grad_norm']:12.6f}{f['lm_head_grad_norm']:12.6f}")


if __name__ == "__main__":
    main()
