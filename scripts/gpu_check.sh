#!/usr/bin/env bash
# GPU check: the CUDA tests and a benchmark of large-v3 / large-v3-turbo shapes, in one go.
#
# Made for a bare GPU machine with Python, torch, transformers, tokenizers, safetensors,
# typer, rich and pytest, but no soundfile/soxr/av, no network and no real weights:
#   * random-weight Hugging Face Whisper directories with the real shapes are created
#     (tiny, base, large-v3 [128 mels, vocab 51866], large-v3-turbo [4 decoder layers]);
#     their embeddings are set so that greedy decoding emits text tokens until
#     max_new_tokens in every window (no end-of-text, no timestamp pair, hence no tail
#     windows): every configuration does the same, worst-case amount of decoding work;
#   * `pytest -m cuda` runs with those directories findable by alias (WHISPER_CLI_MODELS);
#   * `python -m whisper_cli.tools.bench` runs batch 16, f32/f16/bf16, compile off and on,
#     in priority order until the time budget is spent (skipped ones are listed);
#   * results go to $OUT: bench.json, bench.md, pytest_cuda.txt, env.txt, log.txt.
#
# Usage:
#   scripts/gpu_check.sh prepare     # on the CPU machine (needs soundfile): writes the two
#                                    # files to carry, .gpu/tokenizer.json and .gpu/speech.npy
#   scripts/gpu_check.sh             # on the GPU machine; carry .gpu/tokenizer.json and
#                                    # .gpu/speech.npy (generated .gpu/models stay between runs)
#   scripts/gpu_check.sh --dry-run   # on CPU: tiny stand-in shapes, compile off, 1 repeat
#
# Environment: PYTHON (interpreter), OUT (results dir, default .gpu/out), GPU_CHECK_BUDGET_S
# (whole-script budget, default 530 s), BENCH_DURATION (s of audio, default 600),
# BENCH_REPEATS (default 2), PYTEST_TIMEOUT_S (default 150).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
STARTED=$(date +%s)
MODE=run
case "${1:-}" in
  prepare) MODE=prepare ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: $0 [prepare|--dry-run]" >&2; exit 2 ;;
esac

if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
GPU=$ROOT/.gpu
mkdir -p "$GPU"

if [[ $MODE == prepare ]]; then
  cp models/base/tokenizer.json "$GPU/tokenizer.json"
  "$PY" -m whisper_cli.tools.bench --export-audio "$GPU/speech.npy"  # default real speech, 16 kHz
  ls -l "$GPU/tokenizer.json" "$GPU/speech.npy"
  exit 0
fi

OUT=${OUT:-$GPU/out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-530}
DEADLINE=$((STARTED + BUDGET))
LOG=$OUT/log.txt
: >"$LOG"
say() { echo "[gpu_check +$(($(date +%s) - STARTED))s] $*" | tee -a "$LOG" >&2; }

if [[ $MODE == dry ]]; then
  MODELS=$GPU/models-dry
  DEVICE=cpu
else
  MODELS=$GPU/models
  DEVICE=cuda
fi
export PYTHONPATH="$GPU/stubs:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export WHISPER_CLI_MODELS=$MODELS  # aliases (tiny, base, large-v3, ...) resolve here
export MODELS DEVICE OUT DEADLINE MODE GPU

# --- 1. stand-ins for the audio decoders this machine may lack -------------------------
# whisper_cli.audio imports soundfile and soxr at the top (and tests import av); the bench
# feeds arrays and never decodes a file, so importable stubs that refuse to work suffice.
mkdir -p "$GPU/stubs"
for mod in soundfile soxr av; do
  if "$PY" -c "import $mod" 2>/dev/null; then
    rm -f "$GPU/stubs/$mod.py"
  else
    say "stub for missing module $mod"
    cat >"$GPU/stubs/$mod.py" <<EOF
"""Stand-in for $mod (not installed here): importable, raises when used."""


class SoundFileError(Exception):
    pass


class LibsndfileError(SoundFileError):
    pass


class FFmpegError(Exception):
    pass


class InvalidDataError(FFmpegError):
    pass


def __getattr__(name):
    raise ModuleNotFoundError("$mod is not installed on this machine (gpu_check stub)")
EOF
  fi
done

{
  echo "date: $(date -u +%FT%TZ)"
  echo "mode: $MODE"
  git rev-parse HEAD 2>/dev/null | sed 's/^/commit: /' || true
  "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0]);
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available());
print("transformers", transformers.__version__);
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >&2

# --- 2. random-weight model directories with real shapes ----------------------------------
say "models in $MODELS"
"$PY" - <<'PY' 2>&1 | tee -a "$LOG" >&2
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

sys.path.insert(0, "tests")
from util import shifted_tokenizer  # noqa: E402

from whisper_cli.tokenizer import Tokenizer  # noqa: E402

gpu, models, dry = Path(os.environ["GPU"]), Path(os.environ["MODELS"]), os.environ["MODE"] == "dry"
# name: d_model, encoder layers, decoder layers, heads, mel bins, vocabulary
SHAPES = {
    "tiny": (384, 4, 4, 6, 80, 51865),
    "base": (512, 6, 6, 8, 80, 51865),
    "large-v3": (1280, 32, 32, 20, 128, 51866),
    "large-v3-turbo": (1280, 32, 4, 20, 128, 51866),
}
if dry:  # the same vocabularies and mel bins, tiny widths: minutes become seconds on CPU
    SHAPES["large-v3"] = (64, 2, 2, 4, 128, 51866)
    SHAPES["large-v3-turbo"] = (64, 2, 1, 4, 128, 51866)

tok51865 = gpu / "tokenizer.json"
if not tok51865.is_file():
    sys.exit(f"{tok51865} is missing: run `scripts/gpu_check.sh prepare` and carry it")
tok51866 = shifted_tokenizer(tok51865, gpu / "tokenizer-v3.json")
device = "cuda" if torch.cuda.is_available() else "cpu"
SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60]


def make(name: str, d: int, enc: int, dec: int, heads: int, mels: int, vocab: int) -> None:
    out = models / name
    if (out / ".complete").is_file():
        return
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text((tok51866 if vocab == 51866 else tok51865).read_text())
    tok = Tokenizer(out / "tokenizer.json", multilingual=True)
    sp = tok.special
    config = WhisperConfig(
        vocab_size=vocab, num_mel_bins=mels, d_model=d,
        encoder_layers=enc, decoder_layers=dec,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d,
        max_source_positions=1500, max_target_positions=448,
        bos_token_id=sp.eot, eos_token_id=sp.eot, pad_token_id=sp.eot,
        decoder_start_token_id=sp.sot,
        suppress_tokens=SUPPRESS, begin_suppress_tokens=[220, sp.eot],
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.5 B parameters is seconds on a GPU
        model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        emb = model.model.decoder.embed_tokens.weight
        # Text logits with a spread of ~5 beat the timestamps' summed probability (the
        # timestamp rule) and end-of-text never wins: every row decodes max_new_tokens.
        emb.normal_(0.0, 5.0 / math.sqrt(d))
        emb[sp.eot] = 0.0
        emb[sp.timestamp_begin :] = 0.0
        # Positions dominate the residual stream (else the tied output projection favours the
        # input token): each step picks another token and the repetition guard (periods up
        # to 16) never stops a row early.
        model.model.decoder.embed_positions.weight.normal_(0.0, 3.0)
    model.to(torch.float16).save_pretrained(out)
    WhisperFeatureExtractor(feature_size=mels).save_pretrained(out)
    generation = {
        "decoder_start_token_id": sp.sot, "eos_token_id": sp.eot, "pad_token_id": sp.eot,
        "bos_token_id": sp.eot, "suppress_tokens": SUPPRESS,
        "begin_suppress_tokens": [220, sp.eot], "no_timestamps_token_id": sp.no_timestamps,
        "max_initial_timestamp_index": 50, "max_length": 448, "is_multilingual": True,
        "task_to_id": {"transcribe": sp.transcribe, "translate": sp.translate},
        "lang_to_id": {f"<|{c}|>": i for c, i in tok.language_ids.items()},
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / ".complete").write_text("")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"made {name}: {params:.0f} M parameters in {time.time() - started:.1f} s", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


for name, shape in SHAPES.items():
    make(name, *shape)
turbo = models / "turbo"
if not turbo.exists():
    turbo.symlink_to("large-v3-turbo")

speech = gpu / "speech.npy"
if not speech.is_file():  # random weights: the content hardly matters, the windows do
    print(f"{speech} missing: using 60 s of amplitude-modulated noise", flush=True)
    rng = np.random.default_rng(0)
    t = np.arange(60 * 16000) / 16000
    noise = rng.standard_normal(len(t)) * (0.1 + 0.1 * np.sin(2 * np.pi * 3 * t) ** 2)
    np.save(speech, noise.astype(np.float32))
PY

# --- 3. the CUDA tests ----------------------------------------------------------------------
left=$((DEADLINE - $(date +%s)))
PYTEST_TIMEOUT=${PYTEST_TIMEOUT_S:-150}
((PYTEST_TIMEOUT > left - 120)) && PYTEST_TIMEOUT=$((left - 120))
if ((PYTEST_TIMEOUT < 20)); then
  say "no time left for pytest -m cuda"
else
  say "pytest -m cuda (timeout ${PYTEST_TIMEOUT}s)"
  set +e
  timeout -k 10 "$PYTEST_TIMEOUT" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests \
    >"$OUT/pytest_cuda.txt" 2>&1
  rc=$?
  set -e
  tail -n 15 "$OUT/pytest_cuda.txt" >&2
  # 5: no test is marked cuda yet; 124: the timeout above.
  say "pytest -m cuda exit status $rc"
fi

# --- 4. the benchmark, most important configurations first ---------------------------------
say "bench (budget until +$BUDGET s)"
"$PY" - <<'PY' 2>&1 | tee -a "$LOG" >&2
import dataclasses
import json
import os
import time
from pathlib import Path

from whisper_cli.tools.bench import (
    BenchConfig,
    BenchFailure,
    combine_reports,
    render_table,
    report_to_json,
    run_bench,
)

out, models = Path(os.environ["OUT"]), Path(os.environ["MODELS"])
deadline, dry = float(os.environ["DEADLINE"]), os.environ["MODE"] == "dry"
audio = str(Path(os.environ["GPU"]) / "speech.npy")
duration = float(os.environ.get("BENCH_DURATION", 60 if dry else 600))
repeats = int(os.environ.get("BENCH_REPEATS", 1 if dry else 2))
min_left = 15 if dry else 60  # a configuration needs about this much at least

plan = []  # (model, compile, dtype, against): bf16 first, eager before compiled
for dtype in ("bf16", "f16", "f32"):
    for compile_mode in ("off",) if dry else ("off", "on"):
        for model in ("large-v3-turbo", "large-v3"):
            plan.append((model, compile_mode, dtype, None))
plan.append(("large-v3-turbo", "off", "bf16", "transformers"))  # speed against transformers


def write(reports, skipped) -> None:
    """Rewritten after every configuration, so a cut-off run still leaves its results."""
    if not reports:
        return
    report = combine_reports(reports)
    report = dataclasses.replace(report, failures=report.failures + tuple(skipped))
    data = report_to_json(report)
    data["plan"] = [[str(x) for x in p] for p in plan]
    (out / "bench.json").write_text(json.dumps(data, indent=2))
    (out / "bench.md").write_text(render_table(report) + "\n")


reports, skipped = [], []
for model, compile_mode, dtype, against in plan:
    left = deadline - time.time()
    label = f"{model} {dtype} compile={compile_mode}" + (f" vs {against}" if against else "")
    if left < min_left:
        skipped.append(BenchFailure(model, dtype, f"skipped ({label}): time budget spent"))
        continue
    config = BenchConfig(
        model=str(models / model),
        dtypes=(dtype,),
        batch_size=16,
        audio=audio,
        duration=duration,
        max_new_tokens=128,
        compile=compile_mode,
        repeats=repeats,
        against=against,
        device=os.environ["DEVICE"],
        timeout_s=left - 5,
    )
    started = time.time()
    report = run_bench(config)
    reports.append(report)
    status = "failed: " + report.failures[0].error[-400:] if report.failures else "ok"
    print(f"{label}: {time.time() - started:.0f} s, {status}", flush=True)
    write(reports, skipped)
write(reports, skipped)
if (out / "bench.md").is_file():
    print((out / "bench.md").read_text(), flush=True)
PY
say "done; results in $OUT"
