"""Where one training step's time goes, per path of `bench/trainer_e2e.py` (the same model, sequences, flags
and path builders): a phase table, the top ops, and every host read / host-device synchronisation in the step.

    python bench/trainer_profile.py --hidden 256 --layers 6 --vocab 4099 --out bench/results/profile-cpu
    python bench/trainer_profile.py --device cuda --seconds 120 --out bench/results/gpu/profile

Each path runs `--runs` times, one after the other in this process (the imports and the kernels' compilation
paid once, so more paths fit a GPU's time budget), or each in its own process with `--isolate`: one warm-up step,
`--steps` steps timed without the profiler (the median is the step time), `--steps` steps under
`torch.profiler`, then one step under the host read counter. A path that fails (out of memory, an error) is
reported as such and the next one runs.

Phases are the `record_function` labels the engine's step carries (`ludic_fast.engine.trainer`; the TRL path's
step in trainer_e2e carries the same ones), per step, host time (the CPU span of the label):

- collation / host: `step/collate` (ours: split, collate, copy to the device; TRL: none, its inputs are
  built once outside the step, as its generation step would hand them over);
- body forward: `step/body_forward` (ours: the engine's label; reference and TRL: a label put around the
  decoder's forward by this script); head + loss: the rest of `step/forward_loss` (the engine labels it
  `step/head_loss`; for TRL it is its chunked LM head, the logprobs and the CISPO loss); forward, rest (ours
  only): `step/forward_loss` less those two (the model's inputs: the packed path's attention inputs, e.g. a
  flex BlockMask built for the step's sequence bounds);
- backward `step/backward`, clip `step/clip`, host read `step/host_read` (ours: the step's one host sync),
  optimizer `step/optimizer` (AdamW, schedule, zero_grad), stats `step/stats` (stats, logging);
- other: the profiled step's wall time less the phases (the fetch of the batch, Python between phases).

On CUDA each phase also has its device span (the profiler's GPU-side range of the label, where it reports
one), and the step its device busy time (the sum of its kernels' times) beside the wall time: a wall time well
above the busy time is a step the host holds back. The aten ops per step (and on CUDA the device events per
step) count the work the host dispatches, each op a few microseconds of host time on a GPU.

Per path also: the attention implementation the model ran with (the packed path may have moved it, e.g. to
flex attention on CUDA) and the graphs torch.compile compiled in the timed and profiled steps (dynamo's count:
each a stall inside a timed step, e.g. a recompile of flex attention for a new shape).

Host reads: on CUDA every synchronising call torch reports
under `torch.cuda.set_sync_debug_mode("warn")`; on the CPU every read of a tensor's value
(`ludic_fast.engine.host_syncs`), with where it happens.

Writes `profile.md` (every path's phase table, host reads and top ops) and `profile.jsonl` (one record per run)
into `--out`, rewritten the moment each run ends (a cut loses no finished run). `--seconds` bounds the whole
script: each run may use the time left less 12 s for each run after it (at least its even share: the first run
pays the imports and the kernels' compilation), steps are cut to fit it, a run over it is stopped (an alarm in
this process, a kill with `--isolate`) and reported as cut; time a run leaves unused goes to the next.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters as compile_counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainer_e2e  # noqa: E402  (the path builders and model flags)

from ludic_fast.benchmark.worker import RESULT_PREFIX  # noqa: E402
from ludic_fast.engine.host_syncs import CudaSyncs, HostReads  # noqa: E402
from ludic_fast.integrations.packing import attention_implementation  # noqa: E402
from ludic_fast.run.atomic_io import atomic_write_text  # noqa: E402

#: the two the race is about first, then the packed path on SDPA over nested tensors (on CUDA "auto" takes flex
#: attention: which packed attention is faster) and ours-padded (the same layout as TRL: packing's share of the
#: gap); a budget cut drops the last. Six, so that the first run (which pays the imports and the compiles) may
#: take the --seconds less 5 x RESERVE_S; the reference path (logits) is left to --paths
DEFAULT_PATHS = ("ours-packed", "trl", "ours-packed:sdpa_varlen", "ours-padded", "ours-packed+kernels", "trl+liger")
#: seconds kept for each run after the current one (module docstring)
RESERVE_S = 12.0
#: (row, labels summed): the table's phases
PHASES = (("collation / host", ("step/collate",)), ("body forward", ("step/body_forward",)),
          ("head + loss", ()), ("backward", ("step/backward",)), ("clip", ("step/clip",)),
          ("host read", ("step/host_read",)), ("optimizer", ("step/optimizer",)), ("stats / logging", ("step/stats",)))
TOP = 10


def _parser() -> argparse.ArgumentParser:
    p = trainer_e2e.run_arguments(argparse.ArgumentParser(description=__doc__,
                                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    p.set_defaults(paths=",".join(DEFAULT_PATHS))
    p.add_argument("--out", required=True, help="folder for profile.md and profile.jsonl")
    p.add_argument("--seconds", type=float, default=120.0, help="the whole script's time budget (default 120)")
    p.add_argument("--runs", type=int, default=1, help="runs per path (the table shows median and range)")
    p.add_argument("--isolate", action="store_true", help="each run in its own process")
    p.add_argument("--run", help=argparse.SUPPRESS)  # one path in this process
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # time.time() the child must end by
    return p


# ------------------------------------------------------------------------------------------ one path (child)
def _label_body(model: torch.nn.Module) -> None:
    """record_function("step/body_forward") around the decoder's forward (paths whose step has no such label)."""
    body = model.get_decoder()
    ranges = []

    def enter(module, args, kwargs):
        ranges.append(torch.autograd.profiler.record_function("step/body_forward").__enter__())

    def leave(module, args, kwargs, output):
        ranges.pop().__exit__(None, None, None)

    body.register_forward_pre_hook(enter, with_kwargs=True)
    body.register_forward_hook(leave, with_kwargs=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step, device: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def profile_path(args: argparse.Namespace, path: str, deadline: float | None = None) -> dict:
    """Build, warm up, time, profile and count the host reads of one path in this process; steps cut so that
    it ends by `deadline` (time.time())."""
    torch.set_num_threads(args.threads)
    step, _, model = trainer_e2e.build_step(args, path)
    if path == "reference" or path.startswith("trl"):
        _label_body(model)
    warm = _timed(step, args.device, 1)[0]
    graphs = compile_counters["stats"]["unique_graphs"]
    fit = args.steps if deadline is None else int(((deadline - time.time()) / max(warm, 1e-6) - 2) / 2.5)
    steps = max(1, min(args.steps, fit))  # timed + profiled (+ overhead) steps by the deadline
    times = _timed(step, args.device, steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(args.device)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = _timed(step, args.device, steps)
    compiled = compile_counters["stats"]["unique_graphs"] - graphs  # in the timed and profiled steps
    reads = CudaSyncs() if args.device == "cuda" else HostReads()
    with reads:
        step()
    _sync(args.device)
    tokens = sum(len(it.input_ids) for it in trainer_e2e._items(args))
    return {"path": path, "attention": attention_implementation(model),
            "compiled_after_warmup": compiled,
            "steps": steps, "step_s": statistics.median(times), "profiled_step_s":
            statistics.mean(profiled), "tokens": tokens, **_phases(prof, steps, args.device == "cuda"),
            "top": _top(prof, steps, args.device == "cuda"),
            "host_reads": {"kind": "cuda sync" if args.device == "cuda" else "host read (CPU)",
                           "count": len(reads), "where": reads.where()}}


def _phases(prof, steps: int, cuda: bool) -> dict:
    """Per step: host ms of every step/ label, device-span ms where the profiler gives the label a GPU range,
    device busy ms (the sum of the kernels' times)."""
    host: dict[str, float] = {}
    device: dict[str, float] = {}
    for evt in prof.events():
        if not evt.name.startswith("step/"):
            continue
        ms = evt.time_range.elapsed_us() / 1e3 / steps
        on_device = evt.device_type != torch.autograd.DeviceType.CPU
        table = device if on_device else host
        table[evt.name] = table.get(evt.name, 0.0) + ms
    busy = sum(e.self_device_time_total for e in _device_events(prof)) / 1e3 / steps if cuda else None
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps
    kernels = sum(e.count for e in _device_events(prof)) / steps if cuda else None
    return {"host_ms": host, "device_ms": device, "device_busy_ms": busy, "aten_ops": ops, "device_events": kernels,
            "top_level_ops": _ops_by_label(prof, steps)}


def _ops_by_label(prof, steps: int) -> dict[str, float]:
    """Per step, the aten ops called from Python (no aten op above them), by the innermost step/ label around
    them ("(none)": outside every label)."""
    out: dict[str, float] = {}
    for evt in prof.events():
        if not evt.name.startswith("aten::") or evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        label, parent = "(none)", evt.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                break
            if label == "(none)" and parent.name.startswith("step/"):
                label = parent.name
            parent = parent.cpu_parent
        if parent is None:
            out[label] = out.get(label, 0.0) + 1 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _device_events(prof) -> list:
    """The device's own events (kernels, copies, memsets), as torch's profiler table totals them."""
    return [e for e in prof.key_averages()
            if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation]


def _top(prof, steps: int, cuda: bool) -> dict[str, list[dict]]:
    """Per step: the TOP host ops by their own CPU time and, on CUDA, the TOP device events by their time."""
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU
            and not e.key.startswith(("step/", "ProfilerStep"))]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    out = {"host": [{"op": e.key[:90], "calls": e.count / steps, "ms": e.self_cpu_time_total / 1e3 / steps}
                    for e in host[:TOP]]}
    if cuda:
        device = sorted(_device_events(prof), key=lambda e: e.self_device_time_total, reverse=True)
        out["device"] = [{"op": e.key[:90], "calls": e.count / steps, "ms": e.self_device_time_total / 1e3 / steps}
                         for e in device[:TOP]]
    return out


# --------------------------------------------------------------------------------------------- the table
def phase_rows(record: dict) -> dict[str, float | None]:
    """{phase: host ms per step} of one run (module docstring); None for a phase the path's step has no label
    for."""
    host = record["host_ms"]
    out: dict[str, float | None] = {
        name: sum(host[label] for label in labels if label in host) if any(label in host for label in labels)
        else None for name, labels in PHASES}
    head = host.get("step/head_loss")
    forward = host.get("step/forward_loss")
    out["head + loss"] = head if head is not None else None if forward is None else forward - (out["body forward"] or 0)
    out["forward, rest"] = None if head is None or forward is None else forward - head - (out["body forward"] or 0)
    top_level = ("step/collate", "step/forward_loss", "step/backward", "step/clip", "step/host_read",
                 "step/optimizer", "step/stats")
    out["other"] = record["profiled_step_s"] * 1e3 - sum(host.get(label, 0.0) for label in top_level)
    return out


def _spread(values: list[float | None], fmt: str = "{:.1f}") -> str:
    if any(v is None for v in values):
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def markdown(args: argparse.Namespace, records: list[dict]) -> str:
    """Every path's phase table (median and range over its runs), host reads and top ops."""
    cfg = trainer_e2e._model_config(args)
    lines = [f"# Step profile: CISPO step, Llama ({cfg.num_hidden_layers} layers, D={cfg.hidden_size}, "
             f"V={cfg.vocab_size}), {args.dtype}, attn {args.attn}, {args.device}, {args.seqs} sequences of <= "
             f"{args.seq_len} tokens; ms per step, median (min–max) over runs", ""]
    paths = list(dict.fromkeys(r["path"] for r in records))
    done = {p: [r for r in records if r["path"] == p and "skipped" not in r] for p in paths}
    ran = [p for p in paths if done[p]]
    if ran:
        lines += ["| phase | " + " | ".join(ran) + " |", "|---" * (len(ran) + 1) + "|"]
        rows = {p: [phase_rows(r) for r in done[p]] for p in ran}
        for name in [n for n, _ in PHASES] + ["forward, rest", "other"]:
            lines.append(f"| {name} | " + " | ".join(_spread([r[name] for r in rows[p]]) for p in ran) + " |")
        for label, key, scale in (("step, profiled", "profiled_step_s", 1e3), ("step, unprofiled", "step_s", 1e3)):
            lines.append(f"| **{label}** | " + " | ".join(_spread([r[key] * scale for r in done[p]]) for p in ran)
                         + " |")
        if args.device == "cuda":
            lines.append("| device busy (kernels) | " + " | ".join(
                _spread([r["device_busy_ms"] for r in done[p]]) for p in ran) + " |")
        lines.append("| aten ops per step (each may launch kernels) | " + " | ".join(
            _spread([r.get("aten_ops") for r in done[p]], "{:.0f}") for p in ran) + " |")
        if args.device == "cuda":
            lines.append("| device events (kernels, copies) per step | " + " | ".join(
                _spread([r.get("device_events") for r in done[p]], "{:.0f}") for p in ran) + " |")
        lines.append("| host reads in the step | " + " | ".join(
            _spread([float(r["host_reads"]["count"]) for r in done[p]], "{:.0f}") for p in ran) + " |")
        lines.append("| graphs compiled after the warm-up | " + " | ".join(
            _spread([float(r.get("compiled_after_warmup", 0)) for r in done[p]], "{:.0f}") for p in ran) + " |")
        lines.append("| attention implementation | " + " | ".join(
            str(done[p][-1].get("attention")) for p in ran) + " |")
    for p in paths:
        if not done[p]:
            lines += ["", f"{p}: {next(r['skipped'] for r in records if r['path'] == p)}"]
            continue
        last = done[p][-1]
        lines += ["", f"## {p}", "", f"{last['host_reads']['kind']}: {last['host_reads']['count']} in one step"]
        lines += [f"- {n} × {w}" for w, n in last["host_reads"]["where"].items()]
        if last.get("top_level_ops"):
            lines += ["", "aten ops called from Python, per step, by label: " + ", ".join(
                f"{k} {v:.0f}" for k, v in last["top_level_ops"].items())]
        if last["device_ms"]:
            lines += ["", "device span per label (ms per step): " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(last["device_ms"].items()))]
        for where in ("device", "host"):
            if where in last["top"]:
                lines += ["", f"| top {where} op (own time) | calls / step | ms / step |", "|---|---|---|"]
                lines += [f"| `{t['op']}` | {t['calls']:.0f} | {t['ms']:.2f} |" for t in last["top"][where]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ parent
def _child(args: argparse.Namespace, argv: list[str], path: str, seconds: float) -> dict:
    reason = trainer_e2e.skip_reason(args, path)
    if reason is not None:
        return {"path": path, "skipped": reason}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    argv = [a for a in argv if a != "--isolate"]
    cmd = [sys.executable, __file__, *argv, "--run", path, "--deadline", str(time.time() + seconds)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
        return {"path": path, "skipped": f"cut by --seconds after {seconds:.0f} s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if line is None:
        err = proc.stderr.strip()
        print(f"[profile] {path} failed (exit {proc.returncode}):\n{err[-1500:]}", file=sys.stderr, flush=True)
        return {"path": path, "skipped": f"failed: {err.splitlines()[-1][:200] if err else proc.returncode}",
                "failed": True}
    return json.loads(line[len(RESULT_PREFIX):])


class _Cut(Exception):
    pass


def _alarm(signum, frame):
    raise _Cut


def _in_process(args: argparse.Namespace, path: str, seconds: float) -> dict:
    """One run of `path` in this process, stopped by an alarm after `seconds`."""
    reason = trainer_e2e.skip_reason(args, path)
    if reason is not None:
        return {"path": path, "skipped": reason}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        return profile_path(args, path, deadline=time.time() + seconds)
    except _Cut:
        return {"path": path, "skipped": f"cut by --seconds after {seconds:.0f} s"}
    except Exception as exc:  # noqa: BLE001 (out of memory or a failure: reported, the next path runs)
        oom = isinstance(exc, torch.OutOfMemoryError)
        print(f"[profile] {path} failed: {exc!r}"[:2000], file=sys.stderr, flush=True)
        return {"path": path, "skipped": "out of memory" if oom else f"failed: {type(exc).__name__}: {exc}"[:200],
                "failed": not oom}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = trainer_e2e.resolve(_parser().parse_args(argv))
    if args.runs < 1 or args.steps < 1 or args.seconds <= 0:
        raise SystemExit("--runs and --steps must be >= 1, --seconds > 0")
    if args.run:
        print(RESULT_PREFIX + json.dumps(profile_path(args, args.run, args.deadline)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.seconds
    todo = [p for _ in range(args.runs) for p in args.paths.split(",")]
    records: list[dict] = []
    for i, path in enumerate(todo):
        left, after = end - time.monotonic(), len(todo) - i - 1
        share = max(left - RESERVE_S * after, left / (after + 1))
        if share <= 1.0:
            record = {"path": path, "skipped": "no time left (--seconds)"}
        else:
            record = _child(args, argv, path, share) if args.isolate else _in_process(args, path, share)
        records.append(record)
        # the table first: a run in profile.jsonl is in profile.md too, whenever the process is killed
        atomic_write_text(str(out / "profile.md"), markdown(args, records))
        atomic_write_text(str(out / "profile.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
        done = record.get("skipped") or f"step {record['step_s']:.3f} s, {record['host_reads']['count']} host reads"
        print(f"[profile] {path}: {done}", file=sys.stderr, flush=True)
    print((out / "profile.md").read_text())
    return 1 if any(r.get("failed") for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
