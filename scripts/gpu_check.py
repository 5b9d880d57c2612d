"""The GPU check's stages (driven by scripts/gpu_check.sh): one run answers issue 12's questions.

Made for a bare GPU machine with torch, numpy, safetensors, tokenizers and transformers,
no network, no real weights, no soundfile/soxr/av/jiwer/whisper-normalizer. What it needs
from here is prepared once on the CPU machine (`prepare`) into .gpu/carry/ (git-ignored,
named in the device run's `carry`): the base tokenizer, a real-speech clip as 16-bit PCM,
the silero-vad wheel (the speech detector's weights), and plan.json (the audio length
that the pipeline cuts into exactly 32 full windows, and the steps per batch that real
tiny.en / base decode on it, for the projection below).

Weights are random, with the real shapes (large-v3: 32 + 32 layers, d_model 1280, 20
heads, 128 mels, vocabulary 51866; turbo: the same with 4 decoder layers), written as
float16 safetensors on the machine at run time. The token embedding is scaled so that
greedy decoding is confident (no temperature fallback) and never ends or emits a
timestamp pair: every window decodes max_new_tokens, the worst case. Bench rows therefore
report steps per batch and ms per step, and a *projected* RTFx at the steps per batch real
models decode on the same audio (plan.json), next to the measured one.

Stages (PLAN, in order of the value of their answer per second, with their limits):
  setup       environment, models, audio, the window count of the bench audio
  parity-*    teacher-forced logits: CPU f32 reference vs device eager vs device compiled
              (the engine's own compiled step), f32 and bf16; and whether a window's
              encoder output is the same bytes alone as inside its batch
  dtype       the dtype recorder (tests/dtype_recorder.py) over a whole run on the device
  bench-*     whisper_cli.tools.bench.measure, one configuration per stage (process)
  encoder     torch.compile of the encoder against eager, ms per window
Each stage writes <work>/<stage>.json, and a partial result there as it goes (save_partial:
a bench after its warm-up, parity after each path), which a stage killed at its limit
keeps; `summary` gathers them into $OUT.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tarfile
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / ".gpu"
CARRY = Path(os.environ.get("GPU_CHECK_CARRY", GPU / "carry"))
SPEECH_PCM = CARRY / "speech-int16.npy"
TOKENIZER = CARRY / "tokenizer.json"
PLAN_FILE = CARRY / "plan.json"
SAMPLE_RATE = 16000
WINDOWS = 32  # bench audio: two full batches of 16
BATCH = 16
SMALL_WINDOWS, SMALL_BATCH = 4, 2  # the CPU dry run
MAX_NEW_TOKENS = 224  # the product's default (TranscribeOptions)
SYNC_EVERY_CUDA = 8  # the engine reads "all finished" every 8 steps on CUDA
MISSING_OK = ("soundfile", "soxr")  # imported at the top of whisper_cli.audio only


# --- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int  # its own timeout
    expect_s: int  # the planned time on an H200 (a guess: no GPU was lent to write this)
    # Planned time to its first partial result; None: of use only if it runs to its end.
    first_s: int | None
    what: str

    @property
    def needs_s(self) -> int:
        """Not started with less than this left of the budget: a stage that saves no partial
        result must be able to run to its limit, one that does to its first result."""
        return self.limit_s if self.first_s is None else self.first_s


@dataclass(frozen=True)
class BenchRun:
    model: str
    dtype: str
    compile: bool
    against: str | None = None
    refill: bool | None = None  # continuous batching; None: the product's default


BENCH = {
    "bench-large-v3-bf16-compiled": BenchRun("large-v3", "bf16", True),
    "bench-large-v3-f32-compiled": BenchRun("large-v3", "f32", True),
    "bench-large-v3-bf16-eager": BenchRun("large-v3", "bf16", False),
    "bench-turbo-bf16-compiled": BenchRun("turbo", "bf16", True),
    "bench-turbo-bf16-eager": BenchRun("turbo", "bf16", False),
    "bench-large-v3-f16-compiled": BenchRun("large-v3", "f16", True),
    "bench-turbo-f16-compiled": BenchRun("turbo", "f16", True),
    "bench-turbo-bf16-transformers": BenchRun("turbo", "bf16", False, "transformers"),
    # The compiled runs refill rows as they finish (the default where compiled): this one
    # steps batches to their end, for the same tokens and the steps refilling saved.
    "bench-turbo-bf16-batches": BenchRun("turbo", "bf16", True, refill=False),
}

# The whole run's budget (the device runs the driver under its own timeout, 540 s), and
# what the driver keeps of it for the last summary.
BUDGET_S, RESERVE_S = 465, 10

# In order of the value of their answer per second. Planned times are guesses for an H200
# (no GPU was lent while this was written): a compiled large-v3 configuration is mostly its
# compile (32 decoder layers, 40-100 s from cold caches), a bench run itself a few seconds.
# The stages through bench-large-v3-f32-compiled are planned within the budget; the later
# ones run if the guesses were high. A stage whose limit is longer than what is left runs
# to what is left, if that is at least what it needs (Stage.needs_s).
PLAN = (
    Stage("setup", 75, 30, None, "environment; random-weight turbo and large-v3; audio; windows"),
    Stage("parity-turbo", 150, 90, 25, "teacher-forced logits, CPU f32 vs eager vs compiled"),
    Stage("bench-large-v3-bf16-compiled", 200, 105, 95, "headline: target RTFx >= 1000"),
    Stage("bench-turbo-bf16-compiled", 90, 35, 30, "target RTFx >= 3000"),
    Stage("bench-turbo-bf16-eager", 60, 20, 15, "compiled >= 2x eager (turbo)"),
    Stage("dtype", 60, 20, 12, "dtype recorder over whole bf16 and f16 runs, on the device"),
    Stage("bench-large-v3-bf16-eager", 90, 40, 25, "compiled >= 2x eager"),
    Stage("bench-large-v3-f32-compiled", 200, 105, 95, "bf16 >= 1.6x f32"),
    Stage("bench-turbo-bf16-batches", 90, 35, 30, "refilled vs batches: same tokens, steps"),
    Stage("encoder", 90, 60, 25, "large-v3 bf16 encoder, torch.compile vs eager"),
    Stage("parity-large-v3", 180, 150, 40, "teacher-forced logits with 32 decoder layers"),
    Stage("bench-large-v3-f16-compiled", 200, 105, 95, "f16"),
    Stage("bench-turbo-f16-compiled", 90, 35, 30, "f16 (turbo)"),
    Stage("bench-turbo-bf16-transformers", 90, 50, 30, "against the transformers reference"),
)


def small() -> bool:
    return os.environ.get("GPU_CHECK_SMALL", "") not in ("", "0")


def device_name() -> str:
    return os.environ.get("GPU_CHECK_DEVICE", "cuda")


def work_dir() -> Path:
    return Path(os.environ.get("GPU_CHECK_WORK", GPU / "work"))


def models_dir() -> Path:
    return Path(os.environ.get("GPU_CHECK_MODELS", GPU / ("models-small" if small() else "models")))


# name: d_model, encoder layers, decoder layers, heads (real shapes unless small). Setup
# makes them in this order: turbo first, so that a setup killed while it writes the
# larger large-v3 still leaves the turbo stages a model.
SHAPES = {"turbo": (1280, 32, 4, 20), "large-v3": (1280, 32, 32, 20)}
SMALL_SHAPES = {"turbo": (64, 2, 1, 4), "large-v3": (64, 2, 2, 4)}
N_MELS, VOCAB = 128, 51866


# --- imports the machine may lack ----------------------------------------------------------


def _stand_in(name: str) -> types.ModuleType:
    """A module for one this machine lacks: importable, any attribute of it fails.

    A real module object, and AttributeError: inductor's cache key pickles what the graph
    reaches, and pickle asks objects for optional dunders."""
    module = types.ModuleType(name, f"stand-in: {name} is not installed here (gpu_check)")

    def __getattr__(attr: str):
        raise AttributeError(f"{name} is not installed here (gpu_check stand-in): {name}.{attr}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def block_imports(names: list[str]) -> None:
    """Make these packages absent, as on the GPU image (the dry run's proof): `import`
    fails and importlib.util.find_spec finds nothing (a None in sys.modules)."""
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


def stand_in_for_missing() -> list[str]:
    """whisper_cli.audio imports soundfile and soxr at its top; nothing here decodes or
    resamples a file (audio comes as arrays). It is imported over stand-ins that fail when
    used, which then leave sys.modules again: to every later check (transformers asks
    importlib whether soundfile exists) the packages stay absent."""
    saved: dict[str, Any] = {}
    for name in MISSING_OK:
        try:
            __import__(name)
        except ImportError:
            saved[name] = sys.modules.pop(name, _ABSENT)
            sys.modules[name] = _stand_in(name)
    import whisper_cli.audio  # noqa: F401  (binds the stand-ins)

    for name, before in saved.items():
        if before is _ABSENT:
            del sys.modules[name]
        else:
            sys.modules[name] = before
    return list(saved)


_ABSENT = object()


# --- helpers -------------------------------------------------------------------------------


def temporary_for(path: Path) -> Path:
    """Where `path` is written before it is renamed over the old one (os.replace): a
    process killed at its limit while writing leaves the earlier file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_text(path: Path, text: str) -> None:
    temporary = temporary_for(path)
    temporary.write_text(text)
    os.replace(temporary, path)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str))


def save_partial(stage: str, result: dict[str, Any]) -> None:
    """The stage's result so far, kept if it is killed at its limit before it ends.

    GPU_CHECK_STALL names a stage that then hangs, as one compiling past its limit would:
    the tests' way to see a stage killed with a partial result."""
    record = {"stage": stage, "status": "partial", "result": result}
    write_json(work_dir() / f"{stage}.json", record)
    if os.environ.get("GPU_CHECK_STALL") == stage:
        print(f"[gpu_check] {stage}: stalled after its partial result (GPU_CHECK_STALL)")
        while True:
            time.sleep(60)


def tf32_flags() -> dict[str, Any]:
    """The TF32 switches as torch reads them now: the legacy flags (which whisper-cli sets
    for f32 on CUDA, dtypes.ieee_float32) and the newer fp32_precision ones. torch refuses
    some reads after a mix of the two APIs: that refusal is reported as the value."""
    import torch

    backends = torch.backends
    reads = {
        "matmul allow_tf32": lambda: backends.cuda.matmul.allow_tf32,
        "cudnn allow_tf32": lambda: backends.cudnn.allow_tf32,
        "matmul fp32_precision": lambda: backends.cuda.matmul.fp32_precision,
        "cudnn conv fp32_precision": lambda: backends.cudnn.conv.fp32_precision,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
    }
    flags: dict[str, Any] = {}
    for name, read in reads.items():
        try:
            flags[name] = read()
        except (AttributeError, RuntimeError) as exc:
            flags[name] = f"unreadable: {type(exc).__name__}: {exc}"[:160]
    return flags


def read_plan() -> dict[str, Any]:
    if not PLAN_FILE.is_file():
        raise SystemExit(f"{PLAN_FILE} is missing: run `scripts/gpu_check.sh prepare` here first")
    return json.loads(PLAN_FILE.read_text())


def speech_clip() -> Any:
    """The carried real-speech clip as float32 16 kHz."""
    import numpy as np

    return np.load(SPEECH_PCM).astype(np.float32) / 32768.0


def bench_audio() -> tuple[Path, int]:
    """The float32 .npy the bench serves, and how many samples it is tiled to."""
    import numpy as np

    path = work_dir() / "speech.npy"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, speech_clip())
    key = "small" if small() else "full"
    return path, round(read_plan()["duration_s"][key] * SAMPLE_RATE)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- random-weight models -------------------------------------------------------------------

SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60]


def make_model(
    out: Path, shape: tuple[int, int, int, int], device: str, tokenizer: Path = TOKENIZER
) -> Path:
    """A random-weight Hugging Face Whisper directory (float16 safetensors), made on
    `device`, that whisper-cli and transformers both load; `tokenizer`: a multilingual
    (51865) tokenizer.json, shifted to large-v3's vocabulary."""
    if (out / ".complete").is_file():
        return out
    import torch
    from safetensors.torch import save_file

    from whisper_cli.config import ModelConfig
    from whisper_cli.model import Whisper
    from whisper_cli.tokenizer import Tokenizer

    d, enc, dec, heads = shape
    sys.path.insert(0, str(ROOT / "tests"))
    from util import shifted_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    shifted_tokenizer(tokenizer, out / "tokenizer.json")
    tok = Tokenizer(out / "tokenizer.json", multilingual=True)
    sp = tok.special
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": VOCAB,
        "num_mel_bins": N_MELS,
        "d_model": d,
        "encoder_layers": enc,
        "decoder_layers": dec,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": 4 * d,
        "decoder_ffn_dim": 4 * d,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "bos_token_id": sp.eot,
        "eos_token_id": sp.eot,
        "pad_token_id": sp.eot,
        "decoder_start_token_id": sp.sot,
        "suppress_tokens": SUPPRESS,
        "begin_suppress_tokens": [220, sp.eot],
        "torch_dtype": "float16",
    }
    generation = {
        "decoder_start_token_id": sp.sot,
        "eos_token_id": sp.eot,
        "pad_token_id": sp.eot,
        "bos_token_id": sp.eot,
        "suppress_tokens": SUPPRESS,
        "begin_suppress_tokens": [220, sp.eot],
        "no_timestamps_token_id": sp.no_timestamps,
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "is_multilingual": True,
        "task_to_id": {"transcribe": sp.transcribe, "translate": sp.translate},
        "lang_to_id": {f"<|{c}|>": i for c, i in tok.language_ids.items()},
    }
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": N_MELS,
        "sampling_rate": SAMPLE_RATE,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("preprocessor_config.json", preprocessor),
    ):
        write_json(out / name, data)
    with torch.device("meta"):
        names = {
            k: tuple(v.shape)
            for k, v in Whisper(ModelConfig.from_dict(config)).state_dict().items()
        }
    gen = torch.Generator(device).manual_seed(0)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, device=device) * std

    state = {}
    for name, shape_ in names.items():
        if "layer_norm" in name:  # LayerNorm: weight 1, bias 0 (transformers' init)
            t = torch.ones(shape_, device=device) if name.endswith("weight") else None
            t = torch.zeros(shape_, device=device) if t is None else t
        elif name.endswith("bias"):
            t = torch.zeros(shape_, device=device)
        elif name == "decoder.embed_tokens.weight":
            # Logits (tied projection of a unit-variance hidden state) with a spread of 12:
            # the argmax is confident (average log-prob well above -1, no fallback). End of
            # text and timestamps at 0: never above the best text token, so every window
            # decodes max_new_tokens after its first timestamp.
            t = normal(shape_, 12.0 / math.sqrt(d))
            t[sp.eot] = 0.0
            t[sp.timestamp_begin :] = 0.0
        elif name == "decoder.embed_positions.weight":
            # Positions dominate the residual stream (norm 10 sqrt(d) against the token's
            # 12): after the final layer norm the input token adds only ~14 to its own
            # logit, below the best of the others (~4.4 spreads), so each step picks
            # another token (no repetition, a low compression ratio, no fallback).
            t = normal(shape_, 10.0)
        else:  # linear and convolution weights, the encoder's positions: transformers' init
            t = normal(shape_, 0.02)
        state["model." + name] = t.to(torch.float16).cpu().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / ".complete").write_text("")
    return out


# --- stages -------------------------------------------------------------------------------


def stage_setup() -> dict[str, Any]:
    import importlib.util
    import platform
    import subprocess

    import torch

    from whisper_cli.speech import load_detector
    from whisper_cli.tools.bench import tiled_blocks
    from whisper_cli.windows import WindowCutter

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_count": os.cpu_count(),
        "stand_ins": os.environ.get("GPU_CHECK_STAND_INS", ""),
        "small": small(),
        "device": device_name(),
        # torch's defaults, before any model loads: cuDNN allows TF32 for float32
        # convolutions; an f32 load on CUDA turns it off (see parity's flags).
        "tf32_at_start": tf32_flags(),
        "silero_vad": getattr(importlib.util.find_spec("silero_vad"), "origin", None),
    }
    for name in ("transformers", "safetensors", "tokenizers", "numpy", "triton"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # absent or broken: say which
            env[name] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        env["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    timings = {}
    shapes = SMALL_SHAPES if small() else SHAPES
    make_on = device_name() if torch.cuda.is_available() or device_name() == "cpu" else "cpu"
    for name, shape in shapes.items():
        started = time.perf_counter()
        make_model(models_dir() / name, shape, make_on)
        timings[f"make_{name}_s"] = round(time.perf_counter() - started, 1)
        save_partial("setup", {"env": env, "timings": timings})
    # The windows the pipeline cuts from the bench audio, with this machine's detector.
    path, n_samples = bench_audio()
    import numpy as np

    from whisper_cli.options import Policy

    clip = np.load(path)
    started = time.perf_counter()
    cutter = WindowCutter(load_detector(), Policy(), vad=True, source=0)
    windows = list(cutter.cut(tiled_blocks(clip, n_samples)))
    want = SMALL_WINDOWS if small() else WINDOWS
    return {
        "env": env,
        "timings": timings,
        "audio_s": n_samples / SAMPLE_RATE,
        "windows": len(windows),
        "windows_expected": want,
        "windows_ok": len(windows) == want,
        "window_s": [round(w.duration, 2) for w in windows],
        "detector_s": round(time.perf_counter() - started, 2),
    }


def forced_decode(
    loaded, mel, steps: int, compiled: bool, forced=None, runs: int = 1, temperature: float = 0.0
):
    """(logits (B, steps, V), chosen (B, steps), encoder output) on the CPU, and timings.

    Through the engine's own probe (decoding.Probe): every step's logits and choice are
    recorded, and with `forced` the next step is fed the forced token instead.
    temperature > 0: every row draws (the engine's sampled step, seeded by its row)."""
    import numpy as np

    from whisper_cli.decoding import DecodeOptions, Probe
    from whisper_cli.engine import Engine, WindowInput

    device = loaded.model.device
    rows = mel.shape[0]
    engine = Engine(
        loaded, DecodeOptions(max_new_tokens=steps), compile=compiled, shrink=False, timed=True
    )
    probe = Probe.make(rows, steps, loaded.config.vocab_size, loaded.model.dtype, device, forced)
    walls = []
    features = engine.encode(mel.to(device))
    silent = np.zeros(0, np.float32)
    inputs = [
        WindowInput(silent, features=f, language="en", temperature=temperature, seed=r)
        for r, f in enumerate(features)
    ]
    for _ in range(runs):
        sync(device)
        started = time.perf_counter()
        engine.run(inputs, probe=probe)
        sync(device)
        walls.append(time.perf_counter() - started)
    c = engine.counters
    info = {
        "walls_s": [round(w, 3) for w in walls],
        "ms_per_step_last": round(1000 * walls[-1] / steps, 3),
        "graphs": c.graphs,
        "recompiles": c.recompiles,
        "graph_breaks": c.graph_breaks,
        "cudagraph_skips": c.cudagraph_skips,
    }
    return probe.logits.float().cpu(), probe.chosen.cpu(), features.float().cpu(), info


PARITY_PATHS = (("f32", False), ("f32", True), ("bf16", False), ("bf16", True))
SAMPLED_TEMPERATURE = 1.0  # the fallback's last temperature: the widest draws
# Compiled and eager logits may differ by up to the f32 tolerance (1e-3), which moves a
# cumulative probability by about as much: a draw within that of a boundary may flip
# (~1e-3 of draws). A wrong uniform or distribution would disagree on most real draws.
DRAWN_AGREEMENT = 0.98


def parity(
    model_dir: Path,
    device: str,
    clip,
    rows: int = 4,
    steps: int = 32,
    paths: tuple[tuple[str, bool], ...] = PARITY_PATHS,
    on_partial=None,
    sampled: tuple[str, ...] = ("f32",),
) -> dict[str, Any]:
    """CPU f32 (free-running greedy: the reference tokens) against the device's engine on
    `paths` (dtype, compiled), all teacher-forced to the reference tokens. `clip`: real
    speech (float32, 16 kHz), tiled into `rows` windows.

    `sampled` dtypes also run the sampled step (the fallback's draws, at
    SAMPLED_TEMPERATURE) eager and compiled, forced alike: the compiled graph must draw
    the tokens the eager step draws (DRAWN_AGREEMENT of them) in one graph."""
    import numpy as np
    import torch

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.features import N_SAMPLES, batch_log_mel
    from whisper_cli.loading import load_model

    reps = -(-rows * N_SAMPLES // len(clip))
    audio = np.tile(clip, reps)
    windows = [audio[i * N_SAMPLES : (i + 1) * N_SAMPLES] for i in range(rows)]
    mel = batch_log_mel(windows, rows, N_MELS, torch.device("cpu"))
    out: dict[str, Any] = {"model": model_dir.name, "rows": rows, "steps": steps}
    started = time.perf_counter()
    ref_loaded = load_model(str(model_dir), resolve_policy("f32", "cpu"))
    ref_logits, ref_tokens, ref_features, info = forced_decode(ref_loaded, mel, steps, False)
    del ref_loaded
    out["cpu_f32"] = {**info, "s": round(time.perf_counter() - started, 1)}
    top2 = ref_logits.topk(2, dim=-1).values
    out["reference_min_margin"] = round(float((top2[..., 0] - top2[..., 1]).min()), 5)
    scale = float(ref_logits.abs().max())
    out["reference_max_abs_logit"] = round(scale, 3)

    def compare(logits, tokens, features, against_logits, against_tokens, against_features):
        diff = (logits - against_logits).abs()
        return {
            "max_abs_logit_diff": float(diff.max()),
            "mean_abs_logit_diff": float(diff.mean()),
            "max_abs_encoder_diff": float((features - against_features).abs().max()),
            "token_agreement": float((tokens == against_tokens).float().mean()),
            "tokens_identical": bool(torch.equal(tokens, against_tokens)),
        }

    for dtype in dict.fromkeys(d for d, _ in paths):
        policy = resolve_policy(dtype, device)
        started = time.perf_counter()
        loaded = load_model(str(model_dir), policy)
        load_s = time.perf_counter() - started
        out.setdefault("tf32", {})[dtype] = tf32_flags()  # as the device paths run
        results = {}
        for compiled in (c for d, c in paths if d == dtype):
            name = f"{device}_{dtype}_{'compiled' if compiled else 'eager'}"
            started = time.perf_counter()
            try:
                logits, tokens, features, info = forced_decode(
                    loaded, mel, steps, compiled, forced=ref_tokens, runs=2
                )
            except Exception as exc:  # one failing path must not hide the others
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
                traceback.print_exc()
                continue
            entry = {**info, "s": round(time.perf_counter() - started, 1)}
            entry["vs_cpu_f32"] = compare(
                logits, tokens, features, ref_logits, ref_tokens, ref_features
            )
            if compiled and "eager" in results:
                entry["vs_eager"] = compare(logits, tokens, features, *results["eager"])
            results["compiled" if compiled else "eager"] = (logits, tokens, features)
            out[name] = entry
            if on_partial:  # kept if a later path runs past the stage's limit
                on_partial(out)
        out[f"{device}_window_alone_{dtype}"] = window_alone(loaded, mel)
        if dtype in sampled:
            out[f"{device}_sampled_{dtype}"] = sampled_parity(loaded, mel, steps, ref_tokens)
            if on_partial:
                on_partial(out)
        out[f"{device}_{dtype}_load_s"] = round(load_s, 1)
        del loaded
        if device == "cuda":
            torch.cuda.empty_cache()
    f32 = [v for k, v in out.items() if "_f32_" in k and k != "cpu_f32" and isinstance(v, dict)]
    out["f32_tolerance"] = 1e-3
    drawn = out.get(f"{device}_sampled_f32")
    out["f32_pass"] = bool(f32) and all(
        "error" not in v
        and v["vs_cpu_f32"]["max_abs_logit_diff"] <= 1e-3
        and v["vs_cpu_f32"]["tokens_identical"]
        and v.get("vs_eager", {"tokens_identical": True})["tokens_identical"]
        for v in f32
    )
    if drawn is not None:  # the compiled graph draws what the eager step draws
        out["f32_pass"] = out["f32_pass"] and drawn.get("drawn_agreement", 0.0) >= DRAWN_AGREEMENT
    bf16 = {
        k: v["vs_cpu_f32"]["token_agreement"]
        for k, v in out.items()
        if "_bf16_" in k and isinstance(v, dict) and "vs_cpu_f32" in v
    }
    out["bf16_token_agreement"] = bf16
    return out


def window_alone(loaded, mel) -> dict[str, Any]:
    """Is the first window's encoder output on the device the same bytes alone as inside
    the batch of all of `mel`'s windows? On the CPU the model encodes a window at a time
    (model.window_parts), so it is by construction; on CUDA one call takes the batch, and
    this tells whether its kernels round a window by its batch (a row's text would then
    move with its batch there). Informational: no pass depends on it."""
    import torch

    model = loaded.model
    with torch.inference_mode():
        x = mel.to(model.device, model.dtype)
        inside, alone = model.encoder(x)[:1], model.encoder(x[:1])
    return {
        "windows": mel.shape[0],
        "identical": bool(torch.equal(inside, alone)),
        "max_abs_diff": float((inside.float() - alone.float()).abs().max()),
    }


def sampled_parity(loaded, mel, steps: int, forced) -> dict[str, Any]:
    """The sampled step eager and compiled on the same model, teacher-forced to `forced`:
    do the compiled graph's draws (a searchsorted over the float32 cumulative softmax)
    equal the eager step's, in one graph?"""
    import torch

    out: dict[str, Any] = {"temperature": SAMPLED_TEMPERATURE}
    drawn = {}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        started = time.perf_counter()
        try:
            _, chosen, _, info = forced_decode(
                loaded, mel, steps, compiled, forced, temperature=SAMPLED_TEMPERATURE
            )
        except Exception as exc:  # reported, and the other stages go on
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
            traceback.print_exc()
            return out
        out[name] = {**info, "s": round(time.perf_counter() - started, 1)}
        drawn[name] = chosen
    out["drawn_identical"] = bool(torch.equal(drawn["compiled"], drawn["eager"]))
    out["drawn_agreement"] = float((drawn["compiled"] == drawn["eager"]).float().mean())
    # How often a draw differs from the forced (greedy f32) token: the draws are real ones.
    out["drawn_not_greedy"] = float((drawn["eager"] != forced).float().mean())
    return out


def stage_parity(model: str) -> dict[str, Any]:
    rows, steps = (2, 8) if small() else (4, 32)

    # The sampled step once, on turbo's 4 decoder layers (large-v3's 32 compile longer).
    sampled = ("f32",) if model == "turbo" else ()
    return parity(
        models_dir() / model,
        device_name(),
        speech_clip(),
        rows,
        steps,
        on_partial=lambda out: save_partial(f"parity-{model}", out),
        sampled=sampled,
    )


def stage_dtype() -> dict[str, Any]:
    """The CPU test's dtype check (tests/test_dtype.py) over whole runs on the device."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from dtype_recorder import DtypeRecorder, exceptions_marked

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.pipeline import TranscribeOptions, Transcriber
    from whisper_cli.tools.bench import ArraySource, transcribe_source

    clip = speech_clip()
    seconds = 12 if small() else 40  # two windows
    out: dict[str, Any] = {}
    for dtype, words in (("bf16", True), ("f16", False)):
        policy = resolve_policy(dtype, device_name())
        loaded = load_model(str(models_dir() / "turbo"), policy)
        options = TranscribeOptions(
            max_new_tokens=16 if small() else 64, word_timestamps=words, language="en"
        )
        transcriber = Transcriber(loaded, options)
        caches: list = []
        decoder = loaded.model.decoder

        def recorded(*args, caches=caches, make=decoder.new_caches):
            caches.append(make(*args))
            return caches[-1]

        decoder.new_caches = recorded
        source = ArraySource(clip, seconds * SAMPLE_RATE)
        started = time.perf_counter()
        with exceptions_marked(DtypeRecorder()) as rec:
            rec.expected = policy.dtype
            with rec:
                result = transcribe_source(transcriber, source)
        model = loaded.model
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        kv = [t for c in caches for t in c.tensors()]
        ops = sorted({op for op, _ in rec.seen})
        out[dtype] = {
            "s": round(time.perf_counter() - started, 1),
            "violations": {f"{op} {dt}": n for (op, dt), n in rec.violations.items()},
            "ops_recorded": sum(rec.seen.values()),
            "distinct_ops": len(ops),
            "weights_dtypes": sorted({str(t.dtype) for t in tensors.values()}),
            "cache_dtypes": sorted({str(t.dtype) for t in kv}),
            "caches": len(caches),
            "sdpa_seen": any("scaled_dot_product" in o for o in ops),
            "segments": len(result.segments),
            "words": sum(len(s.words or ()) for s in result.segments),
            "pass": not rec.violations
            and {t.dtype for t in tensors.values()} == {policy.dtype}
            and bool(kv)
            and {t.dtype for t in kv} == {policy.dtype},
        }
        save_partial("dtype", out)
        del transcriber, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def projected(result: dict[str, Any], plan: dict[str, Any], on_cuda: bool) -> dict[str, Any]:
    """RTFx projected to the steps per batch that real models decode on this audio."""
    engine = result["engine"]
    decodes = max(engine.get("decodes", 0), 1)
    measured_steps = (engine["prefills"] + engine["steps"]) / decodes
    out = {"measured_steps_per_batch": round(measured_steps, 1)}
    for name, real in plan.get("real_steps_per_batch", {}).items():
        steps = real
        if on_cuda:  # the device loop reads "all finished" every 8 steps: it stops at the
            # first multiple of 8 forwards (the prefill counted) after the longest row ends
            steps = min(math.ceil(real / SYNC_EVERY_CUDA) * SYNC_EVERY_CUDA, measured_steps)
        decode_s = engine["decode_s"]
        wall = result["wall_s"] - decode_s + decode_s * steps / measured_steps
        out[f"projected_rtfx_at_{name}"] = round(result["audio_s"] / wall, 1)
        out[f"projected_steps_per_batch_{name}"] = round(steps, 1)
    return out


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent in this process (dynamo's own metrics); None if it
    never compiled."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import compile_times

    times = compile_times(repr="csv", aggregate=True)
    total = dict(zip(*times, strict=True)).get("_compile.compile_inner") if times else None
    return None if total is None else round(float(total), 1)


def tokens_path(stage: str) -> Path:
    return work_dir() / f"{stage}.tokens.json"


def stage_bench(name: str) -> dict[str, Any]:
    """One bench configuration; a partial result after its warm-up (load, compile and
    warm-up wall, the counters), and each window's tokens of the warm-up run."""
    from whisper_cli.engine import Engine
    from whisper_cli.tools import bench

    run = BENCH[name]
    audio, n_samples = bench_audio()
    batch = SMALL_BATCH if small() else BATCH
    # large-v3 on CUDA: one timed run after the warm-up (each is 2 x 224 steps of 32 layers;
    # two more for a median would cost the time the later stages need).
    one = small() or (run.model == "large-v3" and device_name() == "cuda")
    config = bench.BenchConfig(
        model=str(models_dir() / run.model),
        dtypes=(run.dtype,),
        batch_size=batch,
        audio=str(audio),
        duration=n_samples / SAMPLE_RATE,
        max_new_tokens=16 if small() else MAX_NEW_TOKENS,
        compile="on" if run.compile else "off",
        refill=run.refill,
        repeats=1 if one else 3,
        against=run.against,
        device=device_name(),
    )
    result_path = work_dir() / f"{name}.result.json"
    spec = bench._child_spec(config, run.dtype, audio, n_samples, result_path)
    windows: list[list[int]] = []  # each decoded window's tokens, in decode order
    decode = Engine.run

    def recorded(self, *args, **kwargs):
        batch = decode(self, *args, **kwargs)
        windows.extend(list(row.tokens) for row in batch.rows)
        return batch

    compile_s: list[float | None] = []

    def warmed_up(partial: dict[str, Any]) -> None:
        Engine.run = decode  # the timed runs as shipped
        write_text(tokens_path(name), json.dumps(windows))
        compile_s.append(compile_seconds())
        partial["compile_s"] = compile_s[0]
        partial["warmup_rtfx"] = partial["audio_s"] / partial["warmup_wall_s"]
        save_partial(name, {"partial": "warm-up only", **partial})

    Engine.run = recorded
    try:
        result = dataclasses.asdict(bench.measure(spec, on_warmup=warmed_up))
    finally:
        Engine.run = decode
    result.pop("text")
    result["compile_s"] = compile_s[0]
    plan = read_plan()
    result["per_batch"] = projected(result, plan, device_name() == "cuda")
    result["full_batches"] = result["windows"] == result["batches"] * batch
    return result


def stage_encoder() -> dict[str, Any]:
    """The large-v3 bf16 encoder on a batch of 16 windows: eager, then torch.compile."""
    import numpy as np
    import torch

    from whisper_cli.decoding import DecodeOptions
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.engine import Engine
    from whisper_cli.features import N_SAMPLES, batch_log_mel
    from whisper_cli.loading import load_model

    batch = SMALL_BATCH if small() else BATCH
    device = torch.device(device_name())
    loaded = load_model(str(models_dir() / "large-v3"), resolve_policy("bf16", device_name()))
    clip = speech_clip()
    audio = np.tile(clip, -(-batch * N_SAMPLES // len(clip)))
    windows = [audio[i * N_SAMPLES : (i + 1) * N_SAMPLES] for i in range(batch)]
    mel = batch_log_mel(windows, batch, N_MELS, device)
    engine = Engine(loaded, DecodeOptions(), timed=True)
    repeats = 2 if small() else 10

    def time_encode() -> tuple[float, float, torch.Tensor]:
        started = time.perf_counter()
        features = engine.encode(mel)  # the first call: compile, warm-up
        first = time.perf_counter() - started
        engine.encode(mel)
        before = engine.counters.encode_s
        for _ in range(repeats):
            engine.encode(mel)
        per_window = 1000 * (engine.counters.encode_s - before) / (repeats * batch)
        return first, per_window, features

    out: dict[str, Any] = {"batch": batch, "repeats": repeats}
    first, eager_ms, eager = time_encode()
    out["eager"] = {"ms_per_window": round(eager_ms, 3), "first_s": round(first, 2)}
    save_partial("encoder", out)
    encoder = loaded.model.encoder
    for mode in ("default", "max-autotune-no-cudagraphs"):
        if small() and mode != "default":
            continue
        torch._dynamo.reset()
        loaded.model.encoder = torch.compile(encoder, mode=mode, fullgraph=True, dynamic=False)
        try:
            first, ms, features = time_encode()
        except Exception as exc:
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
            traceback.print_exc()
            continue
        finally:
            loaded.model.encoder = encoder
        out[mode] = {
            "ms_per_window": round(ms, 3),
            "compile_and_first_s": round(first, 1),
            "speedup_vs_eager": round(eager_ms / ms, 3),
            "max_abs_diff_vs_eager": float((features.float() - eager.float()).abs().max()),
        }
        save_partial("encoder", out)  # max-autotune, next, tunes for long
    return out


# --- the summary ----------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else str(value)


def token_agreement(a: str, b: str) -> str:
    """Per-window token agreement of two bench stages' warm-up runs, in words: informational,
    not a verdict. With random weights ~9% of the steps have their top two logits within
    one bf16 step, where a compiled graph's other rounding may choose the other; a window
    then goes on from another token (real weights are rarely that close)."""
    paths = tokens_path(a), tokens_path(b)
    if not all(p.is_file() for p in paths):
        return f"tokens of {a} vs {b}: not recorded"
    x, y = (json.loads(p.read_text()) for p in paths)
    if len(x) != len(y):
        return f"tokens of {a} vs {b}: {len(x)} against {len(y)} windows"
    identical, agreement, prefix = 0, 0.0, 0
    for s, t in zip(x, y, strict=True):
        same = [u == v for u, v in zip(s, t, strict=False)]
        identical += s == t
        agreement += sum(same) / max(len(s), len(t), 1)
        prefix += same.index(False) if False in same else len(same)
    n = max(len(x), 1)
    return (
        f"per-window tokens (informational, not a verdict): {identical}/{len(x)} windows "
        f"identical, mean agreement {agreement / n:.3f}, mean common prefix {prefix / n:.1f} "
        f"tokens"
    )


def refill_lines(stages: dict[str, Any], refilled: str, batches: str) -> list[str]:
    """Continuous batching on the device: steps and row-steps of a refilled bench stage
    against the same configuration stepped in batches, and their per-window tokens."""
    counts = []
    for name in (refilled, batches):
        result = stages.get(f"bench-{name}", {}).get("result") or {}
        engine = result.get("engine") or {}
        counts.append(engine if "steps" in engine else None)
    line = "- refilled / batches (turbo bf16 compiled): "
    if all(counts):
        a, b = counts
        line += (
            f"steps {a['steps']:.0f} vs {b['steps']:.0f}, row-steps {a['row_steps']:.0f} vs "
            f"{b['row_steps']:.0f}, rows refilled {a.get('refills', 0):.0f}"
        )
    else:
        line += "not measured"
    return [line, f"  - {token_agreement(f'bench-{refilled}', f'bench-{batches}')}"]


def summarise(out_dir: Path) -> None:
    """$OUT/summary.json (every stage's result), summary.md (the answers), logs.tar.gz."""
    work = work_dir()
    stages: dict[str, Any] = {}
    for stage in PLAN:
        path = work / f"{stage.name}.json"
        if path.is_file():
            try:
                stages[stage.name] = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                stages[stage.name] = {"status": "unreadable", "error": str(exc)}
    # The shell's view: exit status (-1 skipped, -2 not selected), limit, elapsed, why not run.
    driver = work / "driver.tsv"
    if driver.is_file():
        for line in driver.read_text().splitlines():
            name, rc, limit, elapsed, why = line.split("\t")
            st = stages.setdefault(name, {"stage": name})
            st.update(limit_s=int(limit), driver_s=int(elapsed), rc=int(rc))
            kept = ", partial result kept" if st.get("status") == "partial" else ""
            if int(rc) < 0:
                st["status"] = why
            elif rc in ("124", "137"):
                st["status"] = f"timed out after {limit} s{kept}"
            elif st.get("status") in (None, "running", "partial"):
                st["status"] = f"exited {rc}{kept or ' without a result'}"
    write_json(out_dir / "summary.json", stages)
    lines = ["# GPU check", ""]
    setup = stages.get("setup", {}).get("result", {})
    env = setup.get("env", {})
    lines.append(
        f"machine: {env.get('gpu')} ({env.get('nvidia_smi')}), torch {env.get('torch')} "
        f"(CUDA {env.get('cuda')}), python {env.get('python')}, transformers "
        f"{env.get('transformers')}; stand-ins for {env.get('stand_ins') or 'nothing'}"
    )
    if setup:
        lines.append(
            f"bench audio: {setup.get('audio_s')} s of real speech, {setup.get('windows')} windows "
            f"(expected {setup.get('windows_expected')})"
        )
    lines += ["", "| stage | status | s | limit s |", "|---|---|---|---|"]
    not_run = []
    for stage in PLAN:
        st = stages.get(stage.name, {})
        status = st.get("status", "not reached")
        lines.append(
            f"| {stage.name} | {status} | {_fmt(st.get('driver_s', ''))} "
            f"| {st.get('limit_s', stage.limit_s)} |"
        )
        if st.get("rc", -1) < 0 and "result" not in st:
            not_run.append(f"{stage.name} ({status})")
    lines += ["", f"not run: {'; '.join(not_run) or 'none'}"]
    for model in ("turbo", "large-v3"):
        p = stages.get(f"parity-{model}", {}).get("result")
        if not p:
            continue
        lines += ["", f"## parity {model} ({p['rows']} rows x {p['steps']} teacher-forced steps)"]
        lines.append(
            f"f32 pass (max |logit diff| <= 1e-3 and identical tokens): "
            f"**{p.get('f32_pass', 'unfinished')}**; reference |logits| up to "
            f"{p['reference_max_abs_logit']}, "
            f"smallest top-2 margin {p['reference_min_margin']}"
        )
        for dtype, flags in p.get("tf32", {}).items():
            lines.append(f"- TF32 flags while the {dtype} paths ran: {flags}")
        lines += [
            "",
            "| path | max abs logit diff vs CPU f32 | max abs encoder diff vs CPU f32 "
            "| token agreement | vs eager (tokens, max diff) | graphs | recompiles | breaks "
            "| cudagraph skips | ms/step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, v in p.items():
            if not isinstance(v, dict) or "vs_cpu_f32" not in v:
                if isinstance(v, dict) and "error" in v:
                    lines.append(f"| {key} | error: {v['error'][:200]} |")
                continue
            c, e = v["vs_cpu_f32"], v.get("vs_eager")
            eager = f"{e['token_agreement']:.4f}, {e['max_abs_logit_diff']:.2e}" if e else ""
            lines.append(
                f"| {key} | {c['max_abs_logit_diff']:.2e} | {c['max_abs_encoder_diff']:.2e} "
                f"| {c['token_agreement']:.4f} | {eager} "
                f"| {v['graphs']} | {v['recompiles']} | {v['graph_breaks']} "
                f"| {v['cudagraph_skips']} | {v['ms_per_step_last']} |"
            )
        for key, v in p.items():
            if "_window_alone_" in key and isinstance(v, dict):
                lines.append(
                    f"- {key}: window 0's encoder output alone against inside the batch of "
                    f"{v['windows']}: identical **{v['identical']}** (max abs diff "
                    f"{v['max_abs_diff']:.2e})"
                )
        for key, v in p.items():
            if "_sampled_" not in key or not isinstance(v, dict):
                continue
            c = v.get("compiled", {})
            errors = [
                f"{n}: {v[n]['error'][:200]}"
                for n in ("eager", "compiled")
                if "error" in v.get(n, {})
            ]
            lines.append(
                f"- {key} (T {v.get('temperature')}): compiled draws agree with eager "
                f"**{v.get('drawn_agreement', 'unfinished')}** (identical "
                f"{v.get('drawn_identical')}, not greedy {v.get('drawn_not_greedy')}); "
                f"graphs {c.get('graphs')}, breaks {c.get('graph_breaks')}, cudagraph skips "
                f"{c.get('cudagraph_skips')}, {c.get('ms_per_step_last')} ms/step"
                + "".join(f"; error {e}" for e in errors)
            )
    d = stages.get("dtype", {}).get("result")
    if d:
        lines += ["", "## dtype recorder on the device"]
        for dtype, v in d.items():
            lines.append(
                f"- {dtype}: pass **{v['pass']}**, {v['ops_recorded']} op outputs, violations "
                f"{v['violations'] or 'none'}, caches {v['cache_dtypes']}, words {v['words']}"
            )
    bench_rows = [(n, stages[n]["result"]) for n in BENCH if stages.get(n, {}).get("result")]
    if bench_rows:
        lines += [
            "",
            "## bench (random weights: every window decodes max_new_tokens)",
            "",
            "| config | RTFx | wall s | detector s | windows/batches | steps/batch | ms/step "
            "| enc ms/win | projected RTFx (real steps/batch) | warm-up s (compile s) "
            "| graphs/recompiles/breaks/cg skips | fallbacks | text sha256 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in bench_rows:
            w = r["engine_warmup"]
            counts = (
                f"{w.get('graphs')}/{w.get('recompiles')}/{w.get('graph_breaks')}/"
                f"{w.get('cudagraph_skips')}"
            )
            if "partial" in r:  # killed in its timed runs: what the warm-up told
                lines.append(
                    f"| {name.removeprefix('bench-')} | {r['partial']}: RTFx {r['warmup_rtfx']:.0f}"
                    f" (the warm-up, any compile in it) | {r['warmup_wall_s']:.3f} | | "
                    f"{w.get('decoded_rows')}/{w.get('decodes')} | | | | | load "
                    f"{r['load_s']:.1f}, compile {r['compile_s']}, warm-up wall "
                    f"{r['warmup_wall_s']:.1f} | {counts} | | |"
                )
                continue
            e, pb = r["engine"], r["per_batch"]
            proj = ", ".join(
                f"{k.removeprefix('projected_rtfx_at_')}: {v}"
                for k, v in pb.items()
                if k.startswith("projected_rtfx")
            )
            lines.append(
                f"| {name.removeprefix('bench-')} | {r['rtfx']:.0f} | {r['wall_s']:.3f} "
                f"| {r['detector_s']:.3f} "
                f"| {r['windows']}/{r['batches']} | {pb['measured_steps_per_batch']} "
                f"| {r['decode_ms_per_step']:.3f} | {r['encoder_ms_per_window']:.2f} | {proj} "
                f"| {r['warmup_s']:.1f} (compile {r.get('compile_s')}) "
                f"| {counts} (+{e.get('graphs')} timed) "
                f"| {r['fallbacks']} | {r['text_sha256'][:12]} |"
            )
            if r.get("comparison"):
                c = r["comparison"]
                lines.append(
                    f"|   vs {c['reference']} | speed-up {c['speedup']:.2f}x | "
                    f"{c['reference_wall_s']:.2f} s | identical {c['texts_identical']} |"
                )
        lines += ["", "targets (issue 12):"]
        res = dict(bench_rows)

        def rtfx(n):
            return res.get(f"bench-{n}", {}).get("rtfx")

        for label, got, goal in (
            ("large-v3 bf16 compiled RTFx", rtfx("large-v3-bf16-compiled"), 1000),
            ("turbo bf16 compiled RTFx", rtfx("turbo-bf16-compiled"), 3000),
        ):
            lines.append(f"- {label} >= {goal}: {_fmt(got, 0) if got else 'not measured'}")
        for label, a, b, goal in (
            (
                "bf16 / f32 (large-v3 compiled)",
                "large-v3-bf16-compiled",
                "large-v3-f32-compiled",
                1.6,
            ),
            (
                "compiled / eager (large-v3 bf16)",
                "large-v3-bf16-compiled",
                "large-v3-bf16-eager",
                2.0,
            ),
            ("compiled / eager (turbo bf16)", "turbo-bf16-compiled", "turbo-bf16-eager", 2.0),
        ):
            ra, rb = rtfx(a), rtfx(b)
            ratio = f"{ra / rb:.2f}" if ra and rb else "not measured"
            lines.append(f"- {label} >= {goal}: {ratio}")
            if "eager" in b:
                lines.append(f"  - {token_agreement(f'bench-{a}', f'bench-{b}')}")
        lines += refill_lines(stages, "turbo-bf16-compiled", "turbo-bf16-batches")
    enc = stages.get("encoder", {}).get("result")
    if enc:
        lines += ["", f"## encoder (large-v3 bf16, batch {enc['batch']})"]
        for key in ("eager", "default", "max-autotune-no-cudagraphs"):
            if key in enc:
                lines.append(f"- {key}: {enc[key]}")
    write_text(out_dir / "summary.md", "\n".join(lines) + "\n")
    logs = out_dir / "logs.tar.gz"
    temporary = temporary_for(logs)
    with tarfile.open(temporary, "w:gz") as tar:
        for path in sorted(work.glob("*")):
            if path.suffix in (".json", ".log") and path.stat().st_size < 20 * 2**20:
                tar.add(path, arcname=f"gpu_check/{path.name}")
    os.replace(temporary, logs)


# --- prepare (here, on the CPU machine) -------------------------------------------------------


def prepare() -> None:
    """.gpu/carry/: tokenizer, speech clip (16-bit), silero-vad wheel, plan.json."""
    import shutil
    import subprocess
    from importlib.metadata import version

    import numpy as np

    from whisper_cli.kernels import cpu_model
    from whisper_cli.options import Policy
    from whisper_cli.speech import load_detector
    from whisper_cli.tools.bench import load_bench_audio, tiled_blocks
    from whisper_cli.windows import WindowCutter

    CARRY.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "models" / "base" / "tokenizer.json", TOKENIZER)
    clip, description = load_bench_audio(None)  # the bench's default real speech
    np.save(SPEECH_PCM, np.clip(np.round(clip * 32768.0), -32768, 32767).astype(np.int16))
    clip = np.load(SPEECH_PCM).astype(np.float32) / 32768.0
    wheel = f"silero_vad-{version('silero-vad')}-py3-none-any.whl"
    if not (CARRY / wheel).is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                str(CARRY),
                f"silero-vad=={version('silero-vad')}",
            ],
            check=True,
        )
    detector = load_detector()

    def windows(seconds: float) -> int:
        cutter = WindowCutter(detector, Policy(), vad=True, source=0)
        return sum(1 for _ in cutter.cut(tiled_blocks(clip, round(seconds * SAMPLE_RATE))))

    def seconds_for(n: int, start: float) -> float:
        """The length nearest `start` (5 s steps) that the pipeline cuts into n windows."""
        for delta in range(0, 300, 5):
            for s in (start - delta, start + delta):
                if s > 0 and windows(s) == n:
                    return s
        raise SystemExit(f"no length near {start} s gives {n} windows")

    duration = {"full": seconds_for(WINDOWS, 860.0), "small": seconds_for(SMALL_WINDOWS, 100.0)}
    real = real_steps(clip, round(duration["full"] * SAMPLE_RATE))
    plan = {
        "audio": description,
        "clip_s": round(len(clip) / SAMPLE_RATE, 2),
        "duration_s": duration,
        "windows": {"full": WINDOWS, "small": SMALL_WINDOWS},
        "real_steps_per_batch": {k: v["steps_per_batch"] for k, v in real.items()},
        "real_runs": real,
        "max_new_tokens": MAX_NEW_TOKENS,
        "cpu": cpu_model(),
    }
    write_json(PLAN_FILE, plan)
    print(json.dumps(plan, indent=2))
    for path in sorted(CARRY.iterdir()):
        print(f"{path.stat().st_size / 2**20:8.2f} MiB  {path}")


def real_steps(clip, n_samples: int) -> dict[str, dict[str, Any]]:
    """Steps per batch that the real base model decodes on the bench audio (f32, CPU, batch
    16, the product's max_new_tokens): a full batch runs until its longest row ends.

    base, multilingual like large-v3: the audio holds German, on which the English-only
    tiny.en loops and falls back (50 fallbacks of 32 windows when this was written).
    """
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.pipeline import TranscribeOptions, Transcriber
    from whisper_cli.tools.bench import ArraySource, transcribe_source

    name = "base"
    loaded = load_model(str(ROOT / "models" / name), resolve_policy("f32", "cpu"))
    transcriber = Transcriber(
        loaded, TranscribeOptions(batch_size=BATCH, max_new_tokens=MAX_NEW_TOKENS)
    )
    engine = transcriber.engine
    started = time.perf_counter()
    transcript = transcribe_source(transcriber, ArraySource(clip, n_samples))
    c = engine.counters
    return {
        name: {
            "wall_s": round(time.perf_counter() - started, 1),
            "decodes": c.decodes,
            # forwards (the prefill and the steps) per batch
            "steps_per_batch": round((c.prefills + c.steps) / max(c.decodes, 1), 1),
            "row_steps": c.row_steps,
            "tokens_per_window": round(
                engine.counters.tokens / max(transcriber.counters.windows, 1), 1
            ),
            "windows": transcriber.counters.windows,
            "fallbacks": transcriber.counters.fallbacks,
            "words": len(transcript.text.split()),
        }
    }


# --- entry point ------------------------------------------------------------------------------


def run_stage(name: str) -> int:
    """Run one stage in this process; its JSON says ok or failed (with the traceback)."""
    work = work_dir()
    started = time.perf_counter()
    path = work / f"{name}.json"
    record: dict[str, Any] = {"stage": name, "status": "running"}
    write_json(path, record)
    try:
        if name == "setup":
            result = stage_setup()
        elif name.startswith("parity-"):
            result = stage_parity(name.removeprefix("parity-"))
        elif name == "dtype":
            result = stage_dtype()
        elif name in BENCH:
            result = stage_bench(name)
        elif name == "encoder":
            result = stage_encoder()
        else:
            raise SystemExit(f"unknown stage {name!r}")
        record.update(status="ok", result=result)
        code = 0
    except BaseException as exc:  # recorded, so that the summary says why
        saved = json.loads(path.read_text())
        if saved.get("status") == "partial":  # what it had saved stays in the result
            record["result"] = saved["result"]
        record.update(
            status="failed",
            error=f"{type(exc).__name__}: {exc}"[-3000:],
            traceback=traceback.format_exc()[-6000:],
        )
        traceback.print_exc()
        code = 1
    record["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(path, record)
    print(f"[gpu_check] {name}: {record['status']} in {record['wall_s']} s", flush=True)
    return code


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__)
        return 2
    blocked = [n for n in os.environ.get("GPU_CHECK_BLOCK", "").split(",") if n]
    if blocked:
        block_imports(blocked)
    command = argv[0]
    if command == "plan":  # for the shell driver: the budget, then one line a stage
        print(BUDGET_S, RESERVE_S)
        for st in PLAN:
            print(st.name, st.limit_s, st.needs_s, st.expect_s, st.what.replace(" ", "_"))
        return 0
    if command == "summary":
        summarise(Path(argv[1]))
        return 0
    sys.path.insert(0, str(ROOT))  # this checkout's whisper_cli
    stand_ins = stand_in_for_missing()
    os.environ["GPU_CHECK_STAND_INS"] = ",".join(stand_ins)
    if command == "prepare":
        prepare()
        return 0
    if command == "stage":
        return run_stage(argv[1])
    print(f"unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
