"""The measured kernels: every implementation against a float64 reference and SDPA, and
the selection (timing once, the JSON cache, the override, nothing timed while compiling)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from whisper_cli import kernels, native
from whisper_cli.dtypes import DTYPE_NAMES as DTYPES
from whisper_cli.dtypes import dtype_name
from whisper_cli.model import Extent

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch, native_dir):
    """Each test: its own cache file, and the timed choices (mode auto) unless it asks;
    the C kernels built once for all (native.library's own test builds its own)."""
    monkeypatch.setenv("WHISPER_CLI_KERNELS_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.delenv("WHISPER_CLI_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_native", lambda: native.library(native_dir))
    monkeypatch.setattr(kernels, "_native_offered", lambda: native.buildable(native_dir))


def no_timing(*_args, **_kwargs):
    raise AssertionError("a kernel was timed")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def qkv(b, h, t, s, d, dtype, sharp=3.0, seed=0):
    """q as split heads give it (a (B, T, H, D) view), k and v as the caches hold them.
    sharp scales the scores (std ~3) so the softmax is peaked, as trained attention is."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, h, d, generator=g) * sharp).transpose(1, 2)
    k, v = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, mask, causal):
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal
    )


def check_attention(q, k, v, mask=None, causal=False, impls=None):
    """Each implementation's error against float64 is SDPA's order or below (f32: 1e-5
    over the whole output, and no element further off than twice SDPA's worst).

    Elements are held to float64, not to SDPA: with sharp scores (std ~12) both are off by
    up to 2.1e-5 in places, and where each lands depends on its order of summation (held
    to AVX2, torch's SDPA and the tiled kernel differed by 1.4e-5 at an element where
    AVX-512's SDPA agrees with the kernel to 2e-6)."""
    ref = reference(q, k, v, mask, causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    sdpa_err = rel_err(sdpa, ref)
    sdpa_worst = (sdpa.double() - ref).abs().max().item()
    for name in impls or kernels.ATTENTION:
        out = kernels.ATTENTION[name](q, k, v, mask, causal)
        assert out.dtype == q.dtype and out.shape == q.shape, name
        err = rel_err(out, ref)
        if q.dtype == torch.float32:
            assert err < 1e-5, (name, err)
            worst = (out.double() - ref).abs().max().item()
            assert worst <= max(2 * sdpa_worst, 1e-5), (name, worst, sdpa_worst)
        else:
            # Measured 0.8-1.0x SDPA's error (computed in f32, rounded once); the
            # margin covers small outputs where both are a handful of roundings.
            assert err <= 1.1 * sdpa_err, (name, err, sdpa_err)


# (B, H, T, S, D): decode cross and self, a prompt, the encoder (T >= ENCODER_ROWS).
SHAPES = {
    "decode-cross": (3, 2, 1, 150, 16),
    "decode-self": (3, 2, 1, 24, 16),
    "prefill": (3, 2, 5, 5, 16),
    "encoder": (1, 3, 520, 520, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_each_attention_matches_float64_and_sdpa(shape, dtype):
    check_attention(*qkv(*shape, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocked_tiles_queries_and_heads(dtype, monkeypatch):
    """Several query blocks (the last one short) and several head tiles, with a mask."""
    monkeypatch.setattr(kernels, "BLOCK_ROWS", 64)
    monkeypatch.setattr(kernels, "SCORE_TILE_BYTES", 64 * 150 * 4)  # one head per tile
    q, k, v = qkv(2, 3, 150, 150, 16, dtype)
    mask = torch.rand(2, 3, 150, 150, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    check_attention(q, k, v, impls=["blocked"])
    check_attention(q, k, v, mask=mask, impls=["blocked"])
    check_attention(q, k, v, causal=True, impls=["blocked"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocked_tiles_batch_rows_at_decode(dtype, monkeypatch):
    """One query: tiles of whole heads and 2 of the 5 batch rows (the last tile short)."""
    b, h, s, d = 5, 2, 40, 16
    monkeypatch.setattr(kernels, "SCORE_TILE_BYTES", 4 * s * h * 2)  # f32 scores
    monkeypatch.setattr(kernels, "UPCAST_TILE_BYTES", 4 * s * 2 * d * h * 2)  # bf16 k, v
    mask = torch.arange(s) <= torch.tensor([30])[:, None]
    check_attention(*qkv(b, h, 1, s, d, dtype), impls=["blocked"])
    check_attention(*qkv(b, h, 1, s, d, dtype), mask=mask, impls=["blocked"])


@pytest.mark.parametrize("keys", ["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_real_size_decode_cross_attention(dtype, keys):
    """tiny's decode cross-attention as it runs: B 16, H 6, one query, 1500 keys, D 64;
    the keys stored by rows or by columns (model.cross_keys_transposed)."""
    q, k, v = qkv(16, 6, 1, 1500, 64, dtype)
    if keys == "transposed":
        k = k.mT.contiguous().mT
        assert k.stride(-2) == 1
    keys_kind = "rows" if keys == "rows" else "transposed"
    check_attention(q, k, v, impls=kernels.attention_candidates("decode", dtype, "none", keys_kind))


def native_built() -> None:
    """Where a C compiler exists the library must build (a test of "fused" that ran
    blocked attention instead would prove nothing); without one, skip."""
    if native.compiler() is None:
        pytest.skip("no C compiler: the native kernels are not offered")
    assert kernels._native() is not None, "the native kernels did not build (see debug log)"


def test_fused_decode_attention_is_offered_for_decode_steps_only():
    native_built()
    for args in [
        ("decode", torch.bfloat16),
        ("decode", torch.float32),
        ("decode", torch.float32, "none", "transposed"),
    ]:
        assert "fused" in kernels.attention_candidates(*args), args
    for args in [
        ("decode", torch.float16),
        ("decode", torch.bfloat16, "mask"),
        ("decode", torch.float32, "causal"),
        ("decode", torch.bfloat16, "none", "transposed"),
        ("prefill", torch.bfloat16),
        ("encoder", torch.float32),
    ]:
        assert "fused" not in kernels.attention_candidates(*args), args


FUSED_CASES = [(torch.bfloat16, "rows"), (torch.float32, "rows"), (torch.float32, "transposed")]


@pytest.mark.parametrize("dtype,keys", FUSED_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize(
    "b,h,s,d", [(16, 6, 1500, 64), (5, 8, 1500, 64), (3, 2, 37, 16), (2, 3, 37, 20)]
)
def test_fused_decode_attention_matches_float64_and_sdpa(b, h, s, d, dtype, keys):
    """The C kernel on the caches as the eager step holds them: q a (B, T, H, D) view, k
    and v the first rows of larger buffers (DecodeCaches.compact keeps views), keys by
    rows or by column (model.cross_keys_transposed); its output laid out as blocked
    attention's. Also sharp scores, where a rounding shows."""
    native_built()

    def cache(t: torch.Tensor, transposed: bool) -> torch.Tensor:
        big = torch.zeros((t.shape[0] + 3, *t.shape[1:]), dtype=t.dtype)
        if transposed:
            big = big.mT.contiguous().mT  # (B, H, D, S) storage seen as (B, H, S, D)
        big[: t.shape[0]] = t
        return big[: t.shape[0]]

    for sharp, seed in [(3.0, 0), (12.0, 2)]:
        q, k, v = qkv(b, h, 1, s, d, dtype, sharp=sharp, seed=seed)
        k, v = cache(k, keys == "transposed"), cache(v, False)
        assert kernels._fused_function(q, k, v, None, False) is not None
        check_attention(q, k, v, impls=["fused"])
        out = kernels.ATTENTION["fused"](q, k, v, None, False)
        assert out.stride() == kernels._blocked(q, k, v, None, False).stride()


@pytest.mark.parametrize(
    ("dtype", "keys"),
    [(torch.float32, "rows"), (torch.bfloat16, "rows"), (torch.float32, "transposed")],
    ids=str,
)
def test_a_fused_step_of_rows_at_their_own_positions_sums_as_each_row_alone(dtype, keys):
    """A refilled step: each row sees its first keys (a (B, 1, 1, S) mask, as
    model.Attention.forward_self builds it, or one row's mask for all). Each row's output
    is, bit for bit, its own unmasked call's over just those keys; and the masked call
    is attention's (the reference within the f32 tolerance)."""
    native_built()
    counts = torch.tensor([5, 40, 1, 23])
    q, k, v = qkv(4, 3, 1, 40, 16, dtype)
    if keys == "transposed":
        k = k.mT.contiguous().mT
    mask = (torch.arange(40) < counts[:, None])[:, None, None]  # (B, 1, 1, S)
    assert kernels._fused_function(q, k, v, mask, False) is not None
    out = kernels._fused(q, k, v, mask, False)
    for row, n in enumerate(counts.tolist()):
        alone = kernels._fused(
            q[row : row + 1], k[row : row + 1, :, :n], v[row : row + 1, :, :n], None, False
        )
        assert torch.equal(out[row : row + 1], alone), row
    torch.testing.assert_close(out, reference(q, k, v, mask, False).to(dtype))
    shared = (torch.arange(40) < 23)[None]  # (T, S): one mask for every row
    torch.testing.assert_close(
        kernels._fused(q, k, v, shared, False), reference(q, k, v, shared, False).to(dtype)
    )


@pytest.mark.parametrize("dtype,keys", FUSED_CASES, ids=lambda c: str(c))
def test_rows_that_share_their_cross_caches_read_the_rows_they_name(dtype, keys):
    """sources (DecodeCaches.sources): row b reads row sources[b]'s keys and values. Where
    those equal its own (rows of one window) the output is, bit for bit, the call's
    without them; where they do not, it is attention over the named rows' (so the C loop
    reads where they point, not its own row), rows of one source in any order; and
    through kernels.attention, which passes them to "fused" alone. Sources that name no
    row of the call are refused before any C code reads them."""
    native_built()
    sources = (0, 1, 0, 3, 1, 0, 3)  # rows 2 and 5 read row 0's, 4 row 1's, 6 row 3's
    b = len(sources)
    q, k, v = qkv(b, 3, 1, 40, 16, dtype, seed=4)
    if keys == "transposed":
        k = k.mT.contiguous().mT
    at = torch.tensor(sources)
    same_k, same_v = k[at], v[at]  # each row holding its source's values
    if keys == "transposed":
        same_k = same_k.mT.contiguous().mT
    assert torch.equal(
        kernels._fused(q, same_k, same_v, None, False, sources),
        kernels._fused(q, same_k, same_v, None, False),
    )
    out = kernels._fused(q, k, v, None, False, sources)  # rows' own values differ here
    torch.testing.assert_close(out, reference(q, same_k, same_v, None, False).to(dtype))
    assert not torch.equal(out, kernels._fused(q, k, v, None, False))
    for row in range(b):  # each row as if alone, over its source's keys and values
        s = sources[row]
        alone = kernels._fused(q[row : row + 1], k[s : s + 1], v[s : s + 1], None, False)
        assert torch.equal(out[row : row + 1], alone), row

    class Plan:
        def choice(self, *_):
            return "fused"

    through = kernels.attention(q, k, v, None, False, Plan(), sources)
    assert torch.equal(through, out)
    for wrong in [(0, 1, 0), (0, 1, 0, 3, 1, 0, 7), (0, 1, 0, 3, 1, 0, -1)]:
        with pytest.raises(ValueError, match="sources"):
            kernels._fused(q, k, v, None, False, wrong)


def test_a_step_has_one_class_for_any_count_of_text_keys_masked_or_not(monkeypatch):
    """A row must run what it runs alone: a refilled step's keys are its longest row's and
    it has a mask, so neither the count of keys (up to the text's) nor the mask of a
    one-query call changes its class; the cross-attention's 1500 keys are a class apart."""
    shape_class = kernels.OPS["attention"].shape_class
    names = {shape_class(torch.float32, 6, 1, s, 64, "none").name for s in (1, 64, 65, 448)}
    assert names == {"attention/f32/decode/H6xT1xStextxD64/none"}
    assert shape_class(torch.float32, 6, 1, 1500, 64, "none").name.endswith("S1536xD64/none")
    # The class planned unmasked runs a masked step too (here "matmul", the plan's one).
    plan = kernels.KernelPlan("auto", "cpu", torch.float32, torch.get_num_threads())
    plan.choices["attention/f32/decode/H6xT1xStextxD64/none"] = "matmul"
    ran = []
    monkeypatch.setitem(
        kernels.ATTENTION,
        "matmul",
        lambda *a, f=kernels.ATTENTION["matmul"]: ran.append(1) or f(*a),
    )
    q, k, v = qkv(2, 6, 1, 100, 64, torch.float32)
    mask = (torch.arange(100) < torch.tensor([[30], [100]]))[:, None, None]
    for m in (None, mask):
        kernels.attention(q, k, v, m, plan=plan)
    assert len(ran) == 2


def test_a_step_over_the_texts_keys_gives_each_row_its_own_sums(tmp_path, monkeypatch):
    """A refilled step's rows see their own first keys: the step's class is chosen among
    the candidates that give each row what its own unmasked call does (fused, by
    construction), even where another is faster (timings faked: SDPA's); the cache names
    them. The cross-attention's class has no masks to check."""
    native_built()
    fast_sdpa = {"sdpa": (0.1, True), "matmul": (1.0, True), "blocked": (1.0, True)}
    fast_sdpa["fused"] = (1.0, True)
    monkeypatch.setattr(
        kernels, "time_candidates", lambda runs, before=None: {n: fast_sdpa[n] for n in runs}
    )
    calls = [call("attention", 6, 1, s, 64, "none") for s in (100, 1500)]
    plan = plan_of(calls, torch.float32)
    saved = {key.split("|")[-1]: entry for key, entry in entries(tmp_path / "kernels.json").items()}
    step = saved["attention/f32/decode/H6xT1xStextxD64/none"]
    choice = plan.choices["attention/f32/decode/H6xT1xStextxD64/none"]
    assert step["rows_alike"][choice] is True
    assert kernels._step_alike(kernels.ATTENTION["fused"], (4, 6, 1, 128, 64), torch.float32, "cpu")
    if not step["rows_alike"]["sdpa"]:  # where its masked sums differ (Zen 3 and 4: they do)
        assert choice != "sdpa"
    cross = saved["attention/f32/decode/H6xT1xS1536xD64/none"]
    assert "rows_alike" not in cross and cross["choice"] == "sdpa"


@pytest.mark.parametrize("count", [2, 7, 64, 100])
def test_a_step_that_sums_any_one_count_of_keys_otherwise_is_refused(count):
    """The check sees every count of keys a refilled row can have: a kernel whose masked
    rows of one count (here `count` of 128) differ from their own calls in the last bit,
    as torch's f32 matmul's rows of 2-7 keys do held to AVX2 on a Xeon, is refused; the
    same kernel with no such count is accepted."""
    native_built()

    def otherwise_at(bad: int):
        def attend(q, k, v, mask, causal):
            out = kernels._fused(q, k, v, mask, causal)
            if mask is not None:
                hit = mask.reshape(mask.shape[0], -1).sum(-1) == bad  # rows seeing `bad` keys
                out[hit] = torch.nextafter(out[hit], torch.full_like(out[hit], math.inf))
            return out

        return attend

    shape = (4, 6, 1, 128, 64)
    assert not kernels._step_alike(otherwise_at(count), shape, torch.float32, "cpu")
    assert kernels._step_alike(otherwise_at(129), shape, torch.float32, "cpu")


def test_the_fused_call_is_a_named_range_under_the_profiler():
    """torch.profiler cannot see a ctypes call: under it, the C kernel's time is a range
    named with its key count (scripts/step_profile.py groups by it); the same result."""
    native_built()
    q, k, v = qkv(2, 3, 1, 37, 16, torch.float32)
    plain = kernels._fused(q, k, v, None, False)
    with torch.profiler.profile() as prof:
        profiled = kernels._fused(q, k, v, None, False)
    names = [e.name for e in prof.events()]
    assert names.count(f"{kernels.FUSED_RANGE}37") == 1, names
    assert torch.equal(plain, profiled)


def test_fused_runs_blocked_attention_where_it_does_not_apply(monkeypatch):
    """A mask other than each row's first keys, a causal call, more than one query,
    another dtype, bf16 keys by column, and any call where the library is absent: blocked
    attention, bit for bit."""
    q, k, v = qkv(3, 2, 1, 40, 16, torch.bfloat16)
    mask = torch.arange(40) % 3 != 1
    cases = [
        (q, k, v, mask, False),
        (*qkv(3, 2, 4, 40, 16, torch.bfloat16), None, True),
        (*qkv(3, 2, 1, 40, 16, torch.float16), None, False),
        (q, k.mT.contiguous().mT, v, None, False),
    ]
    for case in cases:
        assert kernels._fused_function(*case) is None
        assert torch.equal(kernels._fused(*case), kernels._blocked(*case))
    # Shapes the C loop cannot take (it reads B, H, D from q and S from k): broadcast
    # keys, values of another length or width, no keys at all.
    for k2, v2 in [
        (k[:1], v[:1]),
        (k, v[:, :, :20]),
        (k[..., :8], v[..., :8]),
        (k[:, :, :0], v[:, :, :0]),
    ]:
        assert kernels._fused_function(q, k2, v2, None, False) is None
    monkeypatch.setattr(kernels, "_native", lambda: None)
    assert torch.equal(kernels._fused(q, k, v, None, False), kernels._blocked(q, k, v, None, False))
    monkeypatch.setattr(kernels, "_native_offered", lambda: False)
    assert "fused" not in kernels.attention_candidates("decode", torch.bfloat16)


def test_tiled_encoder_attention_is_offered_for_the_encoder_in_f32_and_bf16(monkeypatch):
    native_built()
    assert "tiled" in kernels.attention_candidates("encoder", torch.float32)
    assert "tiled" in kernels.attention_candidates("encoder", torch.bfloat16)
    for args in [
        ("encoder", torch.float16),
        ("decode", torch.float32),
        ("prefill", torch.float32),
    ]:
        assert "tiled" not in kernels.attention_candidates(*args), args
    monkeypatch.setattr(kernels, "_native_offered", lambda: False)
    assert "tiled" not in kernels.attention_candidates("encoder", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "b,h,t,s,d",
    # tiny.en's encoder (one window, and two), then query and key counts that fill no whole
    # tile or panel, with a head width of three vectors (None: 3 x the library's lanes, so
    # the last columns take one vector), and one query over one key.
    [(1, 6, 1500, 1500, 64), (2, 3, 1500, 1500, 64), (2, 3, 37, 45, None), (1, 2, 1, 1, 16)],
)
def test_tiled_encoder_attention_matches_float64_and_sdpa(b, h, t, s, d, dtype):
    """The C kernel on q, k and v as the encoder makes them (views of one (B, T, 3, H, D)
    projection: rows of 3 x H x D, heads apart by D), sharp scores too; its output laid
    out as blocked attention's."""
    native_built()
    d = d or 3 * getattr(kernels._native(), native.ENCODER_LANES)()
    for sharp, seed in [(3.0, 0), (12.0, 2)]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(b, max(t, s), 3, h, d, generator=g).to(dtype)
        q = x[:, :t, 0].transpose(1, 2) * sharp
        k, v = x[:, :s, 1].transpose(1, 2), x[:, :s, 2].transpose(1, 2)
        assert kernels._tiled_applies(q, k, v, None, False, kernels._native())
        check_attention(q, k, v, impls=["tiled"])
        out = kernels.ATTENTION["tiled"](q, k, v, None, False)
        assert out.stride() == kernels._blocked(q, k, v, None, False).stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tiled_window_is_the_same_bytes_alone_or_in_a_batch(dtype):
    """One window's heads are fewer than twice the threads, so the C loop splits each
    head's queries between them; in a batch of four it does not: a window's output is
    the same bytes either way (a row's text must not depend on its batch)."""
    native_built()
    x = torch.randn(4, 200, 3, 3, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    batch = kernels._tiled(q, k, v, None, False)
    for row in range(4):
        one = slice(row, row + 1)
        alone = kernels._tiled(q[one], k[one], v[one], None, False)
        assert torch.equal(alone, batch[one]), row


def test_tiled_runs_sdpa_where_it_does_not_apply(monkeypatch):
    """A mask, a causal call, another dtype, a head width that is no multiple of the C
    loop's vectors, keys by column, and any call where the library is absent: SDPA, bit
    for bit. Keys of another batch (which the C loop would read past) are refused."""
    q, k, v = qkv(2, 3, 40, 40, 16, torch.float32)
    cases = [
        (q, k, v, (torch.arange(40) % 3 != 1).expand(40, 40), False),
        (q, k, v, None, True),
        (*qkv(2, 3, 40, 40, 16, torch.float16), None, False),
        (*qkv(2, 3, 40, 40, 12, torch.float32), None, False),
        (q, k.mT.contiguous().mT, v, None, False),
    ]
    for case in cases:
        assert not kernels._tiled_applies(*case, kernels._native())
        assert torch.equal(kernels._tiled(*case), kernels._sdpa(*case))
    assert not kernels._tiled_applies(q, k[:1], v[:1], None, False, kernels._native())
    # Nothing to compute (no batch row, no query, no key): the C loop would divide by zero.
    for empty in [qkv(0, 3, 40, 40, 16, torch.float32), (q[:, :, :0], k, v)]:
        assert not kernels._tiled_applies(*empty, None, False, kernels._native())
        assert torch.equal(kernels._tiled(*empty, None, False), kernels._sdpa(*empty, None, False))
    assert not kernels._tiled_applies(q, k[:, :, :0], v[:, :, :0], None, False, kernels._native())
    monkeypatch.setattr(kernels, "_native", lambda: None)
    assert torch.equal(kernels._tiled(q, k, v, None, False), kernels._sdpa(q, k, v, None, False))


def test_loading_the_native_library_changes_no_other_computation(tmp_path):
    """Subnormals survive the load: a library linked with -ffast-math (gcc before 13)
    would turn on flush-to-zero for the whole process as it loads."""
    native_built()
    tiny = torch.tensor([1e-39])
    assert (tiny * 0.5).item() != 0.0
    assert native.library.__wrapped__(tmp_path) is not None
    assert (tiny * 0.5).item() != 0.0
    assert np.float32(1e-39) * np.float32(0.5) != 0.0


def test_the_library_is_looked_up_once_per_cache_folder(tmp_path, monkeypatch):
    """_native (called per kernel call) finds the library beside the kernel cache file
    the environment names, and follows a change of it, without building a path each call."""
    monkeypatch.undo()  # this test's own _native: the real one, not own_cache's
    seen = []
    monkeypatch.setattr(native, "library", lambda folder: seen.append(folder) or folder)
    try:
        for name in ("a", "b", "a"):
            path = tmp_path / name / "kernels.json"
            monkeypatch.setenv("WHISPER_CLI_KERNELS_CACHE", str(path))
            for _ in range(3):
                assert kernels._native() == tmp_path / name / "native"
    finally:
        kernels._native_for.cache_clear()  # it holds this test's stand-ins for libraries
    assert seen == [tmp_path / "a" / "native", tmp_path / "b" / "native"]


def test_offering_the_kernel_builds_nothing(tmp_path, monkeypatch):
    """A plan offers "fused" where it can be built; the build waits for its first call
    (a reference or CUDA plan never calls it)."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kernels, "_native_offered", lambda: native.buildable(tmp_path))
    assert "fused" in kernels.attention_candidates("decode", torch.bfloat16)
    assert not list(tmp_path.glob("*.so"))


def test_native_library_is_built_once_and_absent_where_it_cannot_build(tmp_path, monkeypatch):
    """Built into the folder given, found there by the next process (no compiler run);
    a compiler that fails leaves the kernels absent, never an error."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    built = native.library.__wrapped__(tmp_path / "a")
    assert built is not None and len(list((tmp_path / "a").glob("native-*.so"))) == 1

    def no_build(*_args):
        raise AssertionError("built again")

    real_build = native._build

    monkeypatch.setattr(native, "_build", no_build)
    assert native.library.__wrapped__(tmp_path / "a") is not None
    monkeypatch.setattr(native, "_build", real_build)
    monkeypatch.setenv("CC", "false")
    assert native.library.__wrapped__(tmp_path / "b") is None
    assert not list((tmp_path / "b").glob("*.so"))
    assert len(list((tmp_path / "b").glob("*.failed"))) == 1  # the next process: no try
    monkeypatch.setattr(native, "_build", no_build)
    assert native.library.__wrapped__(tmp_path / "b") is None


def test_transposed_keys_are_a_class_of_their_own(monkeypatch):
    """The same call on keys stored by column is timed and chosen apart, on keys laid out
    so; the class of keys by rows keeps its name (and its cached choice)."""
    rows = kernels.OPS["attention"].shape_class(torch.float32, 6, 1, 1500, 64, "none")
    cols = kernels.OPS["attention"].shape_class(torch.float32, 6, 1, 1500, 64, "none", "transposed")
    assert rows.name == "attention/f32/decode/H6xT1xS1536xD64/none"
    assert cols.name == rows.name + "/keys-transposed"
    seen = []
    for name in cols.candidates:
        real = kernels.ATTENTION[name]

        def record(q, k, *rest, f=real):
            seen.append(k.stride(-2))
            return f(q, k, *rest)

        monkeypatch.setitem(kernels.ATTENTION, name, record)
    runs = kernels.OPS["attention"].runs(cols, torch.float32, None, torch.device("cpu"))
    for run in runs.values():
        run()
    assert seen == [1] * len(cols.candidates)  # each timed on keys stored by column


@pytest.mark.parametrize(
    "mask_shape", [(7, 9), (3, 1, 7, 9), (3, 2, 7, 9), (1, 9)], ids=lambda s: "x".join(map(str, s))
)
def test_bool_masks_broadcast_as_in_sdpa(mask_shape):
    q, k, v = qkv(3, 2, 7, 9, 16, torch.float32)
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[..., 0] = True  # every query sees a key
    check_attention(q, k, v, mask=mask)


def test_causal_is_top_left_aligned_as_in_sdpa():
    """is_causal with T < S: query i sees keys 0..i (SDPA's convention), T == S the usual."""
    check_attention(*qkv(2, 2, 4, 9, 16, torch.float32), causal=True)
    check_attention(*qkv(2, 2, 6, 6, 16, torch.float32), causal=True)


def test_static_cache_mask_of_the_decode_step():
    """The fixed-shape step: position p sees cache slots 0..p of the whole cache."""
    cache_len, positions = 32, torch.tensor([11])
    mask = torch.arange(cache_len) <= positions[:, None]  # (T, L)
    check_attention(*qkv(4, 2, 1, cache_len, 16, torch.bfloat16), mask=mask)


@pytest.mark.parametrize("lead", [(16, 1), (3, 5), (7,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_logits_matches_float64(dtype, lead):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(*lead, 64, generator=g).to(dtype)
    weight = torch.randn(kernels.LOGIT_BLOCK_ROWS * 2 + 77, 64, generator=g).to(dtype)
    ref = hidden.double() @ weight.double().T
    plain = hidden @ weight.T
    for name in kernels.logits_candidates(dtype):
        out = kernels.LOGITS[name](hidden, weight)
        assert out.dtype == dtype and out.shape == (*lead, weight.shape[0]), name
        assert out.is_contiguous(), name  # log-softmax and argmax run over V
        if dtype == torch.float32:
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        else:
            assert rel_err(out, ref) <= 1.5 * rel_err(plain, ref), name


@pytest.mark.skipif(not kernels.packable(torch.float32), reason="no oneDNN in this torch")
def test_packed_logits_follow_their_weight():
    """One packed copy per weight, whatever M; repacked when the weight changes in place,
    and dropped with the weight."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(3000, 64, generator=g)
    copies = []
    for m in (1, 5, 16):
        hidden = torch.randn(m, 1, 64, generator=g)
        torch.testing.assert_close(kernels.LOGITS["packed"](hidden, weight), hidden @ weight.T)
        copies.append(kernels._PACKED[id(weight)][2])
    assert copies[0] is copies[1] is copies[2]  # packed once, for every M
    weight.mul_(2)  # a new version: the old copy must not be used
    torch.testing.assert_close(kernels.LOGITS["packed"](hidden, weight), hidden @ weight.T)
    assert kernels._PACKED[id(weight)][2] is not copies[0]
    key = id(weight)
    del weight
    assert key not in kernels._PACKED
    with torch.inference_mode():  # a weight made here has no version counter
        weight = torch.randn(300, 64, generator=g)
        torch.testing.assert_close(kernels.LOGITS["packed"](hidden, weight), hidden @ weight.T)


def test_packed_is_offered_only_where_onednn_packs_the_dtype():
    """Offered: it runs and matches in that dtype. Not offered: oneDNN refuses to pack."""
    assert kernels.packable(torch.float32) == torch.backends.mkldnn.is_available()
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(4, 1, 64, generator=g).to(dtype)
        weight = torch.randn(500, 64, generator=g).to(dtype)
        if "packed" in kernels.logits_candidates(dtype):
            out = kernels.LOGITS["packed"](hidden, weight)
            assert out.dtype == dtype
            ref = hidden.double() @ weight.double().T
            assert rel_err(out, ref) <= 1.5 * rel_err(hidden @ weight.T, ref) + 1e-7
        else:
            with pytest.raises(RuntimeError):
                torch.ops.mkldnn._reorder_linear_weight(weight)


def test_f32_blocks_logits_at_real_size():
    """tiny's vocabulary projection: M 16, C 384, V 51865 in bf16, one rounding."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(16, 1, 384, generator=g).to(torch.bfloat16)
    weight = (torch.randn(51865, 384, generator=g) * 0.05).to(torch.bfloat16)
    ref = hidden.double() @ weight.double().T
    exact = ref.to(torch.bfloat16)  # the correctly rounded result
    out = kernels.LOGITS["f32-blocks"](hidden, weight)
    assert (out != exact).float().mean() < 0.01  # f32 sums differ from f64 in a few ties
    assert rel_err(out, ref) <= rel_err(hidden @ weight.T, ref) * 1.01


@pytest.mark.parametrize("lead", [(16, 1), (2, 300)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_each_linear_matches_float64(dtype, lead):
    """The f32 upcasts are a half GEMM accumulating in f32: as exact as torch's, or more;
    oneDNN's packed GEMM is torch's GEMM in another order. Each is offered where it runs:
    "packed" where oneDNN packs the dtype, "f32-packed" for half where it packs f32."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(*lead, 96, generator=g).to(dtype)
    weight, bias = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80).to(dtype)
    ref = F.linear(x.double(), weight.double(), bias.double())
    plain = F.linear(x, weight, bias)
    names = kernels.upcast_candidates("linear", dtype)
    half = dtype != torch.float32
    assert names[0] == "linear" and ("f32-upcast" in names) == half
    assert ("packed" in names) == kernels.packable(dtype)
    assert ("f32-packed" in names) == (half and kernels.packable(torch.float32))
    for name in names:
        for b in (bias, None):
            out = kernels.LINEAR[name](x, weight, b)
            assert out.dtype == dtype and out.shape == (*lead, 80), name
        out = kernels.LINEAR[name](x, weight, bias)
        if half:
            assert rel_err(out, ref) <= 1.01 * rel_err(plain, ref), name
        else:
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_each_conv1d_matches_float64(dtype, stride):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 24, 100, generator=g).to(dtype)
    weight, bias = torch.randn(32, 24, 3, generator=g).to(dtype), torch.randn(32).to(dtype)
    ref = F.conv1d(x.double(), weight.double(), bias.double(), stride, 1)
    plain = F.conv1d(x, weight, bias, stride, 1)
    for name in kernels.CONV1D:
        out = kernels.CONV1D[name](x, weight, bias, stride, 1)
        assert out.dtype == dtype and out.shape == plain.shape, name
        assert rel_err(out, ref) <= 1.01 * rel_err(plain, ref), name


# --- the plan ------------------------------------------------------------------------


def entries(path) -> dict:
    return json.loads(path.read_text())["entries"]


def call(op: str, *shape, weight=None) -> kernels.KernelCall:
    return kernels.KernelCall(op, shape, weight)


def plan_of(calls, dtype, **kwargs) -> kernels.KernelPlan:
    return kernels.build_plan(calls, dtype, **kwargs)


def test_f32_conv_is_never_timed_and_f32_linear_only_beside_another(tmp_path, monkeypatch):
    """f32 has the reference alone for a convolution, and for a linear layer where oneDNN
    packs nothing and the C library does not build: chosen without a timing, nothing saved."""
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    monkeypatch.setitem(kernels._PACKABLE, torch.float32, False)
    monkeypatch.setattr(kernels, "_native_offered", lambda: False)
    x, weight = torch.randn(4, 1, 32), torch.randn(48, 32)
    mel, conv = torch.randn(1, 8, 40), torch.randn(16, 8, 3)
    calls = [
        call("linear", 48, 32, "tokens", weight=weight),
        call("conv1d", 8, 16, 3, 40, 2, 1, weight=conv),
    ]
    plan = plan_of(calls, torch.float32)
    assert set(plan.choices.values()) == {"linear", "conv"} and not plan.timed
    torch.testing.assert_close(kernels.linear(x, weight, None, plan), F.linear(x, weight))
    torch.testing.assert_close(
        kernels.conv1d(mel, conv, None, 2, 1, plan), F.conv1d(mel, conv, None, 2, 1)
    )
    assert kernels.upcast_candidates("linear", torch.float32) == ("linear",)
    assert kernels.upcast_candidates("conv1d", torch.float32) == ("conv",)
    assert not (tmp_path / "kernels.json").exists()


def test_linear_and_conv_choices_are_timed_and_saved(tmp_path):
    weight, conv = torch.randn(48, 32).bfloat16(), torch.randn(16, 8, 3).bfloat16()
    calls = [
        call("linear", 48, 32, "tokens", weight=weight),
        call("conv1d", 8, 16, 3, 40, 2, 1, weight=conv),
    ]
    plan = plan_of(calls, torch.bfloat16)
    saved = entries(tmp_path / "kernels.json")
    names = sorted(key.split("|")[-1] for key in saved)
    assert names == ["conv1d/bf16/Cin8xCout16xW3xL64/s2p1", "linear/bf16/N48xK32/tokens"]
    assert sorted(plan.timed) == names
    timed = {n for e in saved.values() for n in e["ms"]}
    linear = kernels.upcast_candidates("linear", torch.bfloat16)
    assert timed == {"conv", *linear} and "f32-upcast" in linear
    # f32 linear layers: the reference, packed where oneDNN packs f32, columns where the
    # C library builds
    others = {"packed"} if kernels.packable(torch.float32) else set()
    others |= {"columns"} if kernels._native_offered() else set()
    if others:
        plan = plan_of([call("linear", 48, 32, "tokens", weight=weight.float())], torch.float32)
        key = "linear/f32/N48xK32/tokens"
        assert plan.timed == {key}
        assert set(plan.ms[key]) == {"linear", *others}


def test_a_plan_times_once_and_writes_the_cache(tmp_path, monkeypatch):
    plan = plan_of([call("attention", 2, 1, 40, 16, "none")], torch.bfloat16)
    saved = entries(tmp_path / "kernels.json")
    (key, entry), *more = saved.items()
    assert not more
    assert key.endswith("|attention/bf16/decode/H2xT1xStextxD16/none")
    assert f"threads={torch.get_num_threads()}" in key and kernels.cpu_model() in key
    assert set(entry["ms"]) == set(kernels.attention_candidates("decode", torch.bfloat16))
    # A step's class is chosen among the candidates that give each row what it gets alone
    # (those checked are recorded): on Zen 4 SDPA passes in bf16; on a Xeon with AMX
    # (model 207) SDPA, matmul and blocked do not, and fused is chosen however it times.
    ms, checked = entry["ms"], entry["rows_alike"]
    assert checked[entry["choice"]] is True
    passed = [name for name, ok in checked.items() if ok]
    assert entry["choice"] == kernels._fastest_of(ms, passed)
    assert plan.choices == {key.split("|")[-1]: entry["choice"]}

    # The same class (S 40 and 50: the text's keys), in this plan and in the next one: no
    # new timing.
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    again = plan_of([call("attention", 2, 1, 50, 16, "none")], torch.bfloat16)
    assert again.choices == plan.choices and not again.timed
    assert again.choice("attention", torch.bfloat16, 2, 1, 50, 16, "none") == entry["choice"]
    assert entries(tmp_path / "kernels.json") == saved


def test_a_plan_holds_for_the_instructions_its_kernels_ran(tmp_path, monkeypatch):
    """A choice timed (and checked for rows alike) while oneDNN was held to AVX2, or by
    another build of the C kernels, is not taken where they run other code, nor the
    other way: each is timed under its own key, and each key is read back untimed."""
    shape = [call("attention", 2, 1, 40, 16, "none")]
    build_name = kernels.native.build_name
    for name in kernels.ISA_LIMITS:  # none set for the first plan, whatever the shell has
        monkeypatch.delenv(name, raising=False)
    plan_of(shape, torch.bfloat16)
    (first,) = entries(tmp_path / "kernels.json")
    cpu = f"cpu={kernels.cpu_model()}|features="
    assert first.startswith(cpu) and f"|isa={torch.backends.cpu.get_cpu_capability()}|" in first
    assert "|native=" in first and f"|torch={torch.__version__}|" in first

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert plan_of(shape, torch.bfloat16).timed
    monkeypatch.setattr(kernels.native, "build_name", lambda _dir: "native-another-build")
    assert plan_of(shape, torch.bfloat16).timed
    keys = set(entries(tmp_path / "kernels.json"))
    assert len(keys) == 3 and first in keys
    assert sum("|ONEDNN_MAX_CPU_ISA=AVX2|" in key for key in keys) == 2
    assert sum("|native=native-another-build|" in key for key in keys) == 1

    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    assert not plan_of(shape, torch.bfloat16).timed
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(kernels.native, "build_name", build_name)
    assert not plan_of(shape, torch.bfloat16).timed  # the first key, as it was


def test_a_choice_among_some_is_the_fastest_of_them():
    times = {"ref": 1.0, "a": 0.5, "b": 0.97}
    assert kernels._fastest_of(times) == "a"
    assert kernels._fastest_of(times, ["ref", "b"]) == "ref"  # b: not 5% faster
    assert kernels._fastest_of(times, ["b"]) == "b"  # the reference is not among them
    assert kernels._fastest_of(times, []) == "a"  # none is: all are


def test_each_timed_call_comes_after_its_flush_and_without_its_time(monkeypatch):
    monkeypatch.setattr(kernels, "TIMING_MAX_REPS", kernels.TIMING_REPS + 1)
    calls = []

    def flush():
        calls.append("flush")
        time.sleep(0.05)

    def run(name):  # 1 ms each: no candidate 4x the other's warm-up (dropped untimed)
        calls.append(name)
        time.sleep(0.001)

    runs = {"ref": lambda: run("ref"), "other": lambda: run("other")}
    times = kernels.time_candidates(runs, flush)
    assert all(timed and ms < 40 for ms, timed in times.values())  # no flush's 50 ms in
    assert set(calls[0::2]) == {"flush"} and "flush" not in calls[1::2]
    assert len(calls) >= 2 * len(runs) * (1 + kernels.TIMING_REPS)  # warm-ups and rounds


def test_only_the_vocabulary_projection_is_timed_with_the_caches_flushed(monkeypatch):
    """A step reads the tied projection's weight once, after the cross-attention has
    streamed every row's keys and values through the cache: its classes are timed with
    the weight out of the cache; the other GEMMs as before."""
    flushes = {}

    def record(runs, before=None):
        flushes["logits" if "weight-first" in runs else "linear"] = before
        return {n: (1.0, True) for n in runs}

    monkeypatch.setattr(kernels, "time_candidates", record)
    monkeypatch.setattr(kernels, "largest_cache_bytes", lambda: 1 << 20)
    monkeypatch.setitem(kernels._PACKABLE, torch.float32, True)  # linear timed beside packed
    logits, linear = torch.randn(300, 32), torch.randn(48, 32)
    plan_of([call("logits", 300, 32, weight=logits)], torch.float32)
    plan_of([call("linear", 48, 32, "tokens", weight=linear)], torch.float32)
    assert flushes["linear"] is None
    buffer = flushes["logits"].__self__  # the flush reads this buffer whole
    assert buffer.numel() * buffer.element_size() == kernels.COLD_MIN_BYTES
    assert flushes["logits"]().item() == 0.0


def test_a_flush_reads_past_the_largest_cache(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert kernels.largest_cache_bytes(tmp_path) == 300 << 20
    odd = tmp_path / "odd"
    for index, size in (("index0", ""), ("index1", "1024KB"), ("index2", "4096")):
        (odd / index).mkdir(parents=True)
        (odd / index / "size").write_text(size)
    assert kernels.largest_cache_bytes(odd) == 4096  # no unit: bytes; the rest skipped
    assert kernels.largest_cache_bytes(tmp_path / "absent") is None
    assert kernels.flush_bytes(300 << 20) == 375 << 20
    assert kernels.flush_bytes(None) == kernels.flush_bytes(1 << 20) == kernels.COLD_MIN_BYTES
    assert kernels.flush_bytes(4 << 30) == kernels.COLD_MAX_BYTES


def test_gemms_over_tokens_are_chosen_among_those_computing_rows_alike(tmp_path, monkeypatch):
    """A candidate whose result for a row changes with the rows beside it (faked: at 3
    rows) is never chosen for text tokens, however fast, and the cache names the ones
    that passed; over audio frames (whole windows, no check) the fastest is."""
    if not kernels.packable(torch.float32):
        pytest.skip("oneDNN packs no f32 weights here")
    real_packed = kernels._linear_packed

    def packed_odd_at_3(x, weight, bias, packed=None):
        out = real_packed(x, weight, bias, packed)
        return out + 1e-3 if x.shape[0] == 3 else out

    def exact(x, weight, bias=None):  # each row alike at any count: float64, rounded once
        return (x.double() @ weight.double().T).float()

    monkeypatch.setattr(kernels, "_linear_packed", packed_odd_at_3)
    monkeypatch.setitem(kernels.LINEAR, "linear", exact)
    fast_packed = {"linear": (1.0, True), "packed": (0.1, True)}
    monkeypatch.setattr(kernels, "time_candidates", lambda runs, before=None: fast_packed)
    weight = torch.randn(48, 32)
    calls = [call("linear", 48, 32, rows, weight=weight) for rows in ("tokens", "frames")]
    plan = plan_of(calls, torch.float32)
    assert plan.choices == {
        "linear/f32/N48xK32/tokens": "linear",
        "linear/f32/N48xK32/frames": "packed",
    }
    saved = {key.split("|")[-1]: entry for key, entry in entries(tmp_path / "kernels.json").items()}
    # Checked in order of speed, up to the first that passes.
    assert saved["linear/f32/N48xK32/tokens"]["rows_alike"] == {"packed": False, "linear": True}
    assert "rows_alike" not in saved["linear/f32/N48xK32/frames"]


def test_a_choice_among_rows_alike_checks_only_the_candidates_that_decide_it():
    """The check runs in order of speed up to the first candidate that passes, and on the
    reference only where that one is not TIMING_MARGIN faster; the choice is the one
    _fastest_of makes among all that pass."""
    times = {"ref": 1.0, "a": 0.5, "b": 0.6, "c": 0.97}

    def choose(passing):
        asked = []
        choice, checked = kernels._fastest_alike(times, lambda n: asked.append(n) or n in passing)
        assert choice == kernels._fastest_of(times, passing)
        assert list(checked) == asked and len(set(asked)) == len(asked)
        return choice, asked

    assert choose({"ref", "a", "b", "c"}) == ("a", ["a"])
    assert choose({"ref", "b", "c"}) == ("b", ["a", "b"])
    assert choose({"ref", "c"}) == ("ref", ["a", "b", "c", "ref"])  # c: not 5% faster
    assert choose({"c"}) == ("c", ["a", "b", "c", "ref"])
    assert choose({"ref"}) == ("ref", ["a", "b", "c", "ref"])
    assert choose(set()) == ("a", ["a", "b", "c", "ref"])  # none passes: all are


def test_a_half_gemm_that_sums_otherwise_for_few_rows_is_found():
    """A half GEMM computes in float32 and rounds once, so a sum in another order at some
    row counts mostly rounds to the same half value: the check of a half class draws
    rows until CHECK_OUTPUTS values are compared, and finds such a GEMM (faked: K summed
    in two halves below 16 rows, as a BLAS switches kernels) that one draw mostly misses
    (on a real f32 GEMM under a bf16 384x384 linear, one draw found it 9 times in 40);
    one that sums alike at every count passes every draw."""
    g = torch.Generator().manual_seed(0)
    n, k, dtype = 384, 384, torch.bfloat16  # bf16: 8 bits kept of float32's 24
    w = torch.randn(n, k, generator=g).to(dtype).float()

    def whole(r):  # one row (K,) -> (N,), one matrix-vector product: alike at any count
        return w @ r

    def split(r):  # the halves of K summed apart, then added
        return w[:, : k // 2] @ r[: k // 2] + w[:, k // 2 :] @ r[k // 2 :]

    def otherwise_below_16(x):  # (M, K) -> (M, N)
        row = whole if x.shape[0] >= 16 else split
        return torch.stack([row(r) for r in x.float()]).to(dtype)

    def always_split(x):
        return torch.stack([split(r) for r in x.float()]).to(dtype)

    count = kernels._check_draws(dtype, 16 * n)
    assert kernels._check_draws(torch.float32, 16 * n) == 1 and count * 16 * n >= 1 << 19
    draws = [torch.randn(16, k, generator=g).to(dtype) for _ in range(count)]
    assert not kernels._rows_alike(otherwise_below_16, draws)
    assert kernels._rows_alike(always_split, draws)
    missed = sum(kernels._rows_alike(otherwise_below_16, [x]) for x in draws)
    assert missed > 0  # what one draw alone would have let through, at times (52 of 86)


def test_a_one_row_gemm_runs_on_two_copies_of_its_row(monkeypatch):
    """oneDNN and BLAS sum one row in another order than a GEMM: a call of one row (a
    row stepped alone) runs its implementation on two, so it rounds as in company."""
    seen = []
    weight, scale, bias = int8_layer(n=80, k=96)
    plan = plan_of([], torch.float32, mode="packed,weight-only")
    for table, name in (
        (kernels.LINEAR, "packed"),
        (kernels.LOGITS, "packed"),
        (kernels.INT8_LINEAR, "weight-only"),
    ):
        real = table[name]
        monkeypatch.setitem(table, name, lambda x, *a, f=real: seen.append(x.shape) or f(x, *a))
    w = torch.randn(80, 96)
    for rows in (1, 3):
        x = torch.randn(rows, 1, 96)
        seen.clear()
        outs = [
            kernels.linear(x, w, None, plan),
            kernels.logits(x, w, plan),
            kernels.int8_linear(x, weight, scale, bias, plan),
        ]
        assert [o.shape for o in outs] == [(rows, 1, 80)] * 3
        assert [s[0] for s in seen] == [2 if rows == 1 else rows] * 3
        if rows == 1:
            torch.testing.assert_close(outs[0], F.linear(x, w), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outs[1], x @ w.T, rtol=1e-5, atol=1e-5)


def test_fastest_needs_a_margin_over_the_reference_and_drops_clear_losers():
    calls = {"ref": 0, "slow": 0}

    def sleeper(name, seconds):
        def run():
            calls[name] = calls.get(name, 0) + 1
            time.sleep(seconds)

        return run

    ref, slow, fast = sleeper("ref", 0.004), sleeper("slow", 0.05), sleeper("fast", 0.002)
    choice, ms = kernels._fastest({"ref": ref, "slow": slow, "fast": fast})
    assert choice == "fast" and set(ms) == {"ref", "slow", "fast"}
    assert calls["slow"] == 2  # both warm-ups 4x the best one: not timed further
    assert calls["ref"] >= 1 + kernels.TIMING_REPS
    near = sleeper("near", 0.0039)  # 2.5% faster: not worth leaving the reference
    assert kernels._fastest({"ref": ref, "near": near})[0] == "ref"


def test_a_kernel_made_in_its_first_call_is_timed_on_its_later_ones():
    """oneDNN and fbgemm make a kernel for each new shape in its first call: a first call
    4x the best one's is warmed up again, and the candidate chosen on its real speed."""
    calls = []

    def ref():
        time.sleep(0.004)

    def made_first():
        calls.append(1)
        time.sleep(0.05 if len(calls) == 1 else 0.001)

    choice, ms = kernels._fastest({"ref": ref, "made-first": made_first})
    assert choice == "made-first" and ms["made-first"] < 4
    assert len(calls) >= 2 + kernels.TIMING_REPS


def attention_candidates_of(name: str) -> tuple[str, ...]:
    """The candidates of an attention class from its name (see _attention_shape)."""
    _, dtype, cls, _, kind, *keys = name.split("/")
    layout = keys[0].removeprefix("keys-") if keys else "rows"
    return kernels.attention_candidates(cls, DTYPES[dtype], kind, layout)


def forge(path, choices: dict[str, str], dtype=torch.float32) -> None:
    """A cache file in which these classes' choices were timed (among all candidates)."""
    prefix = f"{kernels._machine()}|threads={torch.get_num_threads()}|"
    data = {}
    for name, choice in choices.items():
        op = name.split("/")[0]
        cands = {
            "attention": attention_candidates_of(name) if op == "attention" else (),
            "logits": kernels.logits_candidates(dtype),
            "linear": kernels.upcast_candidates("linear", dtype),
            "conv1d": kernels.upcast_candidates("conv1d", dtype),
            "int8-linear": kernels.int8_candidates(dtype, name.split("/")[-1]),
        }[op]
        data[prefix + name] = {"choice": choice, "ms": dict.fromkeys(cands, 1.0)}
    path.write_text(json.dumps({"version": kernels.CACHE_VERSION, "entries": data}))


def test_a_plan_from_a_given_cache_file_yields_its_choices(tmp_path, monkeypatch):
    """The file decides (here: forged choices, none the reference), so a load repeats the
    measured kernels, and the calls run them."""
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    bf16 = torch.bfloat16
    weight, conv = torch.randn(48, 32).to(bf16), torch.randn(16, 8, 3).to(bf16)
    forged = {
        "attention/bf16/decode/H2xT1xStextxD16/none": "blocked",
        "attention/bf16/prefill/H2xT64xS64xD16/causal": "matmul",
        "logits/bf16/V48xC32": "f32-blocks",
        "linear/bf16/N48xK32/tokens": "f32-upcast",
        "conv1d/bf16/Cin8xCout16xW3xL64/s2p1": "f32-upcast",
    }
    forge(tmp_path / "kernels.json", forged, bf16)
    calls = [
        call("attention", 2, 1, 40, 16, "none"),
        call("attention", 2, 5, 5, 16, "causal"),
        call("logits", 48, 32, weight=weight),
        call("linear", 48, 32, "tokens", weight=weight),
        call("conv1d", 8, 16, 3, 40, 2, 1, weight=conv),
    ]
    plan = plan_of(calls, bf16)
    assert plan.choices == forged and not plan.timed

    ran = []
    for table, name in (
        (kernels.ATTENTION, "blocked"),
        (kernels.ATTENTION, "matmul"),
        (kernels.LOGITS, "f32-blocks"),
        (kernels.LINEAR, "f32-upcast"),
        (kernels.CONV1D, "f32-upcast"),
    ):
        real = table[name]
        monkeypatch.setitem(table, name, lambda *a, n=name, f=real: ran.append(n) or f(*a))
    q, k, v = qkv(2, 2, 1, 40, 16, bf16)
    kernels.attention(q, k, v, plan=plan)
    q, k, v = qkv(2, 2, 5, 5, 16, bf16)
    kernels.attention(q, k, v, causal=True, plan=plan)
    kernels.logits(torch.randn(5, 1, 32).to(bf16), weight, plan)
    kernels.linear(torch.randn(5, 32).to(bf16), weight, None, plan)
    kernels.conv1d(torch.randn(1, 8, 40).to(bf16), conv, None, 2, 1, plan)
    assert ran == ["blocked", "matmul", "f32-blocks", "f32-upcast", "f32-upcast"]


def test_a_class_the_plan_lacks_runs_the_reference(monkeypatch):
    """A shape outside the plan (a longer text than it was made for) is never timed."""
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    plan = plan_of([call("attention", 2, 1, 40, 16, "none")], torch.float32, mode="matmul")
    assert plan.choice("attention", torch.float32, 2, 1, 40, 16, "none") == "matmul"
    auto = kernels.KernelPlan("auto", "cpu", torch.float32, torch.get_num_threads())
    assert auto.choice("attention", torch.float32, 2, 1, 400, 16, "none") == "sdpa"
    assert auto.choice("logits", torch.float32, 100, 32) == "matmul"
    assert auto.choice("linear", torch.bfloat16, 100, 32, "tokens") == "linear"


def test_a_malformed_entry_is_timed_again(tmp_path):
    calls = [call("attention", 2, 1, 40, 16, "none")]
    plan_of(calls, torch.float32)
    path = tmp_path / "kernels.json"
    key = next(iter(entries(path)))
    path.write_text(json.dumps({"version": kernels.CACHE_VERSION, "entries": {key: "x"}}))
    plan = plan_of(calls, torch.float32)
    candidates = kernels.attention_candidates("decode", torch.float32)
    assert plan.timed and entries(path)[key]["choice"] in candidates


def test_a_choice_among_other_candidates_is_timed_again(tmp_path):
    """A cached choice timed before a candidate joined is timed again, among all."""
    weight = torch.randn(300, 32).bfloat16()
    calls = [call("logits", 300, 32, weight=weight)]
    plan_of(calls, torch.bfloat16)
    path = tmp_path / "kernels.json"
    saved = entries(path)
    key = next(iter(saved))
    saved[key] = {"choice": "matmul", "ms": {"matmul": 1.0}}
    path.write_text(json.dumps({"version": kernels.CACHE_VERSION, "entries": saved}))
    plan_of(calls, torch.bfloat16)
    assert set(entries(path)[key]["ms"]) == set(kernels.logits_candidates(torch.bfloat16))


def test_thread_count_is_part_of_the_key(tmp_path):
    """A plan is made for the thread count of its load: another count, other entries."""
    threads = torch.get_num_threads()
    calls = [call("attention", 2, 1, 40, 16, "none")]
    try:
        first = plan_of(calls, torch.float16)
        torch.set_num_threads(1 if threads > 1 else 2)
        second = plan_of(calls, torch.float16)
    finally:
        torch.set_num_threads(threads)
    saved = entries(tmp_path / "kernels.json")
    assert len(saved) == 2 and all("/f16/decode/" in key for key in saved)
    assert first.threads == threads != second.threads and first.timed and second.timed


def test_logits_choice_is_timed_and_saved(tmp_path):
    hidden, weight = torch.randn(16, 1, 32), torch.randn(3000, 32)
    plan = plan_of([call("logits", 3000, 32, weight=weight)], torch.float32)
    torch.testing.assert_close(kernels.logits(hidden, weight, plan), hidden @ weight.T)
    (key, entry), *_ = entries(tmp_path / "kernels.json").items()
    assert key.endswith("logits/f32/V3000xC32")
    assert set(entry["ms"]) == set(kernels.logits_candidates(torch.float32))


@pytest.mark.parametrize(
    "content",
    [
        None,
        "{not json",
        '{"version": 0, "entries": {}}',
        f'{{"version": {kernels.CACHE_VERSION}, "entries": []}}',
    ],
)
def test_unwritable_or_bad_cache_never_fails_the_load(tmp_path, content):
    if content is None:  # a directory that cannot exist: its parent is a file
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "kernels.json"
    else:
        path = tmp_path / "bad.json"
        path.write_text(content)
    q, k, v = qkv(2, 2, 1, 40, 16, torch.float32)
    plan = plan_of([call("attention", 2, 1, 40, 16, "none")], torch.float32, path=path)
    assert len(plan.choices) == 1 and plan.timed  # measured and kept in the plan all the same
    out = kernels.attention(q, k, v, plan=plan)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    if content is not None:  # a bad file is replaced by a good one
        assert len(entries(path)) == 1


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("WHISPER_CLI_KERNELS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.kernels_cache_path() == tmp_path / "whisper-cli" / "kernels.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernels.kernels_cache_path() == (
        kernels.Path.home() / ".cache" / "whisper-cli" / "kernels.json"
    )


@pytest.mark.parametrize(
    ("mode", "f32", "bf16", "logits"),
    [
        ("reference", "sdpa", "sdpa", "matmul"),
        ("blocked", "blocked", "blocked", "matmul"),  # not a logits candidate: reference
        ("linear,matmul", "matmul", "matmul", "linear"),  # the first that applies
    ],
)
def test_override_forces_kernels_without_timing(tmp_path, monkeypatch, mode, f32, bf16, logits):
    monkeypatch.setenv("WHISPER_CLI_KERNELS", mode)
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    weight = torch.randn(100, 32)
    for dtype, want in ((torch.float32, f32), (torch.bfloat16, bf16)):
        q, k, _ = qkv(2, 2, 1, 40, 16, dtype)
        plan = plan_of([call("attention", 2, 1, 40, 16, "none")], dtype)
        assert plan.mode == mode and plan.choice("attention", dtype, 2, 1, 40, 16, "none") == want
        assert kernels.attention(q, k, k, plan=plan).dtype == dtype
    plan = plan_of([call("logits", 100, 32, weight=weight)], torch.float32)
    assert plan.choice("logits", torch.float32, 100, 32) == logits
    assert not (tmp_path / "kernels.json").exists()


def test_off_the_cpu_the_plan_is_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "time_candidates", no_timing)
    plan = plan_of([call("attention", 2, 1, 40, 16, "none")], torch.float32, device="meta")
    assert plan.mode == "reference" and plan.choices == {
        "attention/f32/decode/H2xT1xStextxD16/none": "sdpa"
    }


def test_no_plan_is_consulted_while_compiling(monkeypatch):
    """Under a torch.compile trace: the reference kernels, one graph, the plan unread."""
    plan = plan_of([], torch.float32, mode="blocked,f32-blocks")
    monkeypatch.setitem(kernels.ATTENTION, "blocked", no_timing)
    monkeypatch.setitem(kernels.LOGITS, "f32-blocks", no_timing)
    q, k, v = qkv(2, 2, 1, 40, 16, torch.float32)
    weight = torch.randn(100, 32)

    def step(q, k, v, hidden):
        return kernels.attention(q, k, v, plan=plan), kernels.logits(hidden, weight, plan)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    hidden = torch.randn(2, 1, 32)
    y, z = compiled(q, k, v, hidden)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(z, hidden @ weight.T)
    assert plan._memo == {}


def test_inference_mode_and_no_grad(tmp_path):
    """Timing and every implementation run under inference mode and under no_grad."""
    for ctx in (torch.inference_mode, torch.no_grad):
        (tmp_path / "kernels.json").unlink(missing_ok=True)
        with ctx():
            calls = [call("attention", *shape[1:], "none") for shape in SHAPES.values()]
            calls.append(call("logits", 500, 32, weight=torch.randn(500, 32).bfloat16()))
            plan = plan_of(calls, torch.bfloat16)
            for shape in SHAPES.values():
                q, k, v = qkv(*shape, torch.bfloat16)
                assert kernels.attention(q, k, v, plan=plan).dtype == torch.bfloat16
        # Both steps' shapes are over the text's keys: one class, and the projection's.
        assert len(entries(tmp_path / "kernels.json")) == len(SHAPES)


def test_plan_is_reported():
    plan = plan_of(
        [call("attention", 2, 1, 40, 16, "none"), call("attention", 2, 1, 1500, 16, "none")],
        torch.float32,
        mode="matmul",
    )
    threads = torch.get_num_threads()
    head = f"matmul (cpu, f32, {threads} threads, 0 of 2 classes timed now)"
    assert plan.summary() == f"{head}: attention matmul x2"
    report = plan.report()
    assert report["choices"] == {
        "attention/f32/decode/H2xT1xS1536xD16/none": "matmul",
        "attention/f32/decode/H2xT1xStextxD16/none": "matmul",
    }
    assert report["mode"] == "matmul" and report["dtype"] == "f32" and report["timed_now"] == 0
    json.dumps(report)


def test_cpu_model_is_named():
    assert kernels.cpu_model().strip()


# --- a model and its plan ------------------------------------------------------------


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from util import make_random_model, real_tokenizer

    root = tmp_path_factory.mktemp("random-model")
    return make_random_model(root / "m", real_tokenizer("tiny.en"), vocab_size=51864, d_model=32)


def run_forward(loaded) -> torch.Tensor:
    """An encoder pass, a prompt and one step: (B, V) logits of the step."""
    model = loaded.model
    torch.manual_seed(0)
    mel = torch.randn(2, loaded.config.num_mel_bins, 3000).to(model.dtype)
    with torch.inference_mode():
        audio = model.encoder(mel)
        caches = model.decoder.new_caches(audio, 16)
        tokens = torch.full((2, 3), loaded.tokenizer.special.sot)
        model.decoder(tokens, torch.arange(3), caches, Extent(3))
        return model.decoder(tokens[:, :1], torch.tensor([3]), caches, Extent(4))[:, 0]


def test_a_model_built_with_a_plan_runs_its_choices(random_dir, monkeypatch):
    """Every module that calls a kernel holds the model's plan, and runs what it names."""
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.model import Attention, Conv1d, Decoder, Linear

    monkeypatch.setenv("WHISPER_CLI_KERNELS", "blocked,f32-blocks,f32-upcast")
    loaded = load_model(str(random_dir), resolve_policy("bf16", "cpu"))
    model, plan = loaded.model, loaded.model.plan
    assert plan.mode == "blocked,f32-blocks,f32-upcast" and plan.dtype == torch.bfloat16
    holders = [m for m in model.modules() if isinstance(m, Attention | Conv1d | Decoder | Linear)]
    assert holders and all(m.plan is plan for m in holders)
    ran = set()
    for table, name in (
        (kernels.ATTENTION, "blocked"),
        (kernels.LOGITS, "f32-blocks"),
        (kernels.LINEAR, "f32-upcast"),
        (kernels.CONV1D, "f32-upcast"),
    ):
        real = table[name]
        monkeypatch.setitem(table, name, lambda *a, t=table, f=real: ran.add(id(t)) or f(*a))
    for table in (kernels.ATTENTION, kernels.LOGITS, kernels.LINEAR, kernels.CONV1D):
        reference = next(iter(table))
        monkeypatch.setitem(table, reference, no_timing)  # the reference must not run
    run_forward(loaded)
    assert len(ran) == 4


@pytest.mark.parametrize(
    ("dtype", "quantize"), [("f32", "none"), ("bf16", "none"), ("f32", "int8")]
)
def test_the_kernels_a_row_runs_do_not_depend_on_its_batch(
    random_dir, dtype, quantize, monkeypatch
):
    """Implementations round differently, so a row's text would depend on the rows that
    share its batch if a choice did. Each class's choice drawn at random (timings faked):
    a window's encoder pass, prompt and step run the same implementation call by call alone
    and beside two other windows (a layer's bound C product counted as one), and give that
    window the same logits, bit for bit."""
    import random

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model

    draw = random.Random(0)
    monkeypatch.setattr(
        kernels,
        "time_candidates",
        lambda runs, before=None: {n: (draw.random(), True) for n in runs},
    )
    loaded = load_model(str(random_dir), resolve_policy(dtype, "cpu", quantize))
    model = loaded.model
    assert model.plan.mode == "auto" and len(set(model.plan.choices.values())) >= 3
    # Each call as (implementation, its weight) or, for attention, (implementation, query
    # and key lengths); a set, as a batch's encoder runs in more row tiles.
    ran: set[tuple] = set()

    def site(a: tuple) -> object:
        return id(a[1]) if a[1].dim() != 4 else (a[0].shape[2], a[1].shape[2])

    tables = (kernels.ATTENTION, kernels.LOGITS, kernels.LINEAR, kernels.CONV1D)
    for table in (*tables, kernels.INT8_LINEAR):
        for name, real in list(table.items()):
            monkeypatch.setitem(
                table, name, lambda *a, n=name, f=real, **k: ran.add((n, site(a))) or f(*a, **k)
            )
    bound = kernels.BoundProduct.__call__

    def bound_spy(product: kernels.BoundProduct, x: torch.Tensor) -> torch.Tensor | None:
        out = bound(product, x)  # a layer's bound C product (None: its general path ran)
        if out is not None:
            ran.add(("bound", id(product)))
        return out

    monkeypatch.setattr(kernels.BoundProduct, "__call__", bound_spy)

    def step_logits(mel: torch.Tensor) -> tuple[torch.Tensor, set[tuple]]:
        ran.clear()
        with torch.inference_mode():
            caches = model.decoder.new_caches(model.encoder(mel), 16)
            tokens = torch.full((mel.shape[0], 3), loaded.tokenizer.special.sot)
            model.decoder(tokens, torch.arange(3), caches, Extent(3))
            step = model.decoder(tokens[:, :1], torch.tensor([3]), caches, Extent(4))[:, 0]
        return step, set(ran)

    torch.manual_seed(0)
    mel = torch.randn(3, loaded.config.num_mel_bins, 3000).to(model.dtype)
    alone, alone_ran = step_logits(mel[:1])
    batched, batched_ran = step_logits(mel)
    assert batched_ran == alone_ran and len({n for n, _ in alone_ran}) >= 3
    assert torch.equal(batched[:1], alone)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cross_keys_stored_by_column_on_cpu_in_f32_only(random_dir, dtype):
    """f32 on CPU: every layer's cross keys are (B, H, D, S) storage seen as (B, H, S, D);
    row drops keep that layout; the step's logits are those of keys by rows. bf16: rows
    (its SDPA over rows is fastest)."""
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.model import DecodeCaches, KVCache, cross_keys_transposed

    loaded = load_model(str(random_dir), resolve_policy(dtype, "cpu"))
    model = loaded.model
    transposed = dtype == "f32"
    assert cross_keys_transposed(model.dtype, model.device) is transposed
    with torch.inference_mode():
        audio = model.encoder(torch.randn(3, loaded.config.num_mel_bins, 3000).to(model.dtype))
        caches = model.decoder.new_caches(audio, 16)
        kept = caches.select(torch.tensor([2, 0]))
        for cache, part in zip(caches.cross, kept.cross, strict=True):
            for k in (cache.k, part.k):
                assert (k.stride(-2) == 1) is transposed and k.shape[-2] == 1500
            assert torch.equal(part.k, cache.k[[2, 0]]) and torch.equal(part.v, cache.v[[2, 0]])
        tokens = torch.full((3, 1), loaded.tokenizer.special.sot)

        def step(caches):
            return model.decoder(tokens, torch.tensor([0]), caches, Extent(1))

        by_rows = DecodeCaches(
            [KVCache(c.k.clone(), c.v.clone()) for c in caches.self_attn],
            [KVCache(c.k.contiguous(), c.v) for c in caches.cross],
        )
        torch.testing.assert_close(step(caches), step(by_rows), rtol=1e-5, atol=1e-5)


def test_forward_times_reads_and_writes_nothing(random_dir, tmp_path, monkeypatch):
    """Auto mode: the plan is timed at load; then the cache is made unreadable and any
    timing, read or write fails, and a forward pass runs as before."""
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.options import TranscribeOptions

    options = TranscribeOptions(batch_size=2)
    loaded = load_model(str(random_dir), resolve_policy("bf16", "cpu"), options)
    plan = loaded.model.plan
    assert plan.mode == "auto" and plan.timed == set(plan.choices)  # bf16: none alone
    want = run_forward(loaded)
    (tmp_path / "kernels.json").chmod(0)
    tmp_path.chmod(0)
    try:
        for name in ("time_candidates", "_read", "_write"):
            monkeypatch.setattr(kernels, name, no_timing)
        monkeypatch.setattr(kernels.Path, "read_text", no_timing)
        torch.testing.assert_close(run_forward(loaded), want, rtol=0, atol=0)
    finally:
        tmp_path.chmod(0o700)
        (tmp_path / "kernels.json").chmod(0o600)


# --- a real model ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["f32-upcast,blocked,f32-blocks", "packed", "f32-packed"])
def test_chosen_kernels_keep_a_real_bf16_model_as_exact_as_the_reference(monkeypatch, mode):
    """tiny.en in bf16, teacher-forced over JFK's words: the upcast GEMMs and
    convolutions, blocked attention and f32-blocks projection, or oneDNN's packed GEMMs in
    bf16 or over f32 copies (forced, so no timing decides) against torch's own bf16
    kernels, both measured against the f32 model; and the packed GEMMs in f32 against
    torch's f32 ones."""
    from util import real_model, shared_clip

    from whisper_cli.audio import load_audio
    from whisper_cli.dtypes import encoder_input, resolve_policy
    from whisper_cli.features import batch_log_mel
    from whisper_cli.loading import load_model

    audio = load_audio(shared_clip("jfk.flac"))

    def logits(dtype_name: str, mode: str) -> torch.Tensor:
        monkeypatch.setenv("WHISPER_CLI_KERNELS", mode)
        loaded = load_model(str(real_model("tiny.en")), resolve_policy(dtype_name, "cpu"))
        model, tok = loaded.model, loaded.tokenizer
        text = " And so my fellow Americans, ask not what your country can do for you,"
        text += " ask what you can do for your country."
        tokens = tok.prompt("en", "transcribe", False) + tok.encode_text(text)
        tokens = torch.tensor([tokens])  # (1, T)
        t = tokens.shape[1]
        with torch.inference_mode():
            mel = batch_log_mel([audio], 1, loaded.config.num_mel_bins, torch.device("cpu"))
            features = model.encoder(encoder_input(mel, model.dtype))
            caches = model.decoder.new_caches(features, t)
            out = model.decoder(tokens, torch.arange(t), caches, Extent(t))[0]  # (T, V)
        assert out.dtype == model.dtype
        return out.double()

    half = mode != "packed" or kernels.packable(torch.bfloat16)  # bf16 packed runs here
    single = mode == "packed" and kernels.packable(torch.float32)  # f32 packed runs here
    if (mode == "f32-packed" and not kernels.packable(torch.float32)) or not (half or single):
        pytest.skip("oneDNN packs none of these weights on this CPU")
    f32 = logits("f32", "reference")

    def err(x):
        return ((x - f32).norm() / f32.norm()).item()

    def agree(x):
        return (x.argmax(-1) == f32.argmax(-1)).float().mean().item()

    if half:
        forced = logits("bf16", mode)
        plain = logits("bf16", "reference")
        # Where torch's bf16 GEMMs accumulate in float32 too (avx512_bf16, AMX), both sit
        # at bf16's rounding floor and which is lower is a matter of rounding: 1.10x on an
        # Intel Xeon with AMX (0.0090 against 0.0082). A kernel that lost precision would
        # be far off.
        assert err(forced) <= 1.25 * err(plain)
        assert agree(forced) >= agree(plain) - 1 / f32.shape[0]  # at most one token apart
    if single:  # f32: the same products summed in another order (measured 9e-7)
        packed = logits("f32", "packed")
        assert 0 < err(packed) < 1e-5 and agree(packed) == 1.0  # 0: packed never ran


# --- int8 linear layers ------------------------------------------------------------------


def int8_layer(n=80, k=96, seed=9):
    from whisper_cli.dtypes import int8_weight

    g = torch.Generator().manual_seed(seed)
    weight, scale = int8_weight(torch.randn(n, k, generator=g) * 0.05)
    return weight, scale, torch.randn(n, generator=g) * 0.1


def test_int8_weight_is_per_channel_symmetric_with_bf16_scales():
    from whisper_cli.dtypes import int8_weight

    g = torch.Generator().manual_seed(10)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0
    q, scale = int8_weight(w.half())
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert q.abs().max() <= 127 and q[5].abs().max() == 0 and scale[5] == 1
    assert torch.equal(scale, scale.bfloat16().float())  # each a bfloat16 value
    # Within half a step, or one step where the row's extreme clamped at 127.
    assert ((q.float() * scale[:, None] - w.half().float()).abs() <= scale[:, None]).all()
    assert (q.abs().amax(dim=1)[torch.arange(64) != 5] >= 126).all()  # the range is used


def test_int8_weight_leaves_a_float32_source_as_it_was():
    """Its float32 rows are the source's own memory (.float() copies nothing): a float32
    checkpoint's token embedding, the model's too, must come out unchanged."""
    from whisper_cli.dtypes import int8_weight

    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(12))
    before = w.clone()
    int8_weight(w)
    assert torch.equal(w, before)


@pytest.mark.parametrize("lead", [(16, 1), (2, 300)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_int8_linear_matches_float64(dtype, lead):
    """Against x (q * s)^T + b in float64: weight-only kernels as close as the dtype's own
    rounding allows, kernels that quantize activations per row within a few percent, also
    where rows differ in range by 1000x (one scale per call would lose the small rows)."""
    weight, scale, bias = int8_layer()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(*lead, 96, generator=g) * torch.logspace(-2, 1, lead[-1])[:, None]
    x = x.to(dtype)
    b = bias.to(dtype)
    ref = F.linear(x.double(), weight.double() * scale.double()[:, None], b.double())
    for name in kernels.int8_candidates(dtype):
        form = kernels.int8_form(name, weight, scale)
        for bb in (b, None):
            out = kernels.INT8_LINEAR[name](x, weight, scale, bb, form)
            assert out.dtype == dtype and out.shape == (*lead, 80), name
        out = kernels.INT8_LINEAR[name](x, weight, scale, b, form)
        # Row by row: a small row's error is its own, not the large rows'.
        err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        bound = {"dequant": 1e-6, "widened": 1e-6, "weight-only": 0.01}.get(name, 0.05)
        if dtype == torch.bfloat16:
            bound = max(bound, 0.01)
        assert err <= bound, (name, err)


def gelu_rows(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the encoder's fc2 takes them (after a GELU: each row's largest magnitude is
    positive, its most negative value small), ranges 1000x apart."""
    g = torch.Generator().manual_seed(seed)
    x = F.gelu(torch.randn(m, k, generator=g)) * torch.logspace(-2, 1, m)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_int8_linear_computes_every_row_on_its_own(dtype):
    """A quantizing kernel's row does not depend on the other rows of its call: a call
    equals its two halves, bit for bit, also where one half holds only rows of one sign (a
    grid taken from the call's min and max would then differ between the halves and the
    whole). The reference ("dequant") quantizes nothing: its rows are its BLAS's, which may
    sum a row otherwise in another count of rows (MKL's f32 GEMM held to AVX2 does here),
    so the plan checks that where rows share a call (text tokens, _rows_alike) and audio
    frames run a window at a time (model.window_parts)."""
    weight, scale, bias = int8_layer(n=80, k=96)
    x = gelu_rows(600, 96, 13, dtype)
    x[300:] = -x[300:]  # the second half's rows reach their largest magnitude below zero
    b = bias.to(dtype)
    quantizing = [n for n in kernels.int8_candidates(dtype) if n != "dequant"]
    assert quantizing
    for name in quantizing:
        run, form = kernels.INT8_LINEAR[name], kernels.int8_form(name, weight, scale)
        whole = run(x, weight, scale, b, form)
        halves = [run(x[r : r + 300], weight, scale, b, form) for r in (0, 300)]
        assert torch.equal(whole, torch.cat(halves)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_linear_runs_many_rows_in_tiles(dtype, monkeypatch):
    """A call of many rows (2 windows of 1500 rows, and 513 rows) hands each kernel at
    most INT8_TILE_ROWS rows at a time, in x's dtype, with a plan and without: its result
    is the kernel's over each of row_tiles' tiles alone, bit for bit, and for a quantizing
    kernel (rows on their own) the untiled call's too; the reference's BLAS may round a
    tile's rows otherwise than the whole call's (see the test above), so there within
    the dtype's tolerance."""
    weight, scale, bias = int8_layer(n=80, k=96)
    b = bias.to(dtype)
    seen: list[int] = []

    def recording(kernel):
        def run(x, *args, **kwargs):
            seen.append(x.numel() // x.shape[-1])
            return kernel(x, *args, **kwargs)

        return run

    names = kernels.int8_candidates(dtype)
    for name in kernels.QUANTIZING & set(names):
        kernels.activation_grid(name)  # probed once a process, before the calls are counted
    for name in names:
        monkeypatch.setitem(kernels.INT8_LINEAR, name, recording(kernels.INT8_LINEAR[name]))
    plans = {
        name: plan_of([call("int8-linear", 80, 96, "frames")], dtype, mode=name) for name in names
    }
    for lead in ((2, 1500), (513,)):
        x = gelu_rows(math.prod(lead), 96, 14, dtype).view(*lead, 96)
        x[..., ::2, :] *= -1
        m = x.numel() // 96
        for name, plan in [*plans.items(), ("dequant", None)]:
            seen.clear()
            form = kernels.int8_form(name, weight, scale)
            untiled = kernels.INT8_LINEAR[name](x, weight, scale, b, form)
            assert seen == [m]
            rows = x.reshape(m, 96)
            tiles = [
                kernels.INT8_LINEAR[name](rows[part], weight, scale, b, form)
                for part in kernels.row_tiles(m, kernels.INT8_TILE_ROWS)
            ]
            seen.clear()
            out = kernels.int8_linear(x, weight, scale, b, plan, rows="frames")
            assert out.dtype == dtype and out.shape == untiled.shape
            assert torch.equal(out.view(m, -1), torch.cat(tiles)), (name, lead)
            if name == "dequant":
                torch.testing.assert_close(out, untiled)  # the dtype's default tolerance
            else:
                assert torch.equal(out, untiled), (name, lead)
            assert sum(seen) == m and max(seen) <= kernels.INT8_TILE_ROWS, (name, seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_float_passes_in_c_give_torchs_bytes(dtype, monkeypatch):
    """The C passes around an int8 GEMM (csrc/int8.c: unit rows, their uint8 grid, the
    rescale) give what torch's elementwise chain gives, byte for byte: on an all-zero row,
    on values that land on a grid point's half (round half to even), on rows with a
    stride of their own, with a bias and without; and so does each int8 kernel, whole."""
    native_built()
    g = torch.Generator().manual_seed(15)
    x = torch.randn(40, 768, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    x[3] = 0.0
    x[7] = 0.0  # max |x| 63: (x / 63) * 63 lands on x, here halves between grid points
    x[7, :126], x[7, 126] = torch.arange(-63, 63) + 0.5, 63.0
    x = x.to(dtype)
    on_grid = (x[7].float() / 63) * 63
    assert (on_grid - on_grid.floor() == 0.5).sum() > 100
    acc = torch.randn(40, 80, generator=g) * 1000
    amax = torch.rand(40, 1, generator=g)
    weight, scale, bias = int8_layer(n=80, k=768)
    b = bias.to(dtype)

    def runs() -> list[torch.Tensor]:
        narrow = kernels._quantized_rows(x[:, :700], kernels.NARROW_GRID)
        out = [*kernels._unit_rows(x[:, :700]), *narrow]
        for bb in (b, None):
            out.append(kernels._rescale(acc.clone(), amax, bb, x, 80, None))
            out.append(kernels._rescale(acc.clone(), amax, bb, x, 80, torch.empty_like(out[-1])))
        for name in ("fbgemm", "onednn"):
            if name in kernels.int8_candidates(dtype):
                form = kernels.int8_form(name, weight, scale)
                out.append(kernels.INT8_LINEAR[name](x, weight, scale, b, form))
        return [*out, *kernels._quantized_rows(x[:, :700], kernels.WIDE_GRID)]

    lib, called = kernels._native(), set()

    class Spy:  # the library, noting which of its functions were called
        def __getattr__(self, name):
            called.add(name)
            return getattr(lib, name)

    monkeypatch.setattr(kernels, "_native", Spy)
    in_c = runs()
    passes = (*native.INT8_ROW_PASSES, native.INT8_RESCALE)
    assert called == {f"{p}_{dtype_name(dtype)}" for p in passes}
    monkeypatch.setattr(kernels, "_native", lambda: None)
    in_torch = runs()
    assert in_c[1][3] == 1 and in_c[2].dtype == torch.uint8 and in_c[4].dtype == dtype
    for i, (c, t) in enumerate(zip(in_c, in_torch, strict=True)):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_c_grid_is_the_one_kernels_py_names(dtype, monkeypatch):
    """The activations' grid is decided once, in kernels.py: the C pass quantizes on the
    steps and zero it is given, as torch's chain does, not on values of its own."""
    native_built()
    x = (torch.randn(8, 96, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    narrow = kernels._quantized_rows(x, kernels.NARROW_GRID)[0]
    assert int(narrow.min()) == 1 and int(narrow.max()) == 127  # 63 steps around 64
    wide = kernels._quantized_rows(x, kernels.WIDE_GRID)[0]
    assert int(wide.min()) == 1 and int(wide.max()) == 255  # 127 steps around 128
    q_c, amax_c = kernels._quantized_rows(x, kernels.Grid(15, 100))
    monkeypatch.setattr(kernels, "_native", lambda: None)
    q_torch, amax_torch = kernels._quantized_rows(x, kernels.Grid(15, 100))
    assert int(q_c.min()) == 85 and int(q_c.max()) == 115  # each row's extreme: zero -+ 15
    assert torch.equal(q_c, q_torch) and torch.equal(amax_c, amax_torch)


def _cpu_flags() -> set[str] | None:
    """This CPU's flags where Linux lists them (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    flags = next((line for line in lines if line.startswith("flags")), None)
    return None if flags is None else set(flags.split(":", 1)[1].split())


def _activation_kernels() -> list[str]:
    names = ("fbgemm", "onednn", "dot")
    return [n for n in names if n in kernels.int8_candidates(torch.float32)]


def _grid_worst_case(name: str, grid) -> tuple[torch.Tensor, torch.Tensor]:
    """`name`'s result on `grid` for rows at the grid's ends against weights of +-127
    (where a pair sum of u8 x s8 products overflows int16 on the wide grid), and the
    exact sums."""
    k = 128
    x = torch.stack([torch.ones(k), -torch.ones(k)])
    weight = torch.stack([torch.full((k,), 127), torch.full((k,), -127)]).to(torch.int8)
    scale = torch.ones(2)
    form = kernels.int8_form(name, weight, scale)
    got = kernels.INT8_LINEAR[name](x, weight, scale, None, form, grid=grid)
    return got, x @ weight.float().T


def test_the_activation_grid_is_wide_only_where_the_int8_gemm_sums_exactly():
    """activation_grid's probe: each kernel that quantizes activations gets the grid on
    which it computes the worst case exactly (to the grid's own rounding of 1 / steps);
    where that grid is the narrow one, the wide one really misses it (the kernel
    saturates), and where it is the wide one, the error on random rows with outliers is
    about half the narrow grid's. On x86 the probe agrees with the instruction set: no
    VNNI, narrow; AVX-512 VNNI (fbgemm and oneDNN both have kernels for it), wide."""
    names = _activation_kernels()
    if not names:
        pytest.skip("this torch has neither fbgemm nor oneDNN int8 kernels")
    flags = _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else None
    if any(os.environ.get(limit) for limit in kernels.ISA_LIMITS):
        flags = None  # oneDNN or MKL held below the CPU: its flags do not say what they run
    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 384, generator=g)
    x[:, 5] *= 30  # an outlier column, as Whisper's activations have
    weight, scale, bias = int8_layer(n=256, k=384)
    ref = kernels._int8_dequant(x, weight, scale, bias)
    for name in names:
        grid = kernels.activation_grid(name)
        got, exact = _grid_worst_case(name, grid)
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=0)
        form = kernels.int8_form(name, weight, scale)
        errors = {
            g.steps: (kernels.INT8_LINEAR[name](x, weight, scale, bias, form, grid=g) - ref)
            .norm()
            .item()
            for g in (kernels.NARROW_GRID, kernels.WIDE_GRID)
        }
        if grid == kernels.NARROW_GRID:
            wide, _ = _grid_worst_case(name, kernels.WIDE_GRID)
            assert not torch.allclose(wide, exact, rtol=1e-3), name
        else:
            assert grid == kernels.WIDE_GRID
            assert errors[127] < 0.6 * errors[63], (name, errors)
        if flags is not None and not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
            assert grid == kernels.NARROW_GRID, name
        if flags is not None and "avx512_vnni" in flags:
            assert grid == kernels.WIDE_GRID, name


# Each library's own variable holding its int8 GEMM to AVX2.
AVX2_LIMITS = {
    "onednn": {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "fbgemm": {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
}


@pytest.mark.parametrize("name", sorted(AVX2_LIMITS))
def test_the_probe_finds_a_saturating_int8_gemm(name):
    """oneDNN or fbgemm held to AVX2 (by its own variable, in a process of its own) sums
    u8 x s8 pairs in int16, as a CPU without VNNI does: the probe gives the narrow grid."""
    if platform.machine() not in ("x86_64", "AMD64") or name not in _activation_kernels():
        pytest.skip(f"{name}'s x86 kernels are what this holds to AVX2")
    code = f"from whisper_cli import kernels; print(kernels.activation_grid({name!r}).steps)"
    env = {**os.environ, **AVX2_LIMITS[name]}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(kernels.NARROW_GRID.steps)]


def test_the_plan_key_names_each_librarys_limit(monkeypatch):
    """A plan timed with fbgemm (or oneDNN, MKL) held to AVX2 is kept apart from one timed
    without: their int8 kernels differ in speed and in grid."""
    for name in kernels.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    free = kernels._machine()
    for name in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.setenv(name, "AVX2")
        assert f"|{name}=AVX2|" in kernels._machine() and f"{name}=" not in free
        monkeypatch.delenv(name)
    assert kernels._machine() == free


def _native_library(where: Path, extra: tuple[str, ...]):
    """The library built as native.py builds it, `extra` after each source's flags."""
    cc, name = native.compiler(), "native" + "".join(extra)
    objs = [where / f"{name}-{source.stem}.o" for source in native.SOURCES]
    lib = where / f"{name}.so"
    cmds = [
        [cc, *flags, *extra, "-o", str(obj), str(source)]
        for obj, (source, flags) in zip(objs, native.SOURCES.items(), strict=True)
    ]
    for cmd in [*cmds, [cc, *native.LINK_FLAGS, "-o", str(lib), *map(str, objs), *native.LIBS]]:
        subprocess.run(cmd, check=True, capture_output=True, timeout=native.BUILD_TIMEOUT_S)
    return native.declare(ctypes.CDLL(str(lib)))


VECTOR_BUILDS = [(), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")]


@pytest.fixture(scope="module")
def vector_builds(tmp_path_factory):
    """The library built for each vector path of csrc/matmul.c's products (AVX-512 where
    this CPU has it, AVX2, plain C), once for the module."""
    native_built()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the vector paths are x86's")
    where = tmp_path_factory.mktemp("native")
    return [_native_library(where, extra) for extra in VECTOR_BUILDS]


def _int8_product(dtype):
    """csrc/matmul.c's int8 product as "widened" calls it, its product's name, and the
    float64 weight it stands for."""
    weight, scale, _ = int8_layer(n=83, k=37, seed=21)
    prepared = kernels.int8_form("widened", weight, scale)

    def run(x, bias, out):
        kernels.INT8_LINEAR["widened"](x, weight, scale, bias, prepared, out)

    w = weight.double() * scale.double()[:, None]
    return run, native.INT8_MATMUL, lambda x, bias: F.linear(x.double(), w, bias)


def _float_product(dtype):
    """csrc/matmul.c's float product as "columns" calls it (its packing of a weight in
    `dtype`), its product's name, and the weight in float64."""
    g = torch.Generator().manual_seed(23)
    weight = (torch.randn(83, 37, generator=g) * 0.1).to(dtype)
    packed = kernels._by_columns(weight.float(), kernels._native())

    def run(x, bias, out):
        out.copy_(kernels.LINEAR["columns"](x, weight, bias, packed))

    return run, native.FLOAT_MATMUL, lambda x, bias: F.linear(x.double(), weight.double(), bias)


def _dot_product(dtype):
    """csrc/dot.c's product as "dot" calls it on the narrow grid (where AVX2's pair sums
    cannot saturate, so every path sums the same integers exactly), its product's name,
    and the float64 product of the rows as that grid quantizes them."""
    weight, scale, _ = int8_layer(n=83, k=37, seed=21)  # K not a multiple of 4
    prepared, grid = kernels.int8_form("dot", weight, scale), kernels.NARROW_GRID

    def run(x, bias, out):
        kernels.INT8_LINEAR["dot"](x, weight, scale, bias, prepared, out, grid)

    def want(x, bias):
        q, amax = kernels._quantized_rows(x, grid)
        exact = (q.double() - grid.zero) @ weight.double().T  # the integer sums
        out = exact * scale.double() * (amax.double() / grid.steps)
        return out if bias is None else out + bias

    return run, native.INT8_DOT, want


@pytest.mark.parametrize(
    "product", [_int8_product, _float_product, _dot_product], ids=["int8", "float", "dot"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_columns_product_is_the_same_on_every_vector_path(
    product, dtype, vector_builds, monkeypatch
):
    """csrc/matmul.c's products (int8_matmul_*, float_matmul_*) and csrc/dot.c's
    (int8_dot_*) take AVX-512 (VNNI for dot), AVX2 or plain C by what they are built for:
    each gives the same bytes (the same multiply-adds in the same order; dot's exact
    integer sums), as close to the float64 product as the float32 sums (f32) or the one
    rounding to the dtype (bf16) allow; on rows with a stride of their own, into an
    output with one (its columns past N untouched, int8), N not a multiple of the
    packing's columns, with a bias and without, and 1 to 17 rows (every count a tile of
    16, 6 or 4 rows can leave)."""
    run, name, want_of = product(dtype)
    bias = (torch.randn(83, generator=torch.Generator().manual_seed(24)) * 0.1).to(dtype)
    g = torch.Generator().manual_seed(22)
    wide = torch.randn(17, 40, generator=g) * torch.logspace(-2, 1, 17)[:, None]
    x = wide.to(dtype)[:, :37]  # rows 40 apart
    assert x.stride() == (40, 1)
    results = []
    for extra, lib in zip(VECTOR_BUILDS, vector_builds, strict=True):
        called = []

        class Spy:  # the build, noting the calls of its products
            def __getattr__(self, attr, lib=lib, called=called):
                called.append(attr)
                return getattr(lib, attr)

        monkeypatch.setattr(kernels, "_native", Spy)
        outs = []
        for m in range(1, 18):
            for b in (bias, None):
                out = torch.full((m, 90), 7.0, dtype=dtype)
                run(x[:m], b, out[:, :83])
                assert (out[:, 83:] == 7.0).all(), (extra, m)
                outs.append(out[:, :83])
                want = want_of(x[:m], None if b is None else b.double())
                err = ((out[:, :83].double() - want).norm(dim=-1) / want.norm(dim=-1)).max()
                assert err <= (1e-6 if dtype == torch.float32 else 4e-3), (extra, m, err)
        products = [c for c in called if c.startswith(name)]  # dot also quantizes rows
        assert products == [f"{name}_{dtype_name(dtype)}"] * 34, extra
        results.append(outs)
    for extra, outs in zip(VECTOR_BUILDS[1:], results[1:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(results[0], outs, strict=True)), extra


def test_a_decode_steps_inner_int8_layers_keep_their_activations():
    """Layers over text tokens are offered no kernel that quantizes their rows (their
    errors would pass through every later layer); the output projection ("vocab") and the
    encoder's frames are offered every one, and so is a call whose rows are not named."""
    for dtype in (torch.float32, torch.bfloat16):
        every = kernels.int8_candidates(dtype)
        assert kernels.QUANTIZING & set(every), dtype  # fbgemm or oneDNN in any torch here
        inner = kernels.int8_candidates(dtype, "tokens")
        assert "dequant" in inner and not kernels.QUANTIZING & set(inner), dtype
        assert set(inner) == set(every) - kernels.QUANTIZING
        for rows in ("vocab", "frames"):
            assert kernels.int8_candidates(dtype, rows) == every, (dtype, rows)
    assert kernels.GEMM_ROWS["vocab"] == kernels.GEMM_ROWS["tokens"]


def test_int8_choices_are_timed_and_saved_and_the_reference_runs_while_compiling(
    tmp_path, monkeypatch
):
    weight, scale, bias = int8_layer()
    plan = plan_of([call("int8-linear", 80, 96, "tokens", weight=weight)], torch.bfloat16)
    saved = entries(tmp_path / "kernels.json")
    (key, entry), *more = saved.items()
    assert not more and key.endswith("int8-linear/bf16/N80xK96/tokens")
    assert set(entry["ms"]) == set(kernels.int8_candidates(torch.bfloat16, "tokens"))
    assert plan.choices == {"int8-linear/bf16/N80xK96/tokens": entry["choice"]}
    x = torch.randn(5, 1, 96).bfloat16()
    out = kernels.int8_linear(x, weight, scale, bias.bfloat16(), plan)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 1, 80)
    assert plan.choice("int8-linear", torch.bfloat16, 80, 96, "tokens") == entry["choice"]
    compiled = torch.compile(kernels.int8_linear, backend="eager", fullgraph=True)
    x32 = torch.randn(3, 96)
    want = kernels.INT8_LINEAR["dequant"](x32, weight, scale, bias)
    torch.testing.assert_close(compiled(x32, weight, scale, bias, plan), want)


# --- f32 copies of half weights ------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_f32_upcast_keeps_one_copy_per_weight_and_equals_the_per_call_upcast(dtype):
    """The kept float32 copies are the half values exactly: bit for bit the per-call
    conversion's results. One copy per weight, made at the first call, dropped with it; a
    timing run leaves none."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 7, 96, generator=g).to(dtype)
    weight, bias = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80).to(dtype)
    per_call = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
    assert torch.equal(kernels.LINEAR["f32-upcast"](x, weight, bias), per_call)
    copy = kernels._DERIVED[(id(weight), "f32")][2][0]
    assert torch.equal(kernels.LINEAR["f32-upcast"](x, weight, bias), per_call)
    assert kernels._DERIVED[(id(weight), "f32")][2][0] is copy and copy.dtype == torch.float32
    mel, conv = torch.randn(1, 8, 40, generator=g).to(dtype), torch.randn(16, 8, 3).to(dtype)
    want = F.conv1d(mel.float(), conv.float(), None, 2, 1).to(dtype)
    assert torch.equal(kernels.CONV1D["f32-upcast"](mel, conv, None, 2, 1), want)
    key = id(weight)
    del weight, copy
    assert (key, "f32") not in kernels._DERIVED
    other = torch.randn(48, 32).to(dtype)
    for fn in kernels._linear_fns(("linear", "f32-upcast"), dtype, other).values():
        fn(torch.randn(8, 32).to(dtype))
    for run in kernels._conv1d_runs(("conv", "f32-upcast"), 64, conv, 2, 1).values():
        run()
    assert (id(other), "f32") not in kernels._DERIVED and (id(conv), "f32") in kernels._DERIVED


@pytest.mark.slow
def test_kept_f32_copies_give_a_real_bf16_model_the_per_call_upcast_logits(monkeypatch):
    """tiny.en in bf16 with the upcast kernels forced, teacher-forced over JFK: the same
    logits, bit for bit, with the kept copies as with a conversion on every call."""
    from util import real_model, shared_clip

    from whisper_cli.audio import load_audio
    from whisper_cli.dtypes import encoder_input, resolve_policy
    from whisper_cli.features import batch_log_mel
    from whisper_cli.loading import load_model

    monkeypatch.setenv("WHISPER_CLI_KERNELS", "f32-upcast,blocked,f32-blocks")
    loaded = load_model(str(real_model("tiny.en")), resolve_policy("bf16", "cpu"))
    model, tok = loaded.model, loaded.tokenizer
    audio = load_audio(shared_clip("jfk.flac"))
    text = " And so my fellow Americans, ask not what your country can do for you,"
    tokens = torch.tensor([tok.prompt("en", "transcribe", False) + tok.encode_text(text)])
    t = tokens.shape[1]

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            mel = batch_log_mel([audio], 1, loaded.config.num_mel_bins, torch.device("cpu"))
            features = model.encoder(encoder_input(mel, model.dtype))
            caches = model.decoder.new_caches(features, t)
            return model.decoder(tokens, torch.arange(t), caches, Extent(t))

    kept = logits()
    assert any(kind == "f32" for _, kind in kernels._DERIVED)
    per_call = lambda weight, bias: (weight.float(), None if bias is None else bias.float())  # noqa: E731
    monkeypatch.setattr(kernels, "_f32_copies", per_call)
    assert torch.equal(logits(), kept)


def test_a_run_within_the_reach_stays_in_its_plan(monkeypatch):
    """Every call of a transcription with the options the model was loaded for (a batch,
    word timestamps) finds its shape class in the plan: none is decided at the call. (The
    reference mode: a miss would be decided as a hit is, so only the lookup tells.)"""
    from util import real_model, shared_clip

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.options import TranscribeOptions
    from whisper_cli.pipeline import Transcriber

    monkeypatch.setenv("WHISPER_CLI_KERNELS", "reference")
    options = TranscribeOptions(batch_size=2, word_timestamps=True)
    loaded = load_model(str(real_model("tiny.en")), resolve_policy("f32", "cpu"), options)
    missed = []
    monkeypatch.setattr(kernels, "_untimed", lambda mode, cands: missed.append(cands) or cands[0])
    result = Transcriber(loaded, options).transcribe(str(shared_clip("jfk.flac")))
    assert any(s.words for s in result.segments)  # the alignment pass ran
    calls = loaded.model.plan._memo  # every call shape the run made
    assert len(calls) > 20 and missed == []

    # Loaded for runs without an initial prompt: a long one falls outside the plan.
    plain = TranscribeOptions(batch_size=2)
    narrow = load_model(str(real_model("tiny.en")), resolve_policy("f32", "cpu"), plain)
    missed.clear()  # the build decides its reference choices by the same function
    prompted = TranscribeOptions(batch_size=2, initial_prompt=" ".join(["Americans"] * 100))
    Transcriber(narrow, prompted).transcribe(str(shared_clip("jfk.flac")))
    assert missed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("quantized", [False, True], ids=["columns", "int8-widened"])
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no-bias"])
def test_a_layer_runs_its_bound_product_and_gets_the_general_paths_bytes(
    dtype, quantized, biased, monkeypatch
):
    """A layer whose plan chooses a C column product ("columns", int8 "widened") runs it
    bound (kernels.BoundProduct): the general path's bytes at 0 to 17 rows, with and
    without the token axis and as one (K,) row, the general path never called; rows that
    are not contiguous, int8 calls of more rows than INT8_TILE_ROWS (tiled there), and a
    plan choosing another implementation, run the general path; a new plan, an in-place
    change of the weight or another bias tensor binds again; rows of another K get the
    general path's error."""
    from whisper_cli.dtypes import DtypePolicy
    from whisper_cli.model import Linear
    from whisper_cli.quantize import int8_linear, prepare_forms

    native_built()
    n, k = 83, 37
    g = torch.Generator().manual_seed(31)
    source = torch.randn(n, k, generator=g) * 0.1
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype) if biased else None
    if quantized:
        layer = int8_linear(source, bias, DtypePolicy(dtype, torch.device("cpu"), "int8"))
        op, impl, general = "int8-linear", "widened", "int8_linear"
    else:
        layer = Linear(k, n, bias=biased).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(source.to(dtype))
            if biased:
                layer.bias.copy_(bias)
        op, impl, general = "linear", "columns", "linear"
    real = getattr(kernels, general)

    def use(mode: str) -> kernels.KernelPlan:
        monkeypatch.setenv("WHISPER_CLI_KERNELS", mode)
        calls = [call(op, n, k, "tokens", weight=layer.weight)]
        layer.plan = plan_of(calls, dtype)
        if quantized:  # the forms of the plan's choice, as a load gives them
            prepare_forms(torch.nn.Sequential(layer), layer.plan, calls)
        return layer.plan

    def general_path(x: torch.Tensor) -> torch.Tensor:
        if quantized:
            return real(x, layer.weight, layer.weight_scale, layer.bias, layer.plan, layer.forms)
        return real(x, layer.weight, layer.bias, layer.plan)

    plan = use(impl)
    assert plan.choices == {f"{op}/{dtype_name(dtype)}/N{n}xK{k}/tokens": impl}
    xs = torch.randn(17, 1, k, generator=g).to(dtype)
    want = {m: general_path(xs[:m]) for m in range(18)}
    called = []
    monkeypatch.setattr(kernels, general, lambda *a, **kw: called.append(1) or real(*a, **kw))
    with torch.inference_mode():
        for m in range(18):
            out = layer(xs[:m])
            assert out.dtype == dtype and out.shape == (m, 1, n), m
            assert torch.equal(out, want[m]) and torch.equal(layer(xs[:m, 0]), want[m][:, 0]), m
        assert torch.equal(layer(xs[0, 0]), want[1][0, 0])
    assert called == []

    strided = torch.randn(5, 2 * k, generator=g).to(dtype)[:, ::2]
    assert torch.equal(layer(strided), general_path(strided.contiguous()))
    assert called == [1]
    tall = torch.randn(kernels.INT8_TILE_ROWS + 1, k, generator=g).to(dtype)
    assert torch.equal(layer(tall), general_path(tall))
    assert called == ([1, 1] if quantized else [1])  # int8: tiled by the general path
    called.clear()

    use("reference")  # a new plan, choosing the reference: nothing bound
    assert torch.equal(layer(xs[:4]), general_path(xs[:4]))
    assert called == [1]

    use(impl)
    assert torch.equal(layer(xs[:4]), want[4]) and called == [1]
    with torch.no_grad():  # the weight changed in place: bound to it again (its version)
        layer.weight.mul_(-1)
    if quantized:  # its forms are the plan's: made again with a new plan, which rebinds
        use(impl)
    out = layer(xs[:4])
    assert called == [1]
    assert torch.equal(out, general_path(xs[:4])) and not torch.equal(out, want[4])

    new_bias = (torch.randn(n, generator=g) * 0.1).to(dtype)  # another bias tensor: bound to it
    layer.bias = new_bias if quantized else torch.nn.Parameter(new_bias, requires_grad=False)
    before, out = out, layer(xs[:4])
    assert called == [1]
    assert torch.equal(out, general_path(xs[:4])) and not torch.equal(out, before)
    with pytest.raises(RuntimeError):  # rows of another K: the general path's error
        layer(torch.randn(2, k + 1).to(dtype))
    assert called == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("quantized", [False, True], ids=["columns", "int8-widened"])
def test_the_plan_times_a_c_column_product_bound_as_a_layer_runs_it(dtype, quantized, monkeypatch):
    """The timing's "columns" (int8 "widened") candidate is the bound product a layer
    runs once its plan chooses it (kernels.BoundProduct), not the general path's Python
    around the same C call: the bound call, with the general path's bytes, for the rows
    it takes; the general path for rows it does not (not contiguous; int8, more than
    INT8_TILE_ROWS). The other candidate runs its own kernel, unbound. (The functions
    as kernels.OPS gives them to the timing.)"""
    from whisper_cli.dtypes import int8_weight

    native_built()
    n, k = 83, 37
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    if quantized:
        weight, _ = int8_weight(weight.float())
        unit = torch.full((n,), 1 / 127)  # the timing's scales
        form = kernels.int8_form("widened", weight, unit)
        fns = kernels.OPS["int8-linear"].fns(("dequant", "widened"), dtype, weight)
        impl, other = "widened", "dequant"
        reference = kernels._int8_dequant(torch.ones(2, k).to(dtype), weight, unit, None)

        def general(x):
            return kernels.INT8_LINEAR["widened"](x, weight, unit, None, form)
    else:
        fns = kernels.OPS["linear"].fns(("linear", "columns"), dtype, weight)
        impl, other = "columns", "linear"
        reference = F.linear(torch.ones(2, k).to(dtype), weight)

        def general(x):
            return kernels._linear_columns(x, weight, None)

    taken = []  # each bound call: whether it took the rows (None: the general path ran)
    real = kernels.BoundProduct.__call__

    def counted(self, x):
        out = real(self, x)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(kernels.BoundProduct, "__call__", counted)
    rows = torch.randn(16, k, generator=g).to(dtype)
    assert torch.equal(fns[impl](rows), general(rows)) and taken == [True]
    strided = torch.randn(16, 2 * k, generator=g).to(dtype)[:, ::2]
    assert torch.equal(fns[impl](strided), general(strided.contiguous()))
    assert taken == [True, False]
    tall = torch.randn(kernels.INT8_TILE_ROWS + 1, k, generator=g).to(dtype)
    assert torch.equal(fns[impl](tall), general(tall))
    assert taken == [True, False, not quantized]
    assert torch.equal(fns[other](torch.ones(2, k).to(dtype)), reference) and len(taken) == 3


def test_a_derived_form_is_made_again_for_a_parameters_new_data():
    """Module.to swaps a parameter's data (the same object, the same version): a form kept
    with the weight (_derived: the packed copies) is made again from the new values."""
    w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    first = kernels._derived(w, "test", lambda: w.detach().clone())
    assert kernels._derived(w, "test", lambda: None) is first
    version = w._version
    w.data = torch.randn(4, 4)
    assert w._version == version
    again = kernels._derived(w, "test", lambda: w.detach().clone())
    assert torch.equal(again, w.detach()) and not torch.equal(again, first)
