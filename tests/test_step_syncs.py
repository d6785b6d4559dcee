"""The engine step's host reads (each a host-device synchronisation on CUDA) and the exactness of its speed
changes: one host read in the step's own code (`engine.step_parts.read_step_values`, which also reads the stats
and, with a reference model, the step's KL estimate: `aggregate_stats` and the reference tracking then read
nothing), counted on the CPU by `engine.host_syncs.HostReads`; none elsewhere on the padded path (collation ships
the action rows and the range of their targets computed on the host, so neither the action selection nor the
head's input check reads the device), and on the packed path one read of the sequence bounds from their host copy
per micro-batch (not per layer, none of the device copy, no mask check); collation's copies to a CUDA device go
through pinned memory without blocking; AdamW fused, clipping multi-tensor, the stats read in that one transfer —
the parameters after a step and the logged values equal, bit for bit, those of torch's AdamW (fused) and
per-parameter clipping with the stats read as before. That the fused AdamW equals torch's per-parameter loop to
rounding is tests/gpu/test_gpu_step.py's, on the CPU and on CUDA."""

from __future__ import annotations

import asyncio
import copy
import math
import os
import types

import pytest
import torch
from _trainer_fixtures import SMALL, TOKENIZER, ListSource, make_items
from test_packed_attention_paths import _per_component_sdpa
from torch.utils._python_dispatch import TorchDispatchMode

from ludic_fast._common import validate_head_inputs
from ludic_fast.algorithm import make_cispo
from ludic_fast.data import batching
from ludic_fast.data.batching import MacroTotals, collate_packed, collate_saw_items
from ludic_fast.data.types import SAWBatch, SAWItem
from ludic_fast.embedded import build_tiny_model
from ludic_fast.engine.host_syncs import CudaSyncs, HostReads
from ludic_fast.engine.step_parts import grad_norm_and_clip, make_adamw, read_step_values
from ludic_fast.integrations import sdpa_varlen
from ludic_fast.integrations.packing import PackedAttention, use_sdpa_varlen
from ludic_fast.integrations.transformers import final_hidden_states
from ludic_fast.objectives.rl import REF_KL
from ludic_fast.run.stats import SUM_KEYS, aggregate_stats, group_log_stats
from ludic_fast.token_batch import ACTION_ROWS, TokenBatch, action_rows
from ludic_fast.trainer import Trainer, TrainerConfig

#: the step's own code: the engine, the objective, the stats
OWN = (f"ludic_fast{os.sep}engine{os.sep}", f"ludic_fast{os.sep}objectives{os.sep}", f"ludic_fast{os.sep}run{os.sep}")
#: its one read: the transfer of the step's values (the stats among them)
OWN_READS = [("to host", "ludic_fast/engine/step_parts.py", "read_step_values")]
#: the reads elsewhere in ludic_fast that the step reaches, each once per forward (of the policy and of a
#: reference), by layout: packed, the sequence bounds that the per-sequence attention reads from the batch's
#: host copy of cu_seqlens (a host tensor: no device sync)
PER_FORWARD = {"padded": [], "packed": [("to host", "ludic_fast/integrations/sdpa_varlen.py", "_split")]}
#: layers of the step tests' model: a read made once per layer shows as a multiple of the micro-batches
LAYERS = 3


def _trainer(layout: str, ref: bool = False, **cfg) -> Trainer:
    items = make_items(6, seed=1)
    config = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                           micro_token_budget=24, layout=layout, **cfg)
    model = build_tiny_model(len(TOKENIZER), seed=0, **{**SMALL, "num_hidden_layers": LAYERS})
    ref_model = build_tiny_model(len(TOKENIZER), seed=5, **{**SMALL, "num_hidden_layers": LAYERS}) if ref else None
    return Trainer(model=model, algo=make_cispo(group_size=2), batch_source=ListSource([items]), cfg=config,
                   ref_model=ref_model)


def _site(read) -> tuple[str, str, str]:
    path, rest = read.where.split(":", 1)
    return read.kind, path.replace(os.sep, "/"), rest.split("(", 1)[1].rstrip(")")


@pytest.mark.parametrize("ref", [False, True], ids=["", "ref"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_step_reads_the_device_once(layout, ref):
    """With a reference model too: its forward, its KL estimate and the reference tracking read nothing."""
    trainer = _trainer(layout, ref)
    assert trainer.packing is None if layout == "padded" else trainer.packing.path == "sdpa_varlen"
    n_micro = len(trainer.objective.micro_batches(trainer, SAWBatch(items=list(make_items(6, seed=1)))))
    assert n_micro > 1
    trainer.train_step_sync()  # warm-up: AdamW allocates its state
    with HostReads() as reads:
        trainer.train_step_sync()
    own = [_site(r) for r in reads.log if r.where.startswith(OWN)]
    other = [_site(r) for r in reads.log if r.where.startswith("ludic_fast") and not r.where.startswith(OWN)]
    forwards = n_micro * (2 if ref else 1)
    assert sorted(own) == sorted(OWN_READS), reads.where()
    assert sorted(other) == sorted(PER_FORWARD[layout] * forwards), reads.where()
    if layout == "packed":  # transformers reads nothing either: no padding-mask check of the all-ones mask
        assert len(reads) == len(OWN_READS) + len(PER_FORWARD["packed"]) * forwards, reads.where()
    if ref:
        assert trainer.objective.kl_ref_ema is not None


@pytest.mark.parametrize("path", ["varlen", "sdpa_varlen", "flex", "mask", "position_ids"])
def test_packed_model_inputs_never_read_the_device_copy_of_the_offsets(path):
    """The batch on the meta device (whose values cannot be read: a read raises): the model's inputs are built
    from the host copy of cu_seqlens that collation keeps."""
    batch = collate_packed(make_items(3, seed=1), device="meta")
    host = batch["cu_seqlens_host"]
    assert host.device.type == "cpu" and host.dtype == torch.int32
    assert host.tolist() == collate_packed(make_items(3, seed=1))["cu_seqlens"].tolist()
    inputs = PackedAttention(path).model_inputs(batch)
    if path == "varlen":
        assert inputs["max_length_q"] == int(host.diff().max()) and inputs["cu_seq_lens_q"].device.type == "meta"
    if path == "sdpa_varlen":
        assert inputs["cu_seq_lens_q"] is host
    without = {k: v for k, v in batch.items() if k != "cu_seqlens_host"}
    if path in ("varlen", "sdpa_varlen"):  # without the host copy the offsets are read from the device
        with pytest.raises(NotImplementedError, match="meta"):
            PackedAttention(path).model_inputs(without)
        with pytest.raises(ValueError, match="cu_seqlens_host"):
            PackedAttention(path).model_inputs({**batch, "cu_seqlens_host": host[:-1]})


def test_the_counter_sees_every_kind_of_read():
    x = torch.arange(4.0)
    with HostReads() as reads:
        float(x.sum()), x.sum().item(), bool(x.max() > 1), int(x[0])
        x.tolist()
        x[x > 1]
        torch.nonzero(x)
        torch.optim.AdamW([torch.nn.Parameter(x.clone())]).step()  # its host step counter: not counted
    assert [r.kind for r in reads.log] == ["scalar"] * 4 + ["to host"] + ["data-dependent shape"] * 2
    assert all(r.where.startswith("tests/test_step_syncs.py:") for r in reads.log), reads.where()


def _old_step(trainer: Trainer) -> tuple[dict, int]:
    """The step as the engine took it before, with the fused AdamW: per-parameter clipping (torch's default off
    CUDA), `bool()` / `float()` reads of the loss, the norm and the stats. Returns (logged values, micro-batches)."""
    opt = torch.optim.AdamW(trainer.params, lr=trainer.cfg.lr, weight_decay=trainer.cfg.weight_decay,
                            betas=tuple(trainer.cfg.betas), eps=trainer.cfg.eps, fused=True)
    saw = asyncio.run(trainer.objective.next_batch(trainer))
    micros = trainer.objective.micro_batches(trainer, saw)
    total, micro_stats, sizes, _ = trainer._backward(micros)
    norm = torch.nn.utils.clip_grad_norm_(trainer.params, trainer.cfg.max_grad_norm, foreach=False)
    assert bool(torch.isfinite(total)) and bool(torch.isfinite(norm))
    opt.step()
    stats = trainer.objective.step_stats(trainer, saw, micro_stats, sizes)
    stats["grad_norm"] = float(norm)
    return group_log_stats(stats), len(micros)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_step_equals_the_per_parameter_step(layout):
    new, old = _trainer(layout), _trainer(layout)
    assert all(torch.equal(a, b) for a, b in zip(new.params, old.params))
    record = new.train_step_sync()
    expected, n_micro = _old_step(old)
    assert n_micro > 1  # the stats of several micro-batches reduced
    for a, b in zip(new.params, old.params):
        assert torch.equal(a, b)
    for key, value in expected.items():
        assert record[key] == value, key


def test_grad_norm_and_clip_equal_torch_clip():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 7)]
    grads = [torch.randn(p.shape) * 2 for p in params]
    for max_norm in (1.0, None):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norm = grad_norm_and_clip(params, max_norm)
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        expected = torch.nn.utils.clip_grad_norm_(ref, float("inf") if max_norm is None else max_norm, foreach=False)
        assert torch.equal(norm, expected)
        for p, r in zip(params, ref):
            assert torch.equal(p.grad, r.grad)
        if max_norm is None:
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        else:
            assert float(norm) > 1.0 and not torch.equal(params[0].grad, grads[0])  # it did clip


def test_make_adamw_leaves_dtensor_like_parameters_to_torch():
    class Sub(torch.Tensor):
        pass

    p = torch.nn.Parameter(torch.randn(3).as_subclass(Sub))
    assert not make_adamw([p], lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8).defaults["fused"]


def test_read_step_values_reads_everything_once():
    loss, norm = torch.tensor(0.25), torch.tensor(3.5)
    padded = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    packed = {"cu_seqlens": torch.tensor([0, 4, 9])}
    stats = [{"loss": torch.tensor(0.5, dtype=torch.bfloat16), "n": 3.0}, {"loss": torch.tensor([1.5])}]
    kept = copy.deepcopy(stats)
    with HostReads() as reads:
        out = read_step_values(loss, norm, [padded, packed], stats, torch.device("cpu"))
    assert out == (0.25, 3.5, 5 + 9)
    assert stats == [{"loss": float(kept[0]["loss"]), "n": 3.0}, {"loss": float(kept[1]["loss"])}]
    assert len(reads) == 1


class _Casts(TorchDispatchMode):
    """Counts the dtype casts (aten._to_copy), each a kernel launch on a GPU."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is torch.ops.aten._to_copy
        return func(*args, **(kwargs or {}))


def test_read_step_values_casts_once_per_dtype():
    """Twenty float32 stats and two bf16 ones, one int64 token count: one cast per dtype, not one per value,
    and the values where they belong."""
    stats = [{f"s{k}": torch.tensor(k + 0.5 * i) for k in range(10)} for i in range(2)]
    stats[1]["h"] = torch.tensor(0.375, dtype=torch.bfloat16)
    stats[0]["h"] = torch.tensor([0.125], dtype=torch.bfloat16)
    batches = [{"attention_mask": torch.ones(2, 3, dtype=torch.long)}, {"cu_seqlens": torch.tensor([0, 4])}]
    with _Casts() as casts:
        out = read_step_values(torch.tensor(0.25), torch.tensor(3.5), batches, stats, torch.device("cpu"))
    assert casts.n == 3  # float32, bfloat16, int64
    assert out == (0.25, 3.5, 10)
    assert stats == [{**{f"s{k}": k + 0.5 * i for k in range(10)}, "h": h} for i, h in enumerate((0.125, 0.375))]


def _old_aggregate(micro_stats, sizes) -> dict[str, float]:
    """The reduction as aggregate_stats took it before, in float32 tensors."""
    out = {}
    for key in dict.fromkeys(k for s in micro_stats for k in s):
        pairs = [(s[key], w) for s, w in zip(micro_stats, sizes) if key in s]
        v = torch.stack([torch.as_tensor(x).float().reshape(()) for x, _ in pairs])
        w = torch.tensor([float(w) for _, w in pairs])
        if key.startswith("gpu_"):
            out[key] = float(v.max())
        elif key in SUM_KEYS:
            out[key] = float(v.sum())
        else:
            out[key] = float((v * w).sum() / w.sum().clamp(min=1e-12))
    return out


def test_aggregate_stats_reads_tensors_once_and_reduces_as_before():
    g = torch.Generator().manual_seed(0)
    micro = [{"loss": torch.randn((), generator=g), "ratio": torch.rand(1, generator=g).to(torch.bfloat16),
              "gpu_mem": torch.tensor(float(i)), "total_completion_tokens": 3.0 + i, "x": 0.1 * i}
             for i in range(3)]
    micro[1]["only_here"] = torch.tensor(2.5)
    sizes = [2, 5, 3]
    with HostReads() as reads:
        new = aggregate_stats(micro, [], micro_batch_sizes=sizes)
    assert len(reads) == 1, reads.where()  # the tensor values in one transfer
    old = _old_aggregate(micro, sizes)
    for key, value in old.items():  # float64 instead of float32 arithmetic: equal to float32 rounding
        assert math.isclose(new[key], value, rel_tol=1e-6, abs_tol=1e-7), key
    assert new["gpu_mem"] == 2.0 and new["total_completion_tokens"] == 12.0 and new["only_here"] == 2.5
    assert new["x"] == (0.1 * 5 + 0.2 * 3) / 10  # Σ w v / Σ w in float64
    floats = [{k: float(v) for k, v in s.items()} for s in micro]
    with HostReads() as reads:
        assert aggregate_stats(floats, [], micro_batch_sizes=sizes) == new
    assert len(reads) == 0


def test_sdpa_varlen_reads_a_split_once_and_again_after_a_change():
    """Every layer of a forward gets the same host cu_seq_lens: its split (and the jagged offsets on a device)
    are made once; an in-place change of the tensor, or another tensor, is read again."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with HostReads() as reads:
        first = sdpa_varlen._split(cu)
        assert sdpa_varlen._split(cu) is first and first.bounds == [0, 3, 7]
        assert first.offsets(torch.device("cpu")) is first.offsets(torch.device("cpu"))
        assert first.offsets(torch.device("cpu")).tolist() == [0, 3, 7]
    assert len(reads) == 2  # the split, and the test's own tolist
    cu[1] = 4
    assert sdpa_varlen._split(cu).bounds == [0, 4, 7]
    assert sdpa_varlen._split(cu.clone()) is not sdpa_varlen._split(cu)
    with torch.inference_mode():
        frozen = torch.tensor([0, 2])
    assert sdpa_varlen._split(frozen).bounds == [0, 2]  # no version counter: read each time


def test_the_packed_row_mask_is_answered_without_a_read():
    """sdpa_varlen's mask function: no mask, and no read, for the packed forward's all-ones mask; transformers'
    sdpa mask (which reads it) for any other, e.g. a padded batch's."""
    ids = torch.zeros(1, 5, dtype=torch.long)
    args = {"batch_size": 1, "q_length": 5, "kv_length": 5, "device": torch.device("cpu")}
    with HostReads() as reads:
        assert sdpa_varlen.sdpa_varlen_mask(**args, attention_mask=sdpa_varlen.packed_row_mask(ids)) is None
    assert len(reads) == 0
    padded = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool)
    with HostReads() as reads:
        mask = sdpa_varlen.sdpa_varlen_mask(**args, attention_mask=padded)
    assert len(reads) > 0 and mask.shape == (1, 1, 5, 5) and not mask[0, 0, 4, 3]


def test_the_jagged_path_makes_its_offsets_once_per_forward(monkeypatch):
    """sdpa_varlen's CUDA path (one jagged SDPA call per layer; its kernel replaced by per-sequence SDPA, as in
    test_packed_attention_paths) through a packed forward of LAYERS layers: every layer gets the same device
    offsets, and the hidden states equal those of the per-sequence loop."""
    model = build_tiny_model(len(TOKENIZER), seed=0, **{**SMALL, "num_hidden_layers": LAYERS})
    assert use_sdpa_varlen(model)
    inputs = PackedAttention("sdpa_varlen").model_inputs(collate_packed(make_items(4, seed=2)))
    with torch.no_grad():
        loop = final_hidden_states(model, **inputs)
    made = []
    offsets = sdpa_varlen._Split.offsets
    monkeypatch.setattr(sdpa_varlen._Split, "offsets",
                        lambda self, device: made.append(offsets(self, device)) or made[-1])
    monkeypatch.setattr(sdpa_varlen, "nested_applies", lambda *args: True)
    monkeypatch.setattr(sdpa_varlen, "F", types.SimpleNamespace(scaled_dot_product_attention=_per_component_sdpa))
    with torch.no_grad():
        jagged = final_hidden_states(model, **inputs)
    assert len(made) == LAYERS and all(t is made[0] for t in made)
    torch.testing.assert_close(jagged, loop)


# ------------------------------------------------------------------------------ collation's host action rows
def _edge_items() -> list[SAWItem]:
    """Items without logps, plus: one whose first token is an action (packed, a sequence start that is never
    scored), one without actions, one of a single token."""
    extra = [([7, 8, 9, 10], [1, 0, 1, 1]), ([11, 12, 13], [0, 0, 0]), ([14], [1])]
    return make_items(4, seed=3, with_logps=False) + [
        SAWItem(input_ids=ids, attention_mask=[1] * len(ids), action_mask=mask, weight=0.5, meta={})
        for ids, mask in extra]


def _collations():
    items = make_items(7, seed=2, groups=3)
    macro = MacroTotals.of(items)
    return [("padded", collate_saw_items(_edge_items(), pad_token_id=0)), ("packed", collate_packed(_edge_items())),
            ("padded", collate_saw_items(items, pad_token_id=0, macro=macro)),
            ("packed", collate_packed(items, macro=macro))]


def _assert_same_token_batch(a: TokenBatch, b: TokenBatch) -> None:
    assert a.n_seq == b.n_seq and a.rows.dtype == b.rows.dtype and torch.equal(a.rows, b.rows)
    assert torch.equal(a.total_mask, b.total_mask)
    for got, want in ((a.tokens, b.tokens), (a.seqs, b.seqs)):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("case", range(4))
def test_collated_action_rows_give_the_token_batch_of_nonzero_without_a_read(case):
    """from_batch on a collated batch (padded / packed, with and without logps, groups and macro totals) reads
    nothing and equals, tensor for tensor, from_batch on the same batch without the host rows (`nonzero`)."""
    layout, batch = _collations()[case]
    assert batch[ACTION_ROWS].dtype == torch.long
    with HostReads() as reads:
        got = TokenBatch.from_batch(batch)
        rows = action_rows(batch)
    assert len(reads) == 0, reads.where()
    without = {k: v for k, v in batch.items() if k != ACTION_ROWS}
    with HostReads() as reads:
        want = TokenBatch.from_batch(without)
    assert [r.kind for r in reads.log] == ["data-dependent shape"]
    _assert_same_token_batch(got, want)
    assert torch.equal(rows, want.rows) and torch.equal(action_rows(without), want.rows)
    if case == 1:  # the packed sequence that starts with an action: its first token is not scored
        start = int(batch["cu_seqlens"][4])
        assert start - 1 not in want.rows.tolist() and start + 1 in want.rows.tolist()


@pytest.mark.parametrize("change", ["mask in place", "mask replaced", "ids replaced", "offsets replaced"])
def test_collated_action_rows_are_not_used_once_the_batch_changed(change):
    """A collated batch whose tensors were changed in place or replaced is indexed by nonzero again."""
    batch = collate_packed(_edge_items()) if change == "offsets replaced" else collate_saw_items(
        _edge_items(), pad_token_id=0)
    if change == "mask in place":
        batch["action_mask"][0, -1] = 0.0
        batch["action_mask"][0, 1] = 1.0
    elif change == "mask replaced":
        batch = {**batch, "action_mask": batch["action_mask"].flip(1)}
    elif change == "ids replaced":
        batch = {**batch, "input_ids": batch["input_ids"] + 1}
    else:
        batch = {**batch, "cu_seqlens": batch["cu_seqlens"].clone()}
    with HostReads() as reads:
        got = TokenBatch.from_batch(batch)
    assert [r.kind for r in reads.log] == ["data-dependent shape"]
    _assert_same_token_batch(got, TokenBatch.from_batch({k: v for k, v in batch.items() if k != ACTION_ROWS}))


def test_the_head_check_of_collated_targets_reads_nothing_and_raises_as_before():
    """Targets whose range collation knew are checked on the host against the vocabulary; a vocabulary they do
    not fit gives the device check's error, word for word; any other targets (a copy, changed in place, with a
    tensor temperature) are checked on the device as before."""
    tb = TokenBatch.from_batch(collate_saw_items(make_items(5, seed=4), pad_token_id=0))
    top = int(tb.targets.max())
    hidden, weight = torch.zeros(tb.n, 4), torch.zeros(top + 1, 4)
    with HostReads() as reads:
        validate_head_inputs(hidden, weight, tb.targets, None, 1.0, None, 1.0, -100)
        validate_head_inputs(hidden[:0], weight, tb.targets[:0], None, 1.0, None, 1.0, -100)  # nothing to check
    assert len(reads) == 0, reads.where()
    copy_ = tb.targets.clone()
    with HostReads() as reads:
        validate_head_inputs(hidden, weight, copy_, None, 1.0, None, 1.0, -100)
        validate_head_inputs(hidden, weight, tb.targets, None, 1.0, None, torch.ones(tb.n), -100)
    assert [r.kind for r in reads.log] == ["scalar"] * 2
    messages = []
    for targets in (tb.targets, copy_):
        with pytest.raises(ValueError, match=rf"targets must lie in \[0, {top}\)") as err:
            validate_head_inputs(hidden, weight[:-1], targets, None, 1.0, None, 1.0, -100)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    tb.targets[0] = top + 7  # in place: the noted range no longer holds
    with pytest.raises(ValueError, match=rf"found 1 outside, in \[{top + 7}, {top + 7}\]"):
        validate_head_inputs(hidden, weight, tb.targets, None, 1.0, None, 1.0, -100)


@pytest.mark.parametrize(("device", "cuda", "pinned"), [("cuda", True, True), ("cuda", False, False),
                                                        ("cpu", True, False)])
def test_collation_copies_to_cuda_from_pinned_memory_without_blocking(monkeypatch, device, cuda, pinned):
    """Both collations move every tensor (but the host offsets) to a CUDA device through pinned memory with
    non_blocking=True (a blocking copy synchronises the stream); elsewhere a plain `.to`. The copies are
    recorded, not made (no CUDA here)."""
    moves = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: moves.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: moves.append((a, kw)) or self)
    for collate in (lambda items: collate_saw_items(items, pad_token_id=0, device=device, macro=MacroTotals.of(items)),
                    lambda items: collate_packed(items, device=device)):
        moves.clear()
        batch = collate(make_items(3, seed=1, groups=2))
        keys = [k for k in batch if k != batching.CU_SEQLENS_HOST]
        copy_ = ((torch.device(device),), {"non_blocking": True} if pinned else {})
        assert moves == (["pin", copy_] if pinned else [copy_]) * len(keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collation_and_action_selection_do_not_synchronise_on_cuda(layout):
    items = make_items(5, seed=4, groups=2)
    collate = (lambda d: collate_packed(items, device=d)) if layout == "packed" else (
        lambda d: collate_saw_items(items, pad_token_id=0, device=d))
    host = collate("cpu")
    with CudaSyncs() as syncs:
        batch = collate("cuda")
        tb = TokenBatch.from_batch(batch)
        weight = torch.zeros(len(TOKENIZER), 4, device="cuda")
        validate_head_inputs(torch.zeros(tb.n, 4, device="cuda"), weight, tb.targets, None, 1.0, None, 1.0, -100)
    assert len(syncs) == 0, syncs.where()
    for key, value in host.items():
        assert torch.equal(batch[key].cpu(), value), key
    _assert_same_token_batch(TokenBatch.from_batch(host), TokenBatch.from_batch({k: v.cpu() for k, v in batch.items()}))


def _old_k3(batch) -> torch.Tensor:
    """The k3 estimate of a micro-batch as the RL objective took it before (a boolean selection)."""
    mask = batch["action_mask"][:, 1:] > 0
    d = (batch["ref_logps"][:, 1:] - batch["actor_logps"][:, 1:])[mask]
    return (torch.exp(d) - d - 1).mean()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_reference_kl_is_read_with_the_step_and_equals_the_old_estimate(layout):
    trainer = _trainer(layout, ref=True)
    objective = trainer.objective
    micros = objective.micro_batches(trainer, asyncio.run(objective.next_batch(trainer)))
    assert len(micros) > 1 and all(REF_KL not in m.batch for m in micros[1:])
    expected = torch.stack([_old_k3(m.batch) for m in micros]).mean()
    assert torch.equal(micros[0].batch[REF_KL], expected)
    record = trainer.train_step_sync()
    assert objective.kl_ref_ema == float(expected) and record["train/kl_ref_ema"] == float(expected)
    assert not any(REF_KL in key for key in record)
