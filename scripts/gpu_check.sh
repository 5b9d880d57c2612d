#!/usr/bin/env bash
# GPU check (issue 12): parity, dtype and bench answers from one run on a lent GPU machine.
#
# Here, once, on the CPU machine (needs models/ and ../shared/audio; writes .gpu/carry/,
# about 16 MiB, git-ignored):
#   scripts/gpu_check.sh prepare
# On the GPU machine (device `run`, carry [".gpu/carry"], timeout_s 540):
#   bash scripts/gpu_check.sh
# Dry run on the CPU, tiny shapes, short audio, every code path, the packages the GPU
# image lacks blocked:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 bash scripts/gpu_check.sh
#
# Stages run in priority order, each in its own process under `timeout` with
# TORCH_LOGS=recompiles,graph_breaks, its log kept; a failing or timed-out stage does not
# stop the later ones; a stage is skipped when less of the budget is left than it needs.
# Results in $OUT (default .gpu/out): summary.md (the answers), summary.json (every
# stage's result), logs.tar.gz (each stage's JSON and log), console.txt.
#
# Environment: PYTHON (interpreter), OUT, GPU_CHECK_BUDGET_S (whole run, default 465 s;
# 3000 on the CPU), GPU_CHECK_LIMIT_SCALE (stage limits x this: 1, 5 on the CPU),
# GPU_CHECK_DEVICE (cuda), GPU_CHECK_SMALL, GPU_CHECK_STAGES (space-separated subset),
# GPU_CHECK_BLOCK (modules to make unimportable; the dry run blocks the image's absentees).
set -uo pipefail

cd "$(dirname "$0")/.."
STARTED=$(date +%s)
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE

if [[ "${1:-}" == prepare ]]; then
  exec "$PY" scripts/gpu_check.py prepare
fi

export GPU_CHECK_DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [[ $GPU_CHECK_DEVICE == cpu ]]; then
  # Prove the imports: what the GPU image lacks cannot be imported here either.
  export GPU_CHECK_BLOCK=${GPU_CHECK_BLOCK-soundfile,soxr,av,jiwer,whisper_normalizer}
  # Inductor compiles on a few shared cores for minutes: the limits are an H200's.
  SCALE=${GPU_CHECK_LIMIT_SCALE:-5}
  BUDGET=${GPU_CHECK_BUDGET_S:-3000}
fi
SCALE=${SCALE:-${GPU_CHECK_LIMIT_SCALE:-1}}
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-$PWD/.gpu/work}
rm -rf "$GPU_CHECK_WORK"
mkdir -p "$GPU_CHECK_WORK"
BUDGET=${BUDGET:-${GPU_CHECK_BUDGET_S:-465}}
DEADLINE=$((STARTED + BUDGET))
RESERVE=10  # seconds kept for the last summary
exec > >(tee "$OUT/console.txt") 2>&1
say() { echo "[gpu_check +$(($(date +%s) - STARTED))s] $*"; }

if [[ ! -f .gpu/carry/plan.json ]]; then
  say ".gpu/carry/plan.json is missing: run 'scripts/gpu_check.sh prepare' on the CPU machine and carry .gpu/carry"
  exit 2
fi

# The speech detector reads its weights from the installed silero-vad wheel; carried.
if ! "$PY" -c 'import importlib.metadata as m; m.distribution("silero-vad")' 2>/dev/null; then
  site=$PWD/.gpu/site
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      .gpu/carry/silero_vad-*.whl; then
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    say "silero-vad installed from the carried wheel into $site"
  else
    say "silero-vad could not be installed: the stages that transcribe will fail"
  fi
fi

say "plan (budget ${BUDGET}s, limits x$SCALE, device $GPU_CHECK_DEVICE, small=${GPU_CHECK_SMALL:-0}, python $PY):"
mapfile -t PLAN < <("$PY" scripts/gpu_check.py plan)
total=0 expected=0
for line in "${PLAN[@]}"; do
  read -r name limit min expect what <<<"$line"
  limit=$((limit * SCALE)) min=$((min * SCALE))
  expected=$((expected + expect))
  printf '  %-30s planned %3ss (so far %3ss)  limit %4ss  needs %3ss  %s\n' \
    "$name" "$expect" "$expected" "$limit" "$min" "${what//_/ }"
  total=$((total + limit))
done
echo "  planned ${expected}s on an H200, limits ${total}s in all; what does not fit the budget is skipped"

for line in "${PLAN[@]}"; do
  read -r name limit min _ _ <<<"$line"
  limit=$((limit * SCALE)) min=$((min * SCALE))
  if [[ -n "${GPU_CHECK_STAGES:-}" && " $GPU_CHECK_STAGES " != *" $name "* ]]; then
    continue
  fi
  left=$((DEADLINE - RESERVE - $(date +%s)))
  if ((left < min)); then
    say "$name skipped: ${left}s left, needs ${min}s"
    printf '%s\t-1\t%s\t0\n' "$name" "$limit" >>"$GPU_CHECK_WORK/driver.tsv"
    continue
  fi
  ((limit > left)) && limit=$left
  say "$name (limit ${limit}s)"
  t0=$(date +%s)
  TORCH_LOGS=recompiles,graph_breaks timeout -k 5 "$limit" \
    "$PY" scripts/gpu_check.py stage "$name" >"$GPU_CHECK_WORK/$name.log" 2>&1
  rc=$?
  tail -n 4 "$GPU_CHECK_WORK/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$limit" "$(($(date +%s) - t0))" >>"$GPU_CHECK_WORK/driver.tsv"
  "$PY" scripts/gpu_check.py summary "$OUT" || say "summary failed"
done
"$PY" scripts/gpu_check.py summary "$OUT"
cat "$OUT/summary.md"
say "done; results in $OUT"
