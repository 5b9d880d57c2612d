"""`whisper-cli bench`: how fast the pipeline transcribes, per model x dtype configuration.

Method. Each configuration runs in a child process of its own (`python -m whisper_cli.tools.bench
--child SPEC`): peak RSS cannot be reset within a process, so only a fresh process measures
one configuration's CPU memory, and it isolates compile caches and CUDA state as well. The
child loads the model (timed), transcribes the whole audio once as a warm-up (compilation,
allocator and kernel autotuning happen here), then `repeats` more times; the wall time is
the median of those. Encoder and decoder time, steps and tokens are read from the engine's
and the transcriber's counters (differences over the timed runs): the engine is built timed,
so that it synchronises the device around each stage, and is otherwise run as shipped.

The audio is decoded once, in the parent, to 16 kHz float32 and handed to the children as
a `.npy` file; a child tiles it to the asked duration on the fly, 30 s at a time, and
hands it to the pipeline as an opened input (an `AudioSource`). Audio decoding is thus not
in the timings (it is in the CLI's), and memory stays bounded for any duration, as in the CLI.

This module knows nothing of Typer or Rich: the CLI builds a `BenchConfig`, calls
`run_bench` and prints `render_table` / `report_to_json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from whisper_cli.allocator import keep_freed_memory
from whisper_cli.audio import SAMPLE_RATE, AudioInfo, AudioSource
from whisper_cli.dtypes import check_quantize, expand_dtypes, resolve_device
from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.features import N_SAMPLES
from whisper_cli.options import (
    MAX_NEW_TOKENS,
    RunOptions,
    TranscribeOptions,
    check_compile,
    check_options,
    default_model,
    use_compile,
)
from whisper_cli.results import Transcript

if TYPE_CHECKING:
    from whisper_cli.pipeline import Transcriber

REFERENCES = ("transformers",)
BENCH_PATH = "<bench audio>"  # the name of the in-memory input (ArraySource)

_REPO = Path(__file__).resolve().parents[2]
# The default speech: every real clip of ../shared/audio, each stereo channel on its own.
_DEFAULT_CLIPS = (
    ("jfk.flac", None),
    ("stereo_diarization.wav", "left"),
    ("stereo_diarization.wav", "right"),
    ("multilingual.mp3", None),
)
_STDERR_TAIL = 3000  # characters of a failed child's stderr kept in its failure


# --- configuration and results ------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None  # None: the device's default (options.default_model)
    dtypes: tuple[str, ...] = ("auto",)  # each one configuration; see dtypes.expand_dtypes
    quantize: str = "none"  # every configuration's: none, or int8 weights (CPU)
    batch_size: int = TranscribeOptions.batch_size
    audio: str | None = None  # a file, or a .npy float32 16 kHz array; None: default speech
    duration: float | None = None  # tile (or cut) the audio to this many seconds
    max_new_tokens: int = MAX_NEW_TOKENS  # what transcribe decodes
    compile: str = "auto"  # auto: on for CUDA, off on CPU
    refill: bool | None = None  # continuous batching; None: where the step is compiled
    repeats: int = 3  # timed runs after the warm-up; the median is reported
    timestamps: bool = True
    vad: bool = True  # the speech map decides where speech is (off: every window decoded)
    word_timestamps: bool = False  # also time words: the alignment pass is timed on its own
    against: str | None = None  # "transformers": also time and compare a reference
    device: str = "auto"
    language: str | None = None  # None: detected per input, as the CLI does
    threads: int | None = None  # torch intra-op threads in the child; None: torch's default
    timeout_s: float | None = None  # per configuration (child process)

    @classmethod
    def of(cls, options: RunOptions, **bench: Any) -> BenchConfig:
        """The bench of a command line's transcription options (what bench measures of
        them: model, device, compile, language, timestamps, words, the map, batch size,
        max new tokens), with bench's own settings."""
        d = options.decoding
        return cls(
            model=options.model,
            batch_size=d.batch_size,
            max_new_tokens=d.max_new_tokens,
            compile=options.compile,
            refill=d.refill,
            timestamps=d.timestamps,
            vad=d.vad,
            word_timestamps=d.word_timestamps,
            device=options.device,
            language=d.language,
            **bench,
        )


@dataclass(frozen=True)
class Comparison:
    """whisper-cli against a reference implementation on the same windows."""

    reference: str  # "transformers <version>"
    reference_wall_s: float
    speedup: float  # reference wall / whisper-cli wall: > 1 means whisper-cli is faster
    texts_identical: bool  # after whitespace normalisation
    word_differences: int
    reference_windows: int


@dataclass(frozen=True)
class ConfigResult:
    """The measurements of one model x dtype configuration."""

    model: str
    model_path: str
    dtype: str
    compile: bool
    device: str
    device_name: str
    torch_version: str
    threads: int
    batch_size: int
    max_new_tokens: int
    timestamps: bool
    audio_s: float
    wall_s: float  # median of the timed runs
    walls_s: tuple[float, ...]
    rtfx: float  # audio seconds per wall second
    load_s: float
    warmup_wall_s: float  # the first (warm-up) run's wall time
    warmup_s: float  # compile / warm-up overhead: warm-up wall minus the median
    # Per timed run; windows counts decoded batch rows: a compiled batch's padding rows
    # and each fallback attempt count (the encoder ran once per window: engine.encoded_rows).
    windows: int
    batches: int
    decode_steps: int  # decoder forward passes: the prompt pass plus one per token step
    generated_tokens: int  # text and timestamp tokens, end-of-text excluded
    encoder_ms_per_window: float
    decode_ms_per_step: float
    tokens_per_s: float  # generated tokens per second of decoding (decoder throughput)
    detector_s: float  # per timed run: the speech detector's share of wall_s
    fallbacks: int  # per timed run: window decodes repeated at a higher temperature
    peak_memory_mb: float
    peak_memory_kind: str  # "cuda max_memory_allocated" or "process peak RSS"
    language: str | None
    words: int
    text: str
    comparison: Comparison | None = None
    word_timestamps: bool = False
    # Word timing, per timed run: the alignment pass (with the words built from it), and
    # what it adds on top of the rest of the run (align / (wall - align)).
    align_ms_per_window: float = 0.0
    word_timing_overhead: float = 0.0
    text_sha256: str = ""  # of `text`: compiled = eager at a glance, across machines
    quantize: str = "none"  # the linear layers' weights: none (the dtype's) or int8
    refill: bool = False  # continuous batching (engine.refills counts the rows refilled)
    # engine.EngineCounters per timed run (graphs, recompiles, cudagraph_skips, steps...),
    # and their totals after the warm-up run (where compilation happens).
    engine: dict[str, float] = field(default_factory=dict)
    engine_warmup: dict[str, float] = field(default_factory=dict)
    # The kernel plan the model ran with (kernels.KernelPlan.report), and its one line.
    kernels: dict[str, Any] = field(default_factory=dict)
    kernels_summary: str = ""


@dataclass(frozen=True)
class BenchFailure:
    model: str
    dtype: str
    error: str


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    audio: str  # what was played, in words
    audio_s: float
    results: tuple[ConfigResult, ...]
    failures: tuple[BenchFailure, ...] = ()


def with_model(config: BenchConfig) -> BenchConfig:
    """The config with its model named: the default of the device it runs on, if none."""
    if config.model is not None:
        return config
    return dataclasses.replace(config, model=default_model(resolve_device(config.device).type))


def validate(config: BenchConfig) -> None:
    """Run-level checks, before any child starts."""
    expand_dtypes(config.dtypes)
    check_quantize(config.quantize, resolve_device(config.device))
    check_compile(config.compile)
    decoding = TranscribeOptions(
        language=config.language,
        batch_size=config.batch_size,
        max_new_tokens=config.max_new_tokens,
    )
    check_options(decoding)  # the checks transcribe makes of what bench decodes with
    if config.repeats < 1:
        raise WhisperCliError("--repeats must be at least 1")
    if config.threads is not None and config.threads < 1:
        raise WhisperCliError("--threads must be at least 1")
    if config.duration is not None and config.duration <= 0:
        raise WhisperCliError("--duration must be positive")
    if config.against is not None and config.against not in REFERENCES:
        raise WhisperCliError(f"invalid --against {config.against!r}; choose transformers")


# --- the parent: audio, one child per configuration, the report ---------------------------


def run_bench(config: BenchConfig, on_progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every configuration of `config`, each in a child process.

    A configuration that fails (or times out) is reported in `failures`; the others still
    run. `on_progress` gets one line per configuration started.
    """
    validate(config)
    config = with_model(config)
    clip, description = load_bench_audio(config.audio)
    n_samples = _target_samples(len(clip), config.duration)
    results: list[ConfigResult] = []
    failures: list[BenchFailure] = []
    with tempfile.TemporaryDirectory(prefix="whisper-cli-bench-") as tmp:
        clip_path = Path(tmp) / "clip.npy"
        np.save(clip_path, clip)
        for dtype in expand_dtypes(config.dtypes):
            if on_progress:
                on_progress(f"bench: {config.model} {dtype} ({n_samples / SAMPLE_RATE:.0f} s)")
            spec = _child_spec(config, dtype, clip_path, n_samples, Path(tmp) / f"{dtype}.json")
            try:
                results.append(_run_child(spec, config.timeout_s))
            except WhisperCliError as exc:
                failures.append(BenchFailure(config.model, dtype, exc.message))
    audio_s = n_samples / SAMPLE_RATE
    return BenchReport(config, description, audio_s, tuple(results), tuple(failures))


def combine_reports(reports: list[BenchReport]) -> BenchReport:
    """Several runs (models, compile modes) as one report; the first one's config heads it."""
    if not reports:
        raise WhisperCliError("no reports to combine")
    first = reports[0]
    return dataclasses.replace(
        first,
        results=tuple(r for rep in reports for r in rep.results),
        failures=tuple(f for rep in reports for f in rep.failures),
    )


def load_bench_audio(audio: str | None) -> tuple[np.ndarray, str]:
    """The clip to play (float32 mono 16 kHz) and a description of it."""
    if audio is None:
        shared = _first_existing([Path("../shared/audio"), _REPO.parent / "shared" / "audio"])
        if shared is not None and all((shared / name).is_file() for name, _ in _DEFAULT_CLIPS):
            return default_speech(shared), "real speech: " + " + ".join(
                f"{name}" + (f" ({ch})" if ch else "") for name, ch in _DEFAULT_CLIPS
            )
        demo = _first_existing([Path(".cache/demo/sample.wav"), _REPO / ".cache/demo/sample.wav"])
        if demo is None:
            raise WhisperCliError(
                "no audio to benchmark: pass --audio FILE (../shared/audio and the demo clip "
                ".cache/demo/sample.wav are both missing; `make demo` fetches the latter)"
            )
        audio = str(demo)
    path = Path(audio)
    if path.suffix == ".npy":
        return _load_npy(path), str(path)
    from whisper_cli.audio import load_audio  # soundfile/soxr/av: only for real files

    return load_audio(path), str(path)


def default_speech(shared: Path) -> np.ndarray:
    """The shared clips one after another, stereo channels separately, at 16 kHz."""
    from whisper_cli.audio import load_audio

    return np.concatenate([load_audio(shared / name, channel=ch) for name, ch in _DEFAULT_CLIPS])


def _load_npy(path: Path) -> np.ndarray:
    try:
        clip = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise WhisperCliError(f"cannot read {path}: {exc}") from exc
    if clip.ndim != 1 or not np.issubdtype(clip.dtype, np.floating) or len(clip) == 0:
        raise WhisperCliError(
            f"{path}: expected a 1-D float array of 16 kHz samples, "
            f"got shape {clip.shape} of {clip.dtype}"
        )
    return clip.astype(np.float32, copy=False)


def _first_existing(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _target_samples(clip_len: int, duration: float | None) -> int:
    return clip_len if duration is None else max(1, round(duration * SAMPLE_RATE))


def _child_spec(
    config: BenchConfig, dtype: str, clip: Path, n_samples: int, result: Path
) -> dict[str, Any]:
    return {
        "model": config.model,
        "dtype": dtype,
        "quantize": config.quantize,
        "device": config.device,
        "compile": config.compile,
        "refill": config.refill,
        "batch_size": config.batch_size,
        "max_new_tokens": config.max_new_tokens,
        "repeats": config.repeats,
        "timestamps": config.timestamps,
        "vad": config.vad,
        "word_timestamps": config.word_timestamps,
        "language": config.language,
        "threads": config.threads,
        "against": config.against,
        "clip": str(clip),
        "n_samples": n_samples,
        "result": str(result),
    }


def _run_child(spec: dict[str, Any], timeout_s: float | None) -> ConfigResult:
    """Run one configuration in `python -m whisper_cli.tools.bench --child` and read its result."""
    spec_path = Path(spec["result"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    # The child must import this very package, installed or not: first on its path, and
    # (Python 3.11+) with no working directory put before it, which `-m` does otherwise:
    # run from a checkout, another checkout's bench would time that checkout's code.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    env["PYTHONSAFEPATH"] = "1"
    # A session of its own, so a timeout also ends compile workers the child started.
    proc = subprocess.Popen(
        [sys.executable, "-m", "whisper_cli.tools.bench", "--child", str(spec_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_child(proc)
        raise WhisperCliError(f"timed out after {timeout_s:.4g} s") from None
    except BaseException:
        # Ctrl-C reaches only the parent: the child has a session of its own.
        _kill_child(proc)
        raise
    result = Path(spec["result"])
    if proc.returncode != 0 or not result.is_file():
        raise WhisperCliError(_child_error(proc.returncode, stderr))
    return _result_from_dict(json.loads(result.read_text()))


def _kill_child(proc: subprocess.Popen) -> None:
    """End the child and everything it started (its process group), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # no process groups (Windows)
            proc.kill()
    proc.communicate()


def _child_error(returncode: int, stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    # The child prints "bench: error: ..." for the errors it knows; else show the traceback.
    known = [line for line in lines if line.startswith("bench: error: ")]
    if known:
        return known[-1].removeprefix("bench: error: ")
    tail = "\n".join(lines)[-_STDERR_TAIL:]
    return f"child exited with status {returncode}:\n{tail}"


def _result_from_dict(data: dict[str, Any]) -> ConfigResult:
    comparison = data.pop("comparison", None)
    data["walls_s"] = tuple(data["walls_s"])
    return ConfigResult(**data, comparison=Comparison(**comparison) if comparison else None)


# --- the child: one configuration, measured ------------------------------------------------


class ArraySource(AudioSource):
    """An opened input held in memory: a clip tiled to n samples, never decoded from a file."""

    def __init__(self, clip: np.ndarray, n_samples: int, path: str = BENCH_PATH) -> None:
        info = AudioInfo(path, n_samples / SAMPLE_RATE, SAMPLE_RATE, 1)
        super().__init__(info, "array", _never_opened, None)
        self.clip = clip
        self.n_samples = n_samples

    def blocks(self, block_seconds: float = 30.0) -> Iterator[np.ndarray]:
        return tiled_blocks(self.clip, self.n_samples, round(block_seconds * SAMPLE_RATE))


def _never_opened() -> BinaryIO:
    raise AssertionError("an ArraySource is read through its blocks, not from a file")


def tiled_blocks(clip: np.ndarray, n_samples: int, block: int = N_SAMPLES) -> Iterator[np.ndarray]:
    """`clip` repeated (or cut) to `n_samples`, as blocks: never the whole tiled audio at once."""
    for start in range(0, n_samples, block):
        stop = min(start + block, n_samples)
        yield np.take(clip, np.arange(start, stop), mode="wrap")


def transcribe_source(transcriber: Transcriber, source: AudioSource) -> Transcript:
    """One opened input, whole (Transcriber.run takes opened sources as well as paths)."""
    results: list[Transcript] = []
    errors: list[InputError] = []
    transcriber.run([source], results.append, errors.append)
    if errors:
        raise errors[0]
    return results[0]


def measure(
    spec: dict[str, Any], on_warmup: Callable[[dict[str, Any]], None] | None = None
) -> ConfigResult:
    """Load, warm up and time one configuration in this process (the child's work).

    on_warmup: called after the warm-up run with what is known by then (load and warm-up
    wall, the engine's counters: compilation happens in the warm-up), for a caller that
    keeps it in case the timed runs do not finish."""
    import torch

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.pipeline import Transcriber

    keep_freed_memory()  # as the CLI does
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    policy = resolve_policy(spec["dtype"], spec["device"], spec.get("quantize", "none"))
    device = policy.device
    on_cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)

    compiled = use_compile(spec["compile"], device.type)
    options = TranscribeOptions(
        language=spec["language"],
        timestamps=spec["timestamps"],
        batch_size=spec["batch_size"],
        max_new_tokens=spec["max_new_tokens"],
        compile=compiled,
        refill=spec.get("refill"),
        vad=spec.get("vad", True),
        word_timestamps=spec.get("word_timestamps", False),
    )
    started = time.perf_counter()
    loaded = load_model(spec["model"], policy, options)  # with its kernel plan
    sync()
    load_s = time.perf_counter() - started
    plan = loaded.model.plan
    # Timed runs only: stages synchronise the device, so each one's time is its own.
    transcriber = Transcriber(loaded, options, timed=True)
    engine = transcriber.engine
    clip = np.load(spec["clip"])
    source = ArraySource(clip, spec["n_samples"])

    def timed_run():
        sync()
        t0 = time.perf_counter()
        transcript = transcribe_source(transcriber, source)
        sync()
        return time.perf_counter() - t0, transcript

    warmup_wall, _ = timed_run()
    # Only the timed runs count: differences of the counters over them.
    before = dataclasses.replace(transcriber.counters)
    engine_before = dataclasses.replace(engine.counters)
    if on_warmup:
        on_warmup(
            {
                "load_s": load_s,
                "compile": compiled,
                "warmup_wall_s": warmup_wall,
                "audio_s": spec["n_samples"] / SAMPLE_RATE,
                "engine_warmup": dataclasses.asdict(engine_before),
                "counters_warmup": dataclasses.asdict(before),
            }
        )
    runs = [timed_run() for _ in range(spec["repeats"])]
    n = len(runs)
    ran = _per_run(engine.counters, engine_before, n)
    run_counters = _per_run(transcriber.counters, before, n)
    peak_mb, peak_kind = _peak_memory_mb(device)

    walls = tuple(wall for wall, _ in runs)
    wall = statistics.median(walls)
    transcript = runs[-1][1]
    audio_s = spec["n_samples"] / SAMPLE_RATE
    transcriber_words = engine.aligner is not None
    refill = transcriber.per_run > 1  # as the run resolved it (None: where compiled)
    align_run = ran["align_s"]
    comparison = None
    if spec["against"]:
        language = transcript.language if loaded.tokenizer.is_multilingual else None
        del transcriber, engine
        comparison = _compare(spec, loaded, transcript.text, wall, language, clip)
    return ConfigResult(
        model=Path(spec["model"]).name,
        model_path=str(loaded.path),
        dtype=policy.name,
        compile=compiled,
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
        batch_size=spec["batch_size"],
        max_new_tokens=spec["max_new_tokens"],
        timestamps=spec["timestamps"],
        audio_s=audio_s,
        wall_s=wall,
        walls_s=walls,
        rtfx=audio_s / wall,
        load_s=load_s,
        warmup_wall_s=warmup_wall,
        warmup_s=max(0.0, warmup_wall - wall),
        windows=round(ran["decoded_rows"]),
        batches=round(ran["decodes"]),
        decode_steps=round(ran["prefills"] + ran["steps"]),
        generated_tokens=round(ran["tokens"]),
        encoder_ms_per_window=1000 * ran["encode_s"] / max(ran["encoded_rows"], 1),
        decode_ms_per_step=1000 * ran["decode_s"] / max(ran["prefills"] + ran["steps"], 1),
        tokens_per_s=ran["tokens"] / ran["decode_s"] if ran["decode_s"] else 0.0,
        detector_s=run_counters["detector_s"],
        fallbacks=round(run_counters["fallbacks"]),
        peak_memory_mb=peak_mb,
        peak_memory_kind=peak_kind,
        language=transcript.language,
        words=len(transcript.text.split()),
        text=transcript.text,
        comparison=comparison,
        word_timestamps=transcriber_words,
        align_ms_per_window=1000 * align_run / max(ran["decoded_rows"], 1),
        word_timing_overhead=align_run / (wall - align_run) if wall > align_run else 0.0,
        text_sha256=hashlib.sha256(transcript.text.encode()).hexdigest(),
        quantize=policy.quantize,
        refill=refill,
        engine=ran,
        engine_warmup=dataclasses.asdict(engine_before),
        kernels=plan.report() if plan is not None else {},
        kernels_summary=plan.summary() if plan is not None else "",
    )


def _per_run(after, before, n: int) -> dict[str, float]:
    """Counters (a dataclass of numbers) per timed run: (after - before) / n."""
    return {
        name: (value - getattr(before, name)) / n
        for name, value in dataclasses.asdict(after).items()
    }


def _compare(
    spec: dict[str, Any], loaded, text: str, wall: float, language: str | None, clip: np.ndarray
) -> Comparison:
    from whisper_cli.tools.reference import compare_texts, run_reference

    ref = run_reference(
        loaded.path,
        blocks=lambda: tiled_blocks(clip, spec["n_samples"]),
        dtype=loaded.policy.dtype,
        device=loaded.policy.device,
        batch_size=spec["batch_size"],
        max_new_tokens=spec["max_new_tokens"],
        timestamps=spec["timestamps"],
        language=language,
    )
    texts = compare_texts(text, ref.text)
    return Comparison(
        reference=ref.name,
        reference_wall_s=ref.wall_s,
        speedup=ref.wall_s / wall,
        texts_identical=texts.identical,
        word_differences=texts.word_differences,
        reference_windows=ref.windows,
    )


def _peak_memory_mb(device) -> tuple[float, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max_memory_allocated"
    try:
        import resource
    except ImportError:  # Windows: no getrusage
        return 0.0, "unavailable"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "process peak RSS"


def device_name(device) -> str:
    """The GPU's name, or the CPU model (from /proc/cpuinfo where there is one)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


# --- rendering ------------------------------------------------------------------------------


def report_to_json(report: BenchReport, include_text: bool = False) -> dict[str, Any]:
    """The report as plain JSON data (texts left out unless asked for: they can be long)."""
    results = []
    for result in report.results:
        data = _rounded(dataclasses.asdict(result))
        if not include_text:
            data.pop("text")
        results.append(data)
    return {
        "config": dataclasses.asdict(report.config),
        "audio": report.audio,
        "audio_s": round(report.audio_s, 3),
        "results": results,
        "failures": [dataclasses.asdict(f) for f in report.failures],
    }


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


_COLUMNS = (
    "model",
    "dtype",
    "compile",
    "wall s",
    "RTFx",
    "enc ms/win",
    "dec ms/step",
    "tok/s",
    "VAD %",
    "load s",
    "warm-up s",
    "peak MB",
)


def render_table(report: BenchReport) -> str:
    """A Markdown table of the report, with a header line naming machine and settings."""
    cfg = report.config
    lines = [f"audio: {report.audio}, {report.audio_s:.1f} s"]
    if report.results:
        first = report.results[0]
        lines.append(
            f"device: {first.device} ({first.device_name}), torch {first.torch_version}, "
            f"{first.threads} threads; batch {first.batch_size}, "
            f"max_new_tokens {first.max_new_tokens}, timestamps {'on' if cfg.timestamps else 'off'}"
            f", median of {cfg.repeats} after 1 warm-up; peak memory: {first.peak_memory_kind}"
        )
    with_ref = any(r.comparison for r in report.results)
    with_words = any(r.word_timestamps for r in report.results)
    header = [
        *_COLUMNS,
        *(["align ms/win", "words +%"] if with_words else []),
        *(["reference s", "speed-up", "text"] if with_ref else []),
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in report.results:
        cells = [
            r.model,
            r.dtype if r.quantize == "none" else f"{r.dtype} {r.quantize}",
            "on" if r.compile else "off",
            f"{r.wall_s:.2f}",
            f"{r.rtfx:.1f}",
            f"{r.encoder_ms_per_window:.1f}",
            f"{r.decode_ms_per_step:.2f}",
            f"{r.tokens_per_s:.0f}",
            f"{100 * r.detector_s / r.wall_s:.1f}",
            f"{r.load_s:.2f}",
            f"{r.warmup_s:.2f}",
            f"{r.peak_memory_mb:.0f}",
        ]
        if with_words:
            cells += [f"{r.align_ms_per_window:.1f}", f"{100 * r.word_timing_overhead:.1f}"]
        if with_ref:
            cells += _comparison_cells(r.comparison)
        lines.append("| " + " | ".join(cells) + " |")
    for r in report.results:
        if r.kernels_summary:
            lines.append(f"\nkernels of {r.model} {r.dtype}: {r.kernels_summary}")
    for f in report.failures:
        lines.append(f"\nFAILED {f.model} {f.dtype}: {f.error}")
    return "\n".join(lines)


def _comparison_cells(c: Comparison | None) -> list[str]:
    if c is None:
        return ["", "", ""]
    text = "identical" if c.texts_identical else f"{c.word_differences} words differ"
    return [f"{c.reference_wall_s:.2f}", f"{c.speedup:.2f}x", text]


# --- the child's entry point -----------------------------------------------------------------


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = measure(spec)
    except WhisperCliError as exc:
        print(f"bench: error: {exc.message}", file=sys.stderr)
        return 2
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m whisper_cli.tools.bench --child SPEC`: one configuration, run by run_bench.

    The command line is `whisper-cli bench` (cli.py): one front end, whose flags are
    transcribe's own."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--child":
        print("bench: run `whisper-cli bench` (see --help)", file=sys.stderr)
        return 2
    return _child_main(args[1])


if __name__ == "__main__":
    sys.exit(main())
