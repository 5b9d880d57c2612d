"""Whole-process wall time and WER on CPU: whisper-cli vs faster-whisper vs whisper.cpp.

Builds N minutes of real English speech from ../shared/audio (with its reference text),
then times each implementation as a separate process (load included), `--repeats` times
in round-robin order after `--warmup` untimed rounds (model files read into the page
cache, kernel plans timed and cached: a first run pays what a user's later runs do not),
and prints the median, its ratio to faster-whisper's batched
pipeline at int8, and the WER of each row, under a header naming the CPU, the thread
count and the versions. Rows:

- whisper-cli at each of --dtypes (this checkout, `python -m whisper_cli`, batch 16); a
  dtype written `f32+int8` (or `bf16+int8`) runs that dtype with `--quantize int8`;
- fw-batched: faster-whisper's BatchedInferencePipeline (batch 16, greedy) at each of --fw-types;
- fw-sequential: faster-whisper's WhisperModel.transcribe (greedy) at each of --fw-types;
- whisper.cpp: the `pywhispercpp` wheel (greedy, its default temperature fallback as
  ours), with the ggml file that scripts/ggml_weights.py writes from the same HF weights
  into .cache/ggml/ (whisper.cpp's f16 weights: its dtype column says f16);
- transformers (only when named in --only): the transformers ASR pipeline, the reference.

faster-whisper and pywhispercpp are not dependencies: pass the Python of a throw-away
environment that has them with --peer-python, made once with

    python3.11 -m venv /tmp/peers
    /tmp/peers/bin/pip install faster-whisper==1.2.1 pywhispercpp==1.5.1

and the CTranslate2 model directories with --ct2-dir (make models leaves them in
.cache/ct2). A row that cannot run is left out with its reason printed. Every child gets
--threads threads (OMP_NUM_THREADS for torch, cpu_threads / n_threads for the peers).

The issue-12 comparison (a quiet machine; 7 rows x 3 repeats, some 10-15 minutes on 2 cores):

    .venv/bin/python scripts/compare_cpu.py --minutes 10 --repeats 3 --models tiny.en \\
        --peer-python /tmp/peers/bin/python

Its targets (printed with each run, met or not): whole process, 10 minutes of English,
tiny.en, batch 16, WER <= 1.5%: whisper-cli bf16 <= 0.6x and f32 <= 0.9x the time of
fw-batched int8.

Issue 20's comparison (int8 weights, and bf16 against f32 on a CPU without native bf16;
each row's peak RSS is printed beside its time):

    .venv/bin/python scripts/compare_cpu.py --minutes 10 --repeats 3 --models tiny.en,base \\
        --dtypes f32,bf16,f32+int8,bf16+int8 --only whisper-cli,fw-batched \\
        --peer-python /tmp/peers/bin/python

Its targets (printed first, met or not): f32 <= 1.0x and f32+int8 <= 0.75x fw-batched
int8, int8's WER within 0.5 points of f32's and its peak memory below f32's; bf16 <= 1.05x
f32's time where the CPU has no avx512_bf16 / amx_bf16, <= 0.8x where it has one.

`--isa avx2` holds every row to AVX2 on a CPU that has more (an AVX-512 Zen 4 or Xeon
standing in for the 2-core Zen 3 that CI and the issues' tables ran on): torch's
own kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA), MKL's
(MKL_ENABLE_INSTRUCTIONS), fbgemm's (FBGEMM_ENABLE_INSTRUCTIONS: without it torch's int8
GEMM keeps AVX-512 VNNI) and CTranslate2's (CT2_FORCE_CPU_ISA), and whisper-cli's C
kernels, built through a compiler wrapper (.cache/isa-avx2/cc) that compiles for
x86-64-v3 where they ask for -march=native. The kernel plan and the C kernels' library
are then the held run's own (their cache keys name the limits and the build). Each
child's torch is checked to run AVX2 kernels. The memory and caches stay the host's, so
read its ratios as the instructions' part of the difference, not as the Zen 3's times.
The bf16 target is then the one for a CPU without native bf16.

Every row also runs, in each round right after its long run, on the first --start-clip
seconds (default 1) of the same speech: that wall time is the row's start-up (interpreter,
imports, model load, one window). The table gives its median and the row's time past it
against the baseline's, (wall - start) / (baseline wall - baseline start): what the rows
cost per minute of audio, apart from what every process pays once (torch's import alone
is most of a second). The targets stay whole-process ones; this ratio is printed beside
them, not judged.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "audio"
BASELINE = ("fw-batched", "int8")
# The issue's targets: whisper-cli dtype -> the most time it may take, as a fraction of
# BASELINE's on the same model; and the most WER any of those rows may have.
TARGET_RATIOS = {"bf16": 0.6, "f32": 0.9, "f32+int8": 0.75}
# Issue 20: whisper-cli dtype -> the most time it may take as a fraction of BASELINE's;
# bf16 at most this many times f32's time (without native bf16 / with it); int8's WER at
# most this many points above f32's, its peak memory below f32's.
ISSUE20_RATIOS = {"f32": 1.0, "f32+int8": 0.75}
BF16_OVER_F32 = 1.05
BF16_OVER_F32_NATIVE = 0.8
INT8_WER_POINTS = 0.5
TARGET_WER = 1.5  # percent
TARGET_MINUTES, TARGET_MODEL = 10, "tiny.en"

FW_BATCHED = """
import sys, faster_whisper as fw
model_dir, compute_type, wav, threads = sys.argv[1:5]
m = fw.WhisperModel(model_dir, device="cpu", compute_type=compute_type, cpu_threads=int(threads))
p = fw.BatchedInferencePipeline(model=m)
segs, _ = p.transcribe(wav, batch_size=16, beam_size=1, temperature=0, language="en")
print(" ".join(s.text.strip() for s in segs))
"""
FW_SEQUENTIAL = """
import sys, faster_whisper as fw
model_dir, compute_type, wav, threads = sys.argv[1:5]
m = fw.WhisperModel(model_dir, device="cpu", compute_type=compute_type, cpu_threads=int(threads))
segs, _ = m.transcribe(wav, beam_size=1, temperature=0, language="en",
    without_timestamps=False, vad_filter=False, condition_on_previous_text=False)
print(" ".join(s.text.strip() for s in segs))
"""
WHISPER_CPP = """
import sys
from pywhispercpp.model import Model
ggml, wav, threads = sys.argv[1:4]
m = Model(ggml, n_threads=int(threads), language="en", print_progress=False,
    redirect_whispercpp_logs_to=None)
print(" ".join(s.text.strip() for s in m.transcribe(wav)))
"""
TRANSFORMERS = """
import sys, torch
from transformers import pipeline
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[2]]
kw = {"language": "en"} if "tiny.en" not in sys.argv[1] else {}
asr = pipeline("automatic-speech-recognition", model=sys.argv[1], dtype=dtype, device="cpu")
if asr.tokenizer.pad_token is None:  # imported dirs carry tokenizer.json alone
    asr.tokenizer.pad_token = "<|endoftext|>"
import soundfile as sf
audio, rate = sf.read(sys.argv[3], dtype="float32")
out = asr({"raw": audio, "sampling_rate": rate}, chunk_length_s=30, batch_size=16,
    return_timestamps=True, generate_kwargs=kw)
print(out["text"])
"""
PEER_VERSIONS = """
import importlib.metadata as md
for name in ("faster-whisper", "ctranslate2", "pywhispercpp"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
try:
    import _pywhispercpp
    print("whisper.cpp build:", _pywhispercpp.whisper_print_system_info().strip())
except ImportError:
    pass
"""


@dataclass(frozen=True)
class Run:
    impl: str
    model: str
    dtype: str
    cmd: list[str]

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.impl, self.model, self.dtype)


def build_speech(minutes: float, out: Path) -> str:
    """English real speech tiled to `minutes`, with pauses of varied length; its reference."""
    import soxr

    manifest = json.loads((SHARED / "manifest.json").read_text())
    clips = {c["file"]: c for c in manifest["clips"]}

    def load(name, channel=None):
        audio, rate = sf.read(SHARED / name, dtype="float32", always_2d=True)
        audio = audio[:, channel] if channel is not None else audio.mean(axis=1)
        return soxr.resample(audio, rate, 16000).astype(np.float32)

    multi = load("multilingual.mp3")[: int(29.3 * 16000)]  # the English (MIT licence) half
    english_multi = clips["multilingual.mp3"]["reference"].split(" Jedem")[0]
    pieces = [
        (load("jfk.flac"), clips["jfk.flac"]["reference"]),
        (load("stereo_diarization.wav", 0), clips["stereo_diarization.wav"]["reference_left"]),
        (load("stereo_diarization.wav", 1), clips["stereo_diarization.wav"]["reference_right"]),
        (multi, english_multi),
    ]
    rng = np.random.default_rng(0)
    audio, text, total = [], [], 0
    target = int(minutes * 60 * 16000)
    while total < target:
        clip, ref = pieces[rng.integers(len(pieces))]
        pause = np.zeros(int(rng.choice([0.0, 0.3, 1.0, 2.0]) * 16000), dtype=np.float32)
        audio += [clip, pause]
        text.append(ref)
        total += len(clip) + len(pause)
    sf.write(out, np.concatenate(audio), 16000, subtype="PCM_16")
    return " ".join(text)


def wer(reference: str, hypothesis: str) -> float:
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    return jiwer.wer(norm(reference), norm(hypothesis))


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str, float]:
    """Wall seconds, stdout and peak RSS (MiB) of one child process, from its own rusage."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {stderr[-2000:]}")
    return wall, stdout, usage.ru_maxrss / 1024  # Linux: KiB


def clip_command(cmd: list[str], wav: Path, clip: Path) -> list[str]:
    """A run's command with its audio (the argument that is `wav`) replaced by `clip`."""
    if str(wav) not in cmd:
        raise ValueError(f"{wav} is not an argument of {cmd[:4]}")
    return [str(clip) if part == str(wav) else part for part in cmd]


def beyond_start(wall: float, start: float, base_wall: float, base_start: float) -> float | None:
    """A row's time past its start-up (its wall time less a short clip's) as a fraction of
    the baseline's; None where the baseline has no time past its own start-up."""
    if base_wall - base_start <= 0:
        return None
    return round((wall - start) / (base_wall - base_start), 2)


def cpu_model() -> str:
    """The model name, with family/model and the vector flags the kernels' speed turns on
    (a VM may show only "AMD EPYC": family 25 model 1 is Zen 3, model 17 Zen 4)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or "unknown CPU"
    info = {}
    for line in lines:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')}, "
        f"model {info.get('model', '?')}; {' '.join(vector) or 'no avx2'})"
    )


def peer_versions(peer_python: str | None, env: dict[str, str]) -> list[str]:
    if peer_python is None:
        return ["peers: none (no --peer-python)"]
    done = subprocess.run(
        [peer_python, "-c", PEER_VERSIONS], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        return [f"peers: {peer_python} failed: {done.stderr.strip()[-300:]}"]
    return done.stdout.strip().splitlines()


def ggml_file(hf_dir: Path, model: str) -> tuple[Path | None, str]:
    """whisper.cpp's weights for `model`, written from hf_dir on first use; else why not."""
    path = REPO / ".cache" / "ggml" / f"{model}.bin"
    weights = hf_dir / "model.safetensors"
    if path.exists() and weights.exists() and path.stat().st_mtime >= weights.stat().st_mtime:
        return path, ""  # written from these weights (a re-imported model writes it again)
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "ggml_weights.py"), str(hf_dir), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None, f"cannot write ggml weights: {done.stderr.strip()[-300:]}"
    return path, ""


def plan(args, wav: Path, only: set[str]) -> tuple[list[Run], list[str]]:
    """The runs to time, and a reason for each row left out."""
    runs, skipped = [], []
    threads = str(args.threads)
    for model in args.models.split(","):
        hf_dir, ct2_dir = REPO / "models" / model, Path(args.ct2_dir) / model
        if "whisper-cli" in only:
            for dtype in args.dtypes.split(","):
                base_dtype, _, quantize = dtype.partition("+")
                cmd = [sys.executable, "-m", "whisper_cli", "transcribe", str(wav)]
                cmd += ["--model", str(hf_dir), "--dtype", base_dtype, "--batch-size", "16", "-q"]
                cmd += ["--quantize", quantize] if quantize else []
                cmd += ["--language", "en"] if model != "tiny.en" else []
                runs.append(Run("whisper-cli", model, dtype, cmd))
        if "transformers" in only:
            for dtype in args.dtypes.split(","):
                if "+" in dtype:
                    skipped.append(f"transformers {model} {dtype}: no int8 reference")
                    continue
                cmd = [sys.executable, "-c", TRANSFORMERS, str(hf_dir), dtype, str(wav)]
                runs.append(Run("transformers", model, dtype, cmd))
        for impl, code in (("fw-batched", FW_BATCHED), ("fw-sequential", FW_SEQUENTIAL)):
            if impl not in only:
                continue
            if args.peer_python is None:
                skipped.append(f"{impl} {model}: no --peer-python with faster-whisper")
                continue
            if not (ct2_dir / "model.bin").exists():
                skipped.append(f"{impl} {model}: no CTranslate2 model in {ct2_dir}")
                continue
            # CTranslate2 has no bfloat16 compute on CPU: its types are int8 and f32 here.
            for dtype in args.fw_types.split(","):
                compute = {"int8": "int8", "f32": "float32"}[dtype]
                cmd = [args.peer_python, "-c", code, str(ct2_dir), compute, str(wav), threads]
                runs.append(Run(impl, model, dtype, cmd))
        if "whisper.cpp" in only:
            if args.peer_python is None:
                skipped.append(f"whisper.cpp {model}: no --peer-python with pywhispercpp")
                continue
            ggml, why_not = ggml_file(hf_dir, model)
            if ggml is None:
                skipped.append(f"whisper.cpp {model}: {why_not}")
                continue
            cmd = [args.peer_python, "-c", WHISPER_CPP, str(ggml), str(wav), threads]
            runs.append(Run("whisper.cpp", model, "f16", cmd))
    return runs, skipped


def verdicts(rows: list[dict], minutes: float, native_bf16: bool) -> list[str]:
    """The issues' targets, each met or not, for every model the run has a baseline for:
    issue 20's (the open one) first, then issue 12's."""
    lines = []
    if minutes != TARGET_MINUTES:
        lines.append(f"(this run has {minutes:g} min of audio: indicative only)")
    return lines + issue20_verdicts(rows, native_bf16) + issue12_verdicts(rows)


def issue12_verdicts(rows: list[dict]) -> list[str]:
    lines = [
        f"issue 12 ({TARGET_MINUTES} min of English, {TARGET_MODEL}, batch 16, whole "
        f"process): whisper-cli bf16 <= {TARGET_RATIOS['bf16']}x and f32 <= "
        f"{TARGET_RATIOS['f32']}x the time of fw-batched int8, WER <= {TARGET_WER}%"
    ]
    for r in rows:
        if r["impl"] != "whisper-cli" or r["dtype"] not in TARGET_RATIOS:
            continue
        limit = TARGET_RATIOS[r["dtype"]]
        if r["ratio"] is None:
            lines.append(f"  {r['model']} {r['dtype']}: no fw-batched int8 row to compare with")
            continue
        speed = "met" if r["ratio"] <= limit else "NOT met"
        accuracy = "met" if r["wer"] <= TARGET_WER else "NOT met"
        lines.append(
            f"  {r['model']} {r['dtype']}: {r['ratio']}x (<= {limit}x: {speed}), "
            f"WER {r['wer']}% (<= {TARGET_WER}%: {accuracy})"
        )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def issue20_verdicts(rows: list[dict], native_bf16: bool) -> list[str]:
    """f32 and f32+int8 against fw-batched int8; bf16 against f32 (the limit by whether the
    CPU has native bf16); int8 against f32 (WER and memory); per model."""
    cli = {(r["model"], r["dtype"]): r for r in rows if r["impl"] == "whisper-cli"}
    starts = {r["model"]: r.get("start_s") for r in rows if (r["impl"], r["dtype"]) == BASELINE}
    bf16_limit = BF16_OVER_F32_NATIVE if native_bf16 else BF16_OVER_F32
    lines = []
    for (model, dtype), r in cli.items():
        parts = []
        if dtype in ISSUE20_RATIOS and r["ratio"] is not None:
            limit = ISSUE20_RATIOS[dtype]
            parts.append(
                f"{r['ratio']}x fw-batched int8 (<= {limit}x: {_met(r['ratio'] <= limit)})"
            )
            if r.get("beyond_ratio") is not None:  # informative: the target is the whole
                base = starts.get(model)
                parts.append(
                    f"{r['beyond_ratio']}x past start-up (a {r['start_s']} s start against "
                    f"{base} s)"
                )
        f32 = cli.get((model, "f32"))
        if f32 is not None and dtype != "f32":
            ratio = round(r["wall_s"] / f32["wall_s"], 2)
            part = f"{ratio}x f32's time"
            if dtype == "bf16":
                part += f" (<= {bf16_limit}x: {_met(ratio <= bf16_limit)})"
            parts.append(part)
            peak = f"peak {r['peak_mb']} MiB (f32 {f32['peak_mb']} MiB"
            if dtype.endswith("+int8"):  # each target apart: one line says which missed
                below = _met(r["peak_mb"] < f32["peak_mb"])
                parts.append(f"{peak}; below f32's: {below})")
                points = round(r["wer"] - f32["wer"], 2)
                near = _met(points <= INT8_WER_POINTS)
                parts.append(f"WER {points:+} points (<= +{INT8_WER_POINTS}: {near})")
            else:
                parts.append(f"{peak})")
        if parts:
            lines.append(f"  {model} {dtype}: " + ", ".join(parts))
    if lines:
        has = "has" if native_bf16 else "has no"
        lines.insert(0, f"issue 20 (this CPU {has} native bf16):")
    return lines


# --isa: the variables that hold each library to those instructions, and the
# architecture whisper-cli's C kernels are built for in place of -march=native.
ISA_LIMITS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
ISA_MARCH = {"avx2": "x86-64-v3"}
CC_WRAPPER = """#!/bin/sh
# {cc} for {isa}: compare_cpu.py --isa {isa} builds whisper-cli's C kernels with it.
for arg in "$@"; do
    shift
    [ "$arg" = "-march=native" ] && arg="-march={march}"
    set -- "$@" "$arg"
done
exec {cc} "$@"
"""


def isa_environment(isa: str, folder: Path) -> dict[str, str]:
    """The variables that hold every row to `isa`: the libraries' limits, and CC, a wrapper
    of this machine's C compiler (written into `folder`, kept: its path is part of the C
    kernels' cache key, so they are built once)."""
    from whisper_cli.native import compiler  # the one native.py would build with

    cc = compiler()
    if cc is None:
        raise SystemExit("--isa: no C compiler to build whisper-cli's C kernels with")
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "cc"
    wrapper.write_text(CC_WRAPPER.format(cc=cc, isa=isa, march=ISA_MARCH[isa]))
    wrapper.chmod(0o755)
    return {**ISA_LIMITS[isa], "CC": str(wrapper)}


# What a child reports of the kernels it runs: torch's capability, and whether fbgemm's
# int8 GEMM takes the narrow grid (it sums pairs in int16, as AVX2 does).
ISA_PROBE = """import torch
from whisper_cli import kernels
print(torch.backends.cpu.get_cpu_capability())
if "fbgemm" not in torch.backends.quantized.supported_engines:
    print("none")
else:
    print("narrow" if kernels.activation_grid("fbgemm") == kernels.NARROW_GRID else "wide")
"""


def check_isa(isa: str, env: dict[str, str]) -> None:
    """Stop unless a child, under `env`, runs `isa`'s kernels: torch's capability, and
    fbgemm's int8 GEMM saturating as AVX2's does (its limit is a variable of its own)."""
    done = subprocess.run(
        [sys.executable, "-c", ISA_PROBE], capture_output=True, text=True, env=env, check=False
    )
    got = done.stdout.split()
    if len(got) != 2 or got[0].lower() != isa:
        raise SystemExit(f"--isa {isa}: torch runs {done.stdout.strip() or done.stderr[-300:]}")
    if got[1] == "wide":
        raise SystemExit(f"--isa {isa}: fbgemm's int8 GEMM is not held to {isa}")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or amx_bf16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--models", default="tiny.en")
    parser.add_argument("--dtypes", default="f32,bf16", help="whisper-cli's (and transformers')")
    parser.add_argument("--fw-types", default="int8,f32", help="faster-whisper's compute types")
    parser.add_argument(
        "--only",
        default="whisper-cli,fw-batched,fw-sequential,whisper.cpp",
        help="rows to run, of whisper-cli,fw-batched,fw-sequential,whisper.cpp,transformers",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--peer-python", "--fw-python", dest="peer_python", default=None)
    parser.add_argument("--ct2-dir", default=str(REPO / ".cache" / "ct2"))
    parser.add_argument(
        "--start-clip",
        type=float,
        default=1.0,
        help="seconds of the speech each row also runs on in every round, its wall time "
        "taken as the row's start-up (import, load, one window); 0: not run",
    )
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_LIMITS),
        default=None,
        help="hold every row to these instructions on a CPU that has more (see above)",
    )
    args = parser.parse_args()
    if args.start_clip < 0:
        parser.error("--start-clip: seconds, 0 or more")
    import torch

    # This checkout's whisper_cli, whatever the Python has installed; the same threads for all.
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": str(args.threads)}
    cpu = cpu_model()
    if args.isa is not None:
        limits = isa_environment(args.isa, REPO / ".cache" / f"isa-{args.isa}")
        env.update(limits)
        check_isa(args.isa, env)
        held = ", ".join(f"{k}={v}" for k, v in limits.items() if k != "CC")
        cpu += f", held to {args.isa} ({held}; C kernels -march={ISA_MARCH[args.isa]})"
    header = [
        f"CPU: {cpu}; {args.threads} threads; torch {torch.__version__}",
        *peer_versions(args.peer_python, env),
    ]
    for line in header:
        print(line, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        reference = build_speech(args.minutes, wav)
        seconds = sf.info(wav).duration
        print(f"audio: {seconds:.0f} s of real English speech", file=sys.stderr)
        runs, skipped = plan(args, wav, set(args.only.split(",")))
        clip = Path(tmp) / "start.wav"
        if args.start_clip:
            audio, rate = sf.read(wav, dtype="float32")
            sf.write(clip, audio[: int(args.start_clip * rate)], rate, subtype="PCM_16")
        for reason in skipped:
            print(f"left out: {reason}", flush=True)
        # Round-robin: repeat r of every run before repeat r + 1 of any, so that a slow
        # spell of a shared machine lands on all rows alike rather than on one.
        walls: dict[tuple, list[float]] = {run.key: [] for run in runs}
        peaks: dict[tuple, list[float]] = {run.key: [] for run in runs}
        starts: dict[tuple, list[float]] = {run.key: [] for run in runs}
        texts: dict[tuple, str] = {}
        # Bytecode for this checkout, as pip writes it for an installed wheel (the peers'
        # packages have theirs): where PYTHONDONTWRITEBYTECODE is set, as on the
        # development VM, each process would otherwise compile again the 12 thousand
        # lines of whisper_cli a transcribe imports, ~0.09 s that no installed user pays.
        if not compileall.compile_dir(REPO / "whisper_cli", quiet=1):
            print("warning: whisper_cli did not all compile to bytecode", file=sys.stderr)
        for _ in range(args.warmup):
            for run in runs:
                wall, _, _ = timed(run.cmd, env)
                print(f"{run.key}: {wall:.1f} s (warm-up)", file=sys.stderr, flush=True)
        for _ in range(args.repeats):
            for run in runs:
                wall, texts[run.key], peak = timed(run.cmd, env)
                walls[run.key].append(wall)
                peaks[run.key].append(peak)
                print(f"{run.key}: {wall:.1f} s, {peak:.0f} MiB", file=sys.stderr, flush=True)
                if args.start_clip:  # right after its long run: the same spell of the machine
                    start, _, _ = timed(clip_command(run.cmd, wav, clip), env)
                    starts[run.key].append(start)
                    print(f"{run.key}: {start:.2f} s on the start clip", file=sys.stderr)
        medians = {key: statistics.median(w) for key, w in walls.items()}
        start_medians = {key: statistics.median(w) for key, w in starts.items() if w}
        for run in runs:
            base = medians.get((BASELINE[0], run.model, BASELINE[1]))
            # Each round's own ratio too: a slow spell of a shared machine moves a whole
            # round, and the spread of these says how far the medians' ratio can be read.
            base_walls = walls.get((BASELINE[0], run.model, BASELINE[1]))
            rounds = None
            if base_walls:
                rounds = [round(w / b, 2) for w, b in zip(walls[run.key], base_walls, strict=True)]
            start = start_medians.get(run.key)
            base_start = start_medians.get((BASELINE[0], run.model, BASELINE[1]))
            beyond = None
            if base and start is not None and base_start is not None:
                beyond = beyond_start(medians[run.key], start, base, base_start)
            row = {
                "impl": run.impl,
                "model": run.model,
                "dtype": run.dtype,
                "wall_s": round(medians[run.key], 1),
                "walls": [round(w, 1) for w in walls[run.key]],
                "ratio": round(medians[run.key] / base, 2) if base else None,
                "round_ratios": rounds,
                "start_s": None if start is None else round(start, 2),
                "beyond_ratio": beyond,
                "rtfx": round(seconds / medians[run.key], 1),
                "peak_mb": round(max(peaks[run.key])),
                "wer": round(100 * wer(reference, texts[run.key]), 2),
                "words": len(texts[run.key].split()),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"reference words: {len(reference.split())}", file=sys.stderr)
    print()
    print(
        f"{seconds:.0f} s of English; median of {args.repeats} after {args.warmup} "
        "untimed; " + header[0]
    )
    print(
        "| impl | model | dtype | wall s (median) | x fw-batched int8 | each round's x "
        "| start s | x beyond start | RTFx | WER % | words | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-" if r["ratio"] is None else r["ratio"]
        rounds = "-" if r["round_ratios"] is None else " / ".join(map(str, r["round_ratios"]))
        start = "-" if r["start_s"] is None else r["start_s"]
        beyond = "-" if r["beyond_ratio"] is None else r["beyond_ratio"]
        print(
            f"| {r['impl']} | {r['model']} | {r['dtype']} | {r['wall_s']} | {ratio} "
            f"| {rounds} | {start} | {beyond} | {r['rtfx']} | {r['wer']} | {r['words']} "
            f"| {r['peak_mb']} |"
        )
    print()
    for line in verdicts(rows, args.minutes, native_bf16() and args.isa is None):
        print(line)


if __name__ == "__main__":
    main()
