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
# Stages run in order of the value of their answer per second, each in its own process
# under `timeout` with TORCH_LOGS=recompiles,graph_breaks, its log kept; a failing or
# timed-out stage does not stop the later ones. Stages save partial results as they go
# (a bench after its warm-up, parity after each path), which a stage killed at its limit
# keeps; a stage starts only with what it needs left of the budget: its whole limit if it
# saves no partial result, else the planned time to its first. Results in $OUT (default
# .gpu/out): summary.md (the answers, and every stage skipped and why), summary.json
# (every stage's result), logs.tar.gz (each stage's JSON and log), console.txt.
#
# Environment: PYTHON (interpreter), OUT, GPU_CHECK_BUDGET_S (whole run, default 465 s;
# 3000 on the CPU), GPU_CHECK_LIMIT_SCALE (stage limits x this: 1, 5 on the CPU),
# GPU_CHECK_DEVICE (cuda), GPU_CHECK_SMALL, GPU_CHECK_STAGES (space-separated subset),
# GPU_CHECK_BLOCK (modules to make unimportable; the dry run blocks the image's absentees),
# GPU_CHECK_CARRY (default .gpu/carry), GPU_CHECK_LIMITS ("stage=seconds ...": limits of
# these stages, unscaled) and GPU_CHECK_STALL (a stage that hangs after its first partial
# result): the tests' stage killed at its limit.
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
CARRY=${GPU_CHECK_CARRY:-.gpu/carry}
exec > >(tee "$OUT/console.txt") 2>&1
say() { echo "[gpu_check +$(($(date +%s) - STARTED))s] $*"; }

if [[ ! -f $CARRY/plan.json ]]; then
  say "$CARRY/plan.json is missing: run 'scripts/gpu_check.sh prepare' on the CPU machine and carry .gpu/carry"
  exit 2
fi

# The speech detector reads its weights from the installed silero-vad wheel; carried. A
# wheel is a zip of the files an install puts in place (pure Python here): unpacked onto
# PYTHONPATH, it imports, its metadata included, where pip is absent or fails.
if ! "$PY" -c 'import importlib.metadata as m; m.distribution("silero-vad")' 2>/dev/null; then
  site=$GPU_CHECK_WORK/site
  wheel=$(ls "$CARRY"/silero_vad-*.whl 2>/dev/null | head -n 1)
  if [[ -z $wheel ]]; then
    say "no silero-vad wheel in $CARRY: the stages that transcribe will fail"
  elif "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"; then
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    say "silero-vad installed from $wheel into $site"
  elif "$PY" -m zipfile -e "$wheel" "$site"; then
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    say "silero-vad unpacked from $wheel into $site (pip install failed)"
  else
    say "silero-vad could not be installed: the stages that transcribe will fail"
  fi
fi

mapfile -t PLAN < <("$PY" scripts/gpu_check.py plan)
read -r default_budget RESERVE <<<"${PLAN[0]}"
PLAN=("${PLAN[@]:1}")
BUDGET=${BUDGET:-${GPU_CHECK_BUDGET_S:-$default_budget}}
DEADLINE=$((STARTED + BUDGET))

scaled() {  # name limit needs -> "limit needs" of this run: scaled, GPU_CHECK_LIMITS's
  local entry limit=$(($2 * SCALE)) needs=$(($3 * SCALE))
  for entry in ${GPU_CHECK_LIMITS:-}; do
    [[ ${entry%%=*} == "$1" ]] && limit=${entry#*=}
  done
  echo "$limit" $((needs < limit ? needs : limit))
}

say "plan (budget ${BUDGET}s, ${RESERVE}s kept for the summary, limits x$SCALE, device $GPU_CHECK_DEVICE, small=${GPU_CHECK_SMALL:-0}, python $PY):"
total=0 expected=0 within=0
for line in "${PLAN[@]}"; do
  read -r name limit needs expect what <<<"$line"
  read -r limit needs < <(scaled "$name" "$limit" "$needs")
  expected=$((expected + expect))
  ((expected <= default_budget - RESERVE)) && within=$expected when="in the plan" \
    || when="if time is left"
  printf '  %-30s planned %3ss (so far %3ss, %-15s)  limit %4ss  needs %4ss  %s\n' \
    "$name" "$expect" "$expected" "$when" "$limit" "$needs" "${what//_/ }"
  total=$((total + limit))
done
echo "  planned on an H200: ${within}s in the plan (of ${default_budget}s less ${RESERVE}s), ${expected}s in all; limits ${total}s in all; a stage starts only with what it needs left"

for line in "${PLAN[@]}"; do
  read -r name limit needs _ _ <<<"$line"
  read -r limit needs < <(scaled "$name" "$limit" "$needs")
  if [[ -n "${GPU_CHECK_STAGES:-}" && " $GPU_CHECK_STAGES " != *" $name "* ]]; then
    printf '%s\t-2\t%s\t0\tnot selected (GPU_CHECK_STAGES)\n' "$name" "$limit" >>"$GPU_CHECK_WORK/driver.tsv"
    continue
  fi
  left=$((DEADLINE - RESERVE - $(date +%s)))
  if ((left < needs)); then
    say "$name skipped: ${left}s left, needs ${needs}s"
    printf '%s\t-1\t%s\t0\tskipped: %ss of the budget left, needs %ss\n' \
      "$name" "$limit" "$left" "$needs" >>"$GPU_CHECK_WORK/driver.tsv"
    continue
  fi
  ((limit > left)) && limit=$left
  say "$name (limit ${limit}s)"
  t0=$(date +%s)
  TORCH_LOGS=recompiles,graph_breaks timeout -k 5 "$limit" \
    "$PY" scripts/gpu_check.py stage "$name" >"$GPU_CHECK_WORK/$name.log" 2>&1
  rc=$?
  tail -n 4 "$GPU_CHECK_WORK/$name.log"
  printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$limit" "$(($(date +%s) - t0))" >>"$GPU_CHECK_WORK/driver.tsv"
  "$PY" scripts/gpu_check.py summary "$OUT" || say "summary failed"
done
"$PY" scripts/gpu_check.py summary "$OUT"
cat "$OUT/summary.md"
say "done; results in $OUT"
