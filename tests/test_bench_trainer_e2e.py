"""bench/trainer_e2e.py at a tiny shape on CPU: every path that runs here produces a row (ours padded / packed,
the reference loss path, stock TRL's step), the body-kernel rows say they need CUDA; TRL's input layout of the
same sequences, by hand."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from _scripts import load_script

from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWItem

BENCH = Path(__file__).resolve().parents[1] / "bench" / "trainer_e2e.py"


def _bench():
    return load_script(BENCH, "trainer_e2e")


def test_trl_inputs_layout():
    bench = _bench()
    items = [SAWItem([5, 6, 7, 8, 9], [1] * 5, [0, 0, 1, 1, 1], weight=0.5, meta={},
                     attachments=SampleAttachments(ActorTokenLogps([-1.0, -2.0, -3.0]))),
             SAWItem([4, 3, 2], [1] * 3, [0, 1, 1], weight=-1.0, meta={},
                     attachments=SampleAttachments(ActorTokenLogps([-4.0, -5.0])))]
    out = bench._trl_inputs(items, "cpu")
    assert out["prompt_ids"].tolist() == [[5, 6], [0, 4]] and out["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert out["completion_ids"].tolist() == [[7, 8, 9], [3, 2, 0]]
    assert out["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["old_per_token_logps"].tolist() == [[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]]
    assert out["advantages"].tolist() == [0.5, -1.0] and int(out["num_items_in_batch"]) == 5


def _children_here_but(monkeypatch, bench, real: str) -> None:
    """Each child (`trainer_e2e.py ARGS --run PATH`) through the script's own main(ARGS) in this process, its
    stdout and stderr captured as a process's would be; the path `real` in a fresh process, as the script runs
    every path (one interpreter start with torch, transformers and TRL costs seconds; the children's rows do
    not depend on where they run, only their peak memory, of which the test asks > 0)."""
    import subprocess

    spawn = subprocess.run

    def run(cmd, **kw):
        if len(cmd) < 2 or cmd[1] != bench.__file__ or cmd[cmd.index("--run") + 1] == real:
            return spawn(cmd, **kw)
        out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = bench.main(cmd[2:])
        finally:
            torch.set_num_threads(threads)  # run_path sets --threads
        return subprocess.CompletedProcess(cmd, status, out.getvalue(), err.getvalue())

    monkeypatch.setattr(bench.subprocess, "run", run)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
def test_tiny_cpu_run_has_a_row_per_path(capsys, tmp_path, monkeypatch):
    bench = _bench()
    _children_here_but(monkeypatch, bench, real="reference")
    argv = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs", "4", "--seq-len", "24", "--steps", "1",
            "--threads", "1", "--json", str(tmp_path / "rows.json")]
    assert bench.main(argv) == 0
    out, err = capsys.readouterr()
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for path in ("ours-padded", "ours-packed", "reference", "trl", "trl-fast"):
        cells = [c.strip() for c in rows[path].split("|")[2:-1]]
        assert float(cells[0]) > 0 and float(cells[2]) > 0 and float(cells[3]) > 0, rows[path]
    assert "CUDA only" in rows["ours-padded+kernels"] and "CUDA only" in rows["ours-packed+kernels"]
    assert "CUDA only" in rows["trl+liger"]
    assert rows["reference"].split("|")[7].strip() == "1.00"
    assert float(rows["ours-packed"].split("|")[6]) >= 0 and rows["trl"].split("|")[6].strip() == "-"
    saved = {r["path"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert saved["ours-packed"]["estimate_bytes"] > 0 and saved["trl"]["estimate_bytes"] is None
    assert [saved[p]["attention"] for p in ("ours-padded", "ours-packed", "trl")] == ["sdpa", "ludic_sdpa_varlen",
                                                                                       "sdpa"]
    assert ("Attention as run: ours-padded sdpa, ours-packed ludic_sdpa_varlen, reference sdpa, trl sdpa, "
            "trl-fast sdpa.") in out
    progress = [line for line in err.splitlines() if line.startswith("[e2e] ")]
    assert len(progress) == 8 and progress[0].startswith("[e2e] ours-padded: median step ")


def test_rows_are_saved_after_every_path(tmp_path, monkeypatch):
    """A run stopped after its second path (a kill, a time limit) keeps the first two rows in --json."""
    bench = _bench()
    done = []

    def child(args, path, seqs=None):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(path)
        return {"path": path, "median_s": 0.5, "min_s": 0.4, "tokens_per_s": 10.0, "peak_bytes": 2**30}

    monkeypatch.setattr(bench, "_child", child)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--paths", "ours-padded,ours-packed,reference", "--json", str(tmp_path / "rows.json")])
    saved = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["path"] for r in saved] == ["ours-padded", "ours-packed"]


def _fake_children(monkeypatch, bench, fail: str):
    """subprocess.run of a child: a RESULT line, except for `fail`, which dies of a non-OOM error."""
    import subprocess

    def run(cmd, **kw):
        path = cmd[cmd.index("--run") + 1]
        if path == fail:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: boom")
        row = {"path": path, "median_s": 0.5, "min_s": 0.4, "tokens": 8, "tokens_per_s": 16.0, "peak_bytes": 2**30,
               "estimate_bytes": None}
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)


def test_a_failing_path_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    """A non-OOM failure of one child is that path's row ('failed: ...'); the next paths still run, the table
    and --markdown are written, and the exit status is 1."""
    bench = _bench()
    _fake_children(monkeypatch, bench, fail="ours-packed")
    md = tmp_path / "e2e.md"
    argv = ["--paths", "ours-padded,ours-packed,reference", "--json", str(tmp_path / "rows.json"),
            "--markdown", str(md)]
    assert bench.main(argv) == 1
    saved = {r["path"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert saved["ours-packed"]["skipped"] == "failed: ValueError: boom" and saved["ours-packed"]["failed"]
    assert saved["reference"]["median_s"] == 0.5 and "| reference | 0.500 |" in md.read_text()
    assert "ours-packed failed (exit 1)" in capsys.readouterr().err


def test_find_max_stops_at_its_time_cap(tmp_path, monkeypatch):
    """--find-max doubles until out of memory or --find-max-seconds, shared out among the paths: with paths
    that never run out of memory each stops at its share and the row says so."""
    bench = _bench()
    _fake_children(monkeypatch, bench, fail="")
    clock = iter(range(0, 10**6, 10))  # each look at the clock is 10 s later
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    argv = ["--paths", "ours-padded,reference", "--seqs", "2", "--find-max", "--find-max-seconds", "100",
            "--json", str(tmp_path / "rows.json")]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    # end = 0 + 100; ours-padded: share (100 - 10) / 2 = 45 from 20 -> tries at 30, 40, 50, 60 (4, 8, 16, 32),
    # stops at 70; reference: share (100 - 80) / 1 = 20 from 90 -> tries at 100 (4), stops at 110
    assert [r["max_seqs"] for r in rows] == [">= 32 (time cap)", ">= 4 (time cap)"]


def test_find_max_doubles_then_bisects(tmp_path, monkeypatch):
    """A path that fits 37 sequences per step: doubling from 2 fits 32 and fails at 64; bisecting tries 48
    (fails), 40 (fails), 36 (fits) and stops, 36 and 40 being within an eighth of 36 (36 // 8 = 4)."""
    import subprocess

    bench = _bench()
    tried = []

    def run(cmd, **kw):
        seqs = int(cmd[len(cmd) - 1 - cmd[::-1].index("--seqs") + 1])
        tried.append(seqs)
        if seqs > 37:
            return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory")
        row = {"path": "ours-packed", "median_s": 0.5, "min_s": 0.4, "tokens": 8, "tokens_per_s": 16.0,
               "peak_bytes": 2**30, "estimate_bytes": None}
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    argv = ["--paths", "ours-packed", "--seqs", "2", "--find-max", "--json", str(tmp_path / "rows.json")]
    assert bench.main(argv) == 0
    assert tried == [2, 4, 8, 16, 32, 64, 48, 40, 36]
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][0]["max_seqs"] == "36"


def test_trl_liger_and_kernel_paths_need_cuda():
    bench = _bench()
    args = bench.resolve(bench._parser().parse_args(["--paths", "trl+liger"]))
    assert bench.skip_reason(args, "trl+liger") == "CUDA only (Liger-Kernel's kernels)"
    assert bench.skip_reason(args, "ours-packed+kernels") == "CUDA only (Liger-Kernel's kernels)"
    assert bench.skip_reason(args, "ours-packed") is None
    assert bench.skip_reason(args, "ours-packed:flex") == "CUDA only (flex attention has no backward on CPU)"


def _mlp_runs_per_step(bench, args, path: str) -> tuple[bool, int]:
    """(the model's checkpointing switch, how often layer 0's MLP ran) in one step of `path`."""
    step, _, model = bench.build_step(args, path)
    mlp, runs = model.model.layers[0].mlp, []
    forward = mlp.forward

    def counted(*a, **k):
        runs.append(1)
        return forward(*a, **k)

    mlp.forward = counted
    step()
    return model.is_gradient_checkpointing, len(runs)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
@pytest.mark.parametrize("path", ["trl", "ours-packed"])
def test_gradient_checkpointing_is_what_the_flag_says_on_every_path(path):
    """Without --gradient-checkpointing no path recomputes a layer (TRL's GRPOConfig defaults it on, but only its
    train() would apply it: the bench now says off itself); with it, each layer's MLP runs twice a step (forward,
    then its recompute in the backward) on ours and on TRL, as TRL's train() would set it up."""
    bench = _bench()
    argv = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs", "2", "--seq-len", "24"]
    assert _mlp_runs_per_step(bench, bench.resolve(bench._parser().parse_args(argv)), path) == (False, 1)
    args = bench.resolve(bench._parser().parse_args([*argv, "--gradient-checkpointing"]))
    assert _mlp_runs_per_step(bench, args, path) == (True, 2)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
def test_trl_liger_path_patches_liger_in_as_train_would(monkeypatch):
    """`trl+liger`: transformers' Trainer.train(), not GRPOTrainer's constructor, patches Liger's kernels in
    (`apply_liger_kernel(model, liger_kernel_config)`); the bench, which times steps without train(), makes that
    call itself, on the model it times (recorded here: Liger's kernels need CUDA)."""
    import transformers.integrations.liger as liger

    bench = _bench()
    calls = []
    monkeypatch.setattr(liger, "apply_liger_kernel", lambda model, config: calls.append((model, config)))
    args = bench.resolve(bench._parser().parse_args(["--vocab", "256", "--hidden", "32", "--layers", "1"]))
    _, _, model = bench.build_step(args, "trl")
    assert calls == []
    _, _, model = bench.build_step(args, "trl+liger")
    assert len(calls) == 1 and calls[0][0] is model and calls[0][1]["fused_linear_cross_entropy"] is False


def test_find_max_jumps_to_the_memory_extrapolation_on_a_device(tmp_path, monkeypatch):
    """With the device's capacity known (10 GB) and a peak of 1 GB + 0.1 GB a sequence (fits up to 90): 4 runs,
    8 doubles (two peaks now), the line reaches 97 % at 87 (fits), the next try is an eighth above (97, fails),
    and 87 is within an eighth of 97: 87, in 3 attempts where doubling and bisecting takes 6."""
    import subprocess

    bench = _bench()
    tried = []

    def run(cmd, **kw):
        seqs = int(cmd[len(cmd) - 1 - cmd[::-1].index("--seqs") + 1])
        tried.append(seqs)
        peak = 10**9 + 10**8 * seqs
        if peak > 10 * 10**9:
            return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory")
        row = {"path": "ours-packed", "median_s": 0.5, "min_s": 0.4, "tokens": 8, "tokens_per_s": 16.0,
               "peak_bytes": peak, "estimate_bytes": None, "capacity_bytes": 10 * 10**9}
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    argv = ["--paths", "ours-packed", "--seqs", "4", "--find-max", "--json", str(tmp_path / "rows.json")]
    assert bench.main(argv) == 0
    assert tried == [4, 8, 87, 97]
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][0]["max_seqs"] == "87"


def test_a_packed_path_takes_the_attention_it_names():
    """`ours-packed:ATTENTION` forces the Trainer's packed attention: on the CPU "auto" moves the model to per-
    sequence SDPA, ':mask' keeps its sdpa (a block-diagonal mask)."""
    bench = _bench()
    argv = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs", "2", "--seq-len", "24"]
    args = bench.resolve(bench._parser().parse_args([*argv, "--paths", "ours-packed,ours-packed:mask"]))
    ran = {}
    for path in ("ours-packed", "ours-packed:mask"):
        step, _, model = bench.build_step(args, path)
        ran[path] = model.config._attn_implementation
    assert ran == {"ours-packed": "ludic_sdpa_varlen", "ours-packed:mask": "sdpa"}


@pytest.mark.parametrize("paths, message", [
    ("ours-packed:nope", "unknown packed attention 'nope'"),
    ("ours-padded:flex", "only a packed path takes an attention"),
    ("trl:sdpa_varlen", "only a packed path takes an attention"),
    ("ours-unpacked", "unknown path 'ours-unpacked'"),
])
def test_a_bad_path_is_refused_naming_it(paths, message):
    bench = _bench()
    with pytest.raises(SystemExit, match=message):
        bench.resolve(bench._parser().parse_args(["--paths", paths]))


@pytest.mark.parametrize("path", ["ours-packed", "ours-padded", "reference"])
def test_a_step_leaves_the_sources_items_as_they_were(path):
    """The bench hands every step the same SAW items (no copy inside the timed step): a step must not change
    them, else the next step would train on other data than the first."""
    bench = _bench()
    argv = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs", "3", "--seq-len", "24"]
    step, _, _ = bench.build_step(bench.resolve(bench._parser().parse_args(argv)), path)
    source = step.__self__.objective.batch_source
    before = copy.deepcopy(source.items)
    step()
    step()
    assert source.items == before


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
def test_trl_fast_path_runs_fast_grpo_trainer_on_the_same_batch(monkeypatch):
    """`trl-fast` is TRL's step with FastGRPOTrainer in place of GRPOTrainer: its step computes the loss with
    FastGRPOTrainer, equal to stock TRL's on the same inputs (the drop-in's contract, fp32)."""
    from trl import GRPOTrainer

    from ludic_fast.integrations.trl import FastGRPOTrainer

    seen = []
    for cls in (GRPOTrainer, FastGRPOTrainer):
        def recorded(self, *a, _compute=cls.compute_loss, **k):
            loss = _compute(self, *a, **k)
            seen.append((type(self).__name__, float(loss)))
            return loss

        monkeypatch.setattr(cls, "compute_loss", recorded)
    bench = _bench()
    args = bench.resolve(bench._parser().parse_args(["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs",
                                                      "3", "--seq-len", "24", "--dtype", "fp32"]))
    for path in ("trl", "trl-fast"):
        bench.build_step(args, path)[0]()
    (stock, trl_loss), (fast, fast_loss) = seen[0], seen[-1]
    assert (stock, fast) == ("GRPOTrainer", "FastGRPOTrainer")
    assert fast_loss == pytest.approx(trl_loss, rel=1e-5)


def test_find_max_ends_an_attempt_still_running_at_its_share(tmp_path, monkeypatch):
    """An attempt still running when the path's share of --find-max-seconds ends is ended there (the child gets
    the time left as its timeout), so one slow attempt cannot eat the next path's share."""
    import subprocess

    bench = _bench()
    timeouts = []

    def run(cmd, **kw):
        path = cmd[cmd.index("--run") + 1]
        if kw.get("timeout") is not None:  # a find-max attempt
            timeouts.append((path, kw["timeout"]))
            if path == "ours-packed":
                raise subprocess.TimeoutExpired(cmd, kw["timeout"])
            if int(cmd[len(cmd) - 1 - cmd[::-1].index("--seqs") + 1]) > 64:
                return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory")
        row = {"path": path, "median_s": 0.5, "min_s": 0.4, "tokens": 8, "tokens_per_s": 16.0, "peak_bytes": 2**30,
               "estimate_bytes": None}
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    argv = ["--paths", "ours-packed,reference", "--seqs", "2", "--find-max", "--find-max-seconds", "100",
            "--json", str(tmp_path / "rows.json")]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert rows[0]["max_seqs"] == ">= 2 (time cap)" and rows[1]["max_seqs"] == "64"  # its first attempt ran past
    # its share; reference then searched in the rest
    assert timeouts[0][0] == "ours-packed" and 0 < timeouts[0][1] <= 50  # about half of the 100 s
    assert all(0 < t <= 100 for _, t in timeouts) and any(p == "reference" for p, _ in timeouts)


def test_compile_paths_compile_every_decoder_layer_and_only_when_named():
    """`+compile` runs the Trainer with compile_body (each decoder layer under torch.compile, which compiles
    at the first call: building the step compiles nothing); the default --paths leave them out."""
    bench = _bench()
    args = bench.resolve(bench._parser().parse_args(["--vocab", "256", "--hidden", "32", "--layers", "2",
                                                     "--seqs", "2", "--seq-len", "24"]))
    assert not any(p.endswith("+compile") for p in args.paths.split(","))
    for path, compiled in (("ours-packed+compile", True), ("ours-padded", False)):
        _, _, model = bench.build_step(args, path)
        layers = model.model.layers
        assert [layer._compiled_call_impl is not None for layer in layers] == [compiled] * len(layers), path
