"""Where an eager decode step's time goes on this CPU, by kind of work.

    python scripts/step_profile.py [--model models/tiny.en] [--dtype f32]
        [--quantize none|int8] [--audio ten.wav] [--batch 16] [--top N] [--json]

Decodes one batch of `--batch` 30 s windows of `--audio` (English; the first windows of
the file) with the engine as `transcribe` runs it (rows drop out as they finish), first
untimed (a warm-up, which also makes the encoder outputs), then timed, then once more
under torch.profiler. Prints the timed run's milliseconds per step and per row-step
(engine counters), and the profiled run's self CPU time per step by group:

- cross-attention: attention over the encoder's positions (the K/V read dominates);
- self-attention: attention over the decoded tokens;
- logits: the tied vocabulary projection;
- linear layers: the decoder's other matrix products (any kernel, int8 ones too);
- rules and choice: the logit rules, the argmax or draw, the chosen log-prob;
- caches and row drops: cache writes, and the copies made when finished rows drop out;
- norms and activations; other.

Profiling adds a little to each op, so the groups' sum exceeds the timed step: read
them as shares. Time nothing else beside it (two cores: other work shows up here).
--top N also lists the N ops (by name and input shapes) that took the most, each with its
group and calls: what a group's time is made of (e.g. a transposing copy of the logits).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from whisper_cli.allocator import keep_freed_memory  # noqa: E402
from whisper_cli.audio import SAMPLE_RATE, open_audio  # noqa: E402
from whisper_cli.decoding import DecodeOptions  # noqa: E402
from whisper_cli.dtypes import DTYPE_NAMES, DtypePolicy  # noqa: E402
from whisper_cli.engine import Engine, WindowInput  # noqa: E402
from whisper_cli.kernels import FUSED_RANGE, MATMUL_RANGE  # noqa: E402
from whisper_cli.loading import load_model  # noqa: E402
from whisper_cli.options import TranscribeOptions  # noqa: E402

WINDOW = 30 * SAMPLE_RATE
GROUPS = (
    "cross-attention",
    "self-attention",
    "logits",
    "linear layers",
    "rules and choice",
    "caches and row drops",
    "norms and activations",
    "other",
)
# Ops by their base name (aten::_log_softmax and aten::add_ are log_softmax and add),
# compared whole: a prefix or substring match of short names takes gelu for a rule ("ge")
# and log_softmax for attention ("softmax"). Only the linear ops are matched by a part,
# since each backend names its own ("linear" or "int8pack" somewhere in every one).
_ATTENTION = {"bmm", "baddbmm", "softmax"}  # and scaled_dot_product_*
_LINEAR = {"mm", "addmm", "matmul"}  # and any op with "linear" or "int8pack" in its name
_LINEAR_PARTS = ("linear", "int8pack")  # mkldnn's _linear_pointwise, onednn's qlinear_...
_CACHES = {"index_copy", "index_select", "index_put", "index_put_impl", "copy", "clone", "cat",
           "stack"}  # fmt: skip
# The logit rules, the choice, and the chosen tokens' bookkeeping ("and" is aten::__and__).
_RULES = {
    "masked_fill", "where", "argmax", "amax", "exp", "logsumexp", "log_softmax", "sub",
    "gather", "cumsum", "eq", "ge", "lt", "gt", "le", "logical_or", "logical_and",
    "logical_not", "any", "all", "clamp", "sum", "max", "lerp", "ne", "bitwise_and",
    "bitwise_or", "bitwise_not", "rsub", "div", "index_fill", "and", "or", "iand", "ior",
    "abs", "log", "maximum", "minimum", "remainder", "scatter",
}  # fmt: skip
_NORMS = {"layer_norm", "native_layer_norm", "gelu"}
_ELEMENTWISE = {"add", "mul"}  # the residual stream's, or a rule's over the logits


def group_of(name: str, shapes: list, n_audio: int, vocab: int) -> str:
    """The group of a profiled op, from its name and its inputs' shapes."""
    if name.startswith(FUSED_RANGE):  # the C decode attention: no shapes, its keys named
        return "cross-attention" if name == f"{FUSED_RANGE}{n_audio}" else "self-attention"
    if name.startswith(MATMUL_RANGE):  # a C product (float or int8): its columns named
        return "logits" if name == f"{MATMUL_RANGE}{vocab}" else "linear layers"
    op = name.split("::")[-1].strip("_")
    dims = {d for s in shapes if isinstance(s, list) for d in s}
    if op in _ATTENTION or op.startswith("scaled_dot_product"):
        return "cross-attention" if n_audio in dims else "self-attention"
    if op in _LINEAR or any(part in op for part in _LINEAR_PARTS):
        return "logits" if vocab in dims else "linear layers"
    if op in _CACHES:
        return "caches and row drops"
    if op in _ELEMENTWISE:
        # A rule adds over a row of the logits or of the timestamps (n_audio + 1 columns at
        # least); the residual stream's rows are the model's width, under n_audio.
        row = max((math.prod(s[1:]) for s in shapes if isinstance(s, list) and s), default=0)
        return "rules and choice" if row > n_audio else "norms and activations"
    if op in _RULES:
        return "rules and choice"
    if op in _NORMS:
        return "norms and activations"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "tiny.en"))
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--quantize", default="none", choices=("none", "int8"))
    parser.add_argument("--audio", default=str(REPO.parent / "shared" / "audio" / "jfk.flac"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--top", type=int, default=0, help="list the N heaviest ops")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.top < 0:
        parser.error("--top takes a count of ops, 0 or more")

    keep_freed_memory()  # as the CLI does: without it every (B, V) tensor is faulted in anew
    policy = DtypePolicy(DTYPE_NAMES[args.dtype], torch.device("cpu"), args.quantize)
    loaded = load_model(args.model, policy, TranscribeOptions(batch_size=args.batch))
    audio = np.concatenate(list(open_audio(args.audio).blocks()))
    audio = np.resize(audio, args.batch * WINDOW)  # the file repeated if it is shorter
    rows = [
        WindowInput(audio[i * WINDOW : (i + 1) * WINDOW], language="en") for i in range(args.batch)
    ]
    engine = Engine(loaded, DecodeOptions(), timed=True)
    decoded = engine.run(rows)  # warm-up; its encoder outputs are reused below
    kept = [
        WindowInput(np.zeros(0, np.float32), features=f, language="en") for f in decoded.features
    ]

    before = dict(vars(engine.counters))
    started = time.perf_counter()
    engine.run(kept)
    wall = time.perf_counter() - started
    ran = {k: v - before[k] for k, v in vars(engine.counters).items()}
    steps, row_steps = ran["steps"], ran["row_steps"]

    with torch.profiler.profile(record_shapes=True) as prof:
        engine.run(kept)
    config = loaded.config
    per_group: dict[str, float] = defaultdict(float)
    ops = []  # (ms per step, group, name, input shapes, calls)
    for event in prof.key_averages(group_by_input_shape=True):
        group = group_of(
            event.key, event.input_shapes, config.max_source_positions, config.vocab_size
        )
        ms = event.self_cpu_time_total / 1e3 / steps
        per_group[group] += ms
        ops.append((ms, group, event.key, event.input_shapes, event.count))
    top = sorted(ops, key=lambda op: op[0], reverse=True)[: args.top]
    report = {
        "model": loaded.name,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "steps": steps,
        "row_steps": row_steps,
        "ms_per_step": round(ran["decode_s"] / steps * 1e3, 2),
        "ms_per_row_step": round(ran["decode_s"] / row_steps * 1e3, 3),
        "run_s": round(wall, 3),
        "profile_ms_per_step": {g: round(per_group.get(g, 0.0), 2) for g in GROUPS},
    }
    if top:
        report["top_ops"] = [
            {"op": name, "shapes": shapes, "group": group, "ms_per_step": round(ms, 3),
             "calls": calls}
            for ms, group, name, shapes, calls in top
        ]  # fmt: skip
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{report['model']} {args.dtype} quantize={args.quantize}; {report['cpu']}; "
        f"{report['threads']} threads; batch {args.batch}"
    )
    print(
        f"{steps} steps, {row_steps} row-steps: {report['ms_per_step']} ms a step, "
        f"{report['ms_per_row_step']} ms a row-step"
    )
    total = sum(per_group.values())
    print("| group | ms a step (profiled) | share |\n|---|---|---|")
    for g in GROUPS:
        print(f"| {g} | {per_group.get(g, 0.0):.2f} | {per_group.get(g, 0.0) / total:.0%} |")
    if top:
        print("\n| op | input shapes | group | ms a step | calls |\n|---|---|---|---|---|")
        for ms, group, name, shapes, calls in top:
            print(f"| {name} | {shapes} | {group} | {ms:.3f} | {calls} |")


def _cpu() -> str:
    from whisper_cli.kernels import cpu_model

    return cpu_model()


if __name__ == "__main__":
    main()
