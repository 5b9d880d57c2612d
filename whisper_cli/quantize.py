"""`--quantize int8`: the model's linear layers with int8 weights, swapped in at load.

Every `model.Linear` of the encoder and decoder becomes an `Int8Linear` holding its weight
as int8 with per-output-channel float32 scales (dtypes.int8_weight, from the checkpoint's
own tensor, so that every run dtype holds the same int8 values), and the decoder's tied
output projection gets an int8 copy of the token embedding (`Decoder.proj_out`). The bias,
the embeddings, norms and convolutions keep the run dtype; `kernels.int8_linear` runs the
layers, its result in the run dtype. dtypes.INT8_EXCEPTIONS lists what is not.

Each layer also holds the forms of its weight that its kernel plan chose (fbgemm's or
oneDNN's packed weight, the scales in bfloat16), made once where the plan is made
(prepare_forms), not in the middle of the first batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from whisper_cli import kernels
from whisper_cli.dtypes import DtypePolicy, int8_weight
from whisper_cli.model import Linear, Whisper

# The tied output projection's weight: the token embedding, as the checkpoint names it.
EMBEDDING_KEY = "decoder.embed_tokens.weight"


class Int8Linear(nn.Module):
    """x W^T + b with W = weight (int8, (N, K)) * weight_scale (float32, (N,)) per row,
    computed by kernels.int8_linear as its kernel plan names; x, b and the result in the
    run dtype. `rows`: what its rows are (model.Linear's; "vocab" for the output
    projection, kernels.int8_candidates). `forms`: the form of the weight the plan's
    choice for this layer takes (implementation name -> kernels.int8_form), set by
    prepare_forms with the plan."""

    plan: kernels.KernelPlan | None = None  # None: the dequantizing reference
    kernel_op = "int8-linear"  # its op in a kernel plan

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        rows: str = "tokens",
    ) -> None:
        super().__init__()
        self.rows = rows
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self.forms: dict[str, object] = {}
        self.binding = kernels.Binding()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self._product(x.dtype)
        out = None if product is None else product(x)
        if out is not None:
            return out
        w, scale = self.weight, self.weight_scale
        return kernels.int8_linear(x, w, scale, self.bias, self.plan, self.forms, self.rows)

    def _product(self, dtype: torch.dtype) -> kernels.BoundProduct | None:
        """The plan's C product for rows of `dtype` on its form, bound (see
        model.Linear._product)."""
        plan, w, b, forms = self.plan, self.weight, self.bias, self.forms
        if plan is None or torch.compiler.is_compiling():
            return None
        make = lambda: kernels.bound_int8_linear(plan, dtype, w, b, forms, self.rows)  # noqa: E731
        return self.binding.get(plan, dtype, forms, w, b, make)


def int8_linear(
    source: torch.Tensor, bias: torch.Tensor | None, policy: DtypePolicy, rows: str = "tokens"
) -> Int8Linear:
    """An Int8Linear over `rows` of a checkpoint weight `source` (any floating dtype) and a
    bias already in the run dtype."""
    q, scale = int8_weight(source)
    return Int8Linear(q.to(policy.device), scale.to(policy.device), bias, rows)


def _linears(model: Whisper) -> list[tuple[str, Linear]]:
    return [(name, module) for name, module in model.named_modules() if type(module) is Linear]


def int8_keys(model: Whisper) -> set[str]:
    """The checkpoint keys (as the model names them) of the weights that become int8."""
    return {f"{name}.weight" for name, _ in _linears(model)}


def quantize_linears(model: Whisper, state: dict[str, torch.Tensor], policy: DtypePolicy) -> None:
    """Swap every Linear of `model` for an Int8Linear of its checkpoint weight in `state`
    (keys as the model names them), and give the decoder its int8 output projection."""
    for name, module in _linears(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = int8_linear(state[f"{name}.weight"], module.bias, policy, module.rows)
        setattr(parent, attr, layer)
    model.decoder.proj_out = int8_linear(state[EMBEDDING_KEY], None, policy, rows="vocab")


def prepare_forms(
    model: Whisper, plan: kernels.KernelPlan, calls: Iterable[kernels.KernelCall]
) -> None:
    """Give every Int8Linear of `model` the form of its weight that `plan` chose for its
    call among `calls` (those the plan was built for: one per layer), and no others; the
    forms of an earlier plan are dropped first."""
    chosen: dict[int, set[str]] = {}
    for call in calls:
        if call.op == Int8Linear.kernel_op:
            name = plan.choice(call.op, plan.dtype, *call.shape)
            chosen.setdefault(id(call.weight), set()).add(name)
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            layer.forms = {}
            layer.binding = kernels.Binding()  # the earlier forms not kept alive
            for name in sorted(chosen.get(id(layer.weight), ())):
                form = kernels.int8_form(name, layer.weight, layer.weight_scale)
                if form is not None:
                    layer.forms[name] = form
