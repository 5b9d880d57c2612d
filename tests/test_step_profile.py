"""scripts/step_profile.py's grouping of profiled ops: each op by its whole base name
(a prefix match once took gelu for a rule and log_softmax for attention), an add by the
width of its rows."""

from __future__ import annotations

import pytest
from util import script_module

N_AUDIO, VOCAB = 1500, 51864


@pytest.fixture(scope="module")
def group_of():
    with script_module("step_profile") as module:
        yield lambda name, shapes: module.group_of(name, shapes, N_AUDIO, VOCAB)


@pytest.mark.parametrize(
    ("name", "shapes", "group"),
    [
        ("aten::gelu", [[16, 1, 1536], []], "norms and activations"),
        ("aten::native_layer_norm", [[16, 1, 384], [], [384], [384], []], "norms and activations"),
        ("aten::add", [[16, 1, 384], [16, 1, 384], []], "norms and activations"),
        ("aten::_log_softmax", [[16, VOCAB], [], []], "rules and choice"),
        ("aten::add_", [[16, 50256], [16, 1], []], "rules and choice"),
        ("aten::exp_", [[16, 1501]], "rules and choice"),
        ("aten::ge", [[16], []], "rules and choice"),
        ("aten::__and__", [[16], [16]], "rules and choice"),
        ("aten::new_empty", [[16, 1, 384], []], "other"),
        ("aten::expand", [[1, 384], [], []], "other"),
        ("aten::_softmax", [[16, 6, 1, N_AUDIO], [], []], "cross-attention"),
        ("aten::bmm", [[96, 1, 64], [96, 64, 12]], "self-attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", [[16, 6, 1, 64], [16, 6, 12, 64]],
         "self-attention"),
        ("onednn::qlinear_pointwise", [[16, 384], [], [], [384, VOCAB]], "logits"),
        ("onednn::qlinear_pointwise", [[16, 384], [], [], [384, 384]], "linear layers"),
        ("mkldnn::_linear_pointwise", [[16, 384], [VOCAB, 384], []], "logits"),
        ("mkldnn::_linear_pointwise", [[16, 384], [384, 384], [384]], "linear layers"),
        ("aten::_weight_int8pack_mm", [[16, 384], [384, 384], [384]], "linear layers"),
        ("quantized::linear_with_input_q_dq_qweight_dq_output_fp", [[16, 384], []],
         "linear layers"),
        ("aten::addmm", [[384], [16, 384], [384, 384]], "linear layers"),
        ("aten::copy_", [[16, 6, 64, 64], [16, 6, 64, 64], []], "caches and row drops"),
        ("aten::_index_put_impl_", [[16, N_AUDIO, 384], []], "caches and row drops"),
        ("aten::empty", [[], [], []], "other"),
    ],
)  # fmt: skip
def test_each_op_falls_in_its_group(group_of, name, shapes, group):
    assert group_of(name, shapes) == group


def test_the_c_decode_attention_is_told_by_its_key_count(group_of):
    from whisper_cli.kernels import FUSED_RANGE

    assert group_of(f"{FUSED_RANGE}{N_AUDIO}", []) == "cross-attention"
    assert group_of(f"{FUSED_RANGE}12", []) == "self-attention"


def test_the_c_products_are_told_by_their_columns(group_of):
    from whisper_cli.kernels import MATMUL_RANGE

    assert group_of(f"{MATMUL_RANGE}{VOCAB}", []) == "logits"
    assert group_of(f"{MATMUL_RANGE}1536", []) == "linear layers"


def test_a_c_product_is_a_named_range_under_the_profiler():
    """torch.profiler sees no ctypes call: the float and int8 products of csrc/matmul.c
    appear as ranges named by their output columns, or the profile would miss them."""
    import torch

    from whisper_cli import kernels, native
    from whisper_cli.dtypes import int8_weight
    from whisper_cli.kernels import MATMUL_RANGE

    if native.compiler() is None:
        pytest.skip("no C compiler: the native kernels are not offered")
    assert kernels._native() is not None, "the native kernels did not build"
    weight = torch.randn(40, 24)
    q, scale = int8_weight(torch.randn(56, 24))
    x = torch.randn(3, 24)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        kernels.LINEAR["columns"](x, weight, None)
        kernels.INT8_LINEAR["widened"](x, q, scale, None, kernels.int8_form("widened", q, scale))
    names = {event.name for event in prof.events()}
    assert {f"{MATMUL_RANGE}40", f"{MATMUL_RANGE}56"} <= names
