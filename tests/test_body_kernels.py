"""Body kernels: the Liger apply function picked per model_type with the head flags off and Liger's own body
defaults; the fallback warning for a type Liger has no patch for; the refusal on CPU; the instance patch of a
Llama (in a subprocess: Liger's patches are process-wide); torch.compile of the decoder layers."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.data.types import SAWBatch
from ludic_fast.integrations.body_kernels import apply_body_kernels, body_kernel_plan, compile_body
from ludic_fast.trainer import Trainer, TrainerConfig

liger = pytest.importorskip("liger_kernel.transformers.monkey_patch")

BODY = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


@pytest.mark.parametrize(
    ("model_type", "fn", "kwargs"),
    [
        ("llama", "apply_liger_kernel_to_llama", BODY),
        ("qwen2", "apply_liger_kernel_to_qwen2", BODY),
        ("mistral", "apply_liger_kernel_to_mistral", BODY),
        # Liger's default for granite is cross_entropy=True: the head flags are forced off
        ("granite", "apply_liger_kernel_to_granite", BODY),
        ("gemma", "apply_liger_kernel_to_gemma", {"rope": True, "rms_norm": True, "geglu": True,
                                                 "cross_entropy": False, "fused_linear_cross_entropy": False}),
        # a **kwargs function gets the head flags too
        ("nemotron", "apply_liger_kernel_to_nemotron", {"relu_squared": True, "cross_entropy": False,
                                                       "fused_linear_cross_entropy": False}),
    ],
)
def test_plan_picks_the_liger_function_and_turns_the_head_off(model_type, fn, kwargs):
    plan = body_kernel_plan(model_type)
    assert plan.apply_fn is liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    assert plan.apply_fn.__name__ == fn
    assert plan.kwargs == kwargs


def test_every_liger_model_type_gets_the_head_flags_off():
    """Every registered type: no head flag is ever True; a function taking one gets it as False (pixtral, a
    vision tower, takes none)."""
    import inspect

    for model_type, fn in liger.MODEL_TYPE_TO_APPLY_LIGER_FN.items():
        plan = body_kernel_plan(model_type)
        params = inspect.signature(fn).parameters
        for flag in ("cross_entropy", "fused_linear_cross_entropy"):
            assert plan.kwargs.get(flag, False) is False
            assert (flag in plan.kwargs) == (flag in params or "kwargs" in params), (model_type, flag)
        assert "model" not in plan.kwargs


def test_unsupported_model_type_falls_back_with_one_warning():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    before = copy.deepcopy(model.state_dict())
    assert body_kernel_plan("gpt2") is None and body_kernel_plan(None) is None
    with pytest.warns(UserWarning, match="no patch for model type 'gpt2'") as record:
        assert apply_body_kernels(model) is None
    assert len(record) == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_body_kernels_on_cpu_are_refused_and_auto_is_off():
    with pytest.raises(ValueError, match="body_kernels=True needs a CUDA model_device"):
        TrainerConfig(model_device="cpu", pad_token_id=0, body_kernels=True)
    with pytest.raises(TypeError, match="body_kernels"):
        TrainerConfig(model_device="cpu", pad_token_id=0, body_kernels="yes")
    model = tiny_model()
    trainer = Trainer(model=model, algo=make_cispo(group_size=1), batch_source=ListSource([make_items(2)]),
                      cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0))
    assert trainer.body_kernels is None
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP" and "forward" not in vars(model.model.norm)


def test_liger_patches_a_llama_instance_body_and_leaves_its_head():
    """Run in a fresh process (Liger rebinds module-level names of transformers' modeling_llama): the instance's
    body is Liger's, its head untouched, and models built afterwards on CPU still run."""
    code = textwrap.dedent(
        """
        import torch
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from ludic_fast.embedded import build_tiny_model
        from ludic_fast.integrations.body_kernels import apply_body_kernels
        from transformers.models.llama import modeling_llama
        model = build_tiny_model(40)
        forward, rope, norm_cls = type(model).forward, modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
        plan = apply_body_kernels(model)
        assert plan.kernels == ["rms_norm", "rope", "swiglu"], plan.kernels
        assert model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
        assert model.model.norm.forward.__func__ is LigerRMSNorm.forward
        assert "forward" not in vars(model) and type(model).forward is forward  # head untouched
        # module-level rebinding scoped: classes restored, rope dispatches (Liger on CUDA, original elsewhere)
        assert modeling_llama.LlamaRMSNorm is norm_cls
        dispatch = modeling_llama.apply_rotary_pos_emb
        assert dispatch.__ludic_original__ is rope and dispatch.__ludic_fused__.__module__.startswith("liger_kernel")
        apply_body_kernels(build_tiny_model(40))  # a second model: no wrapper around the wrapper
        assert modeling_llama.apply_rotary_pos_emb.__ludic_original__ is rope
        cpu_model = build_tiny_model(40)  # built afterwards on CPU: transformers' modules, runs on CPU
        assert type(cpu_model.model.norm) is norm_cls
        cpu_model(input_ids=torch.tensor([[1, 2, 3]]))
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_compile_body_keeps_gradients(layout):
    """torch.compile of each decoder layer (aot_eager backend: dynamo + AOT autograd, no C++ build) gives the
    eager padded gradients, packed rows too (the packed path is resolved and probed before compiling);
    parameter names are unchanged."""
    items = make_items(4, seed=2)
    grads = []
    for compiled, lay in ((False, "padded"), ("aot_eager", layout)):
        model = tiny_model()
        cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                            micro_token_budget=64, compile_body=compiled, layout=lay)
        trainer = Trainer(model=model, algo=make_cispo(group_size=1), batch_source=ListSource([items]), cfg=cfg)
        trainer.accumulate_gradients(SAWBatch(items=list(items)))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert compile_body(tiny_model(), backend="aot_eager") == 1
