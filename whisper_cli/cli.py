"""The command line: parse, call the library, render. The only module that knows Typer and Rich.

Heavy imports (torch, the model) happen inside the commands, so `--help` is instant.
Exit codes: 0 success, 1 some input failed, 2 run-level error, 130 interrupted.
"""

from __future__ import annotations

import signal
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from whisper_cli.allocator import keep_freed_memory
from whisper_cli.errors import (
    EXIT_INPUT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    WhisperCliError,
)
from whisper_cli.options import Policy

app = typer.Typer(
    name="whisper-cli",
    help="Fast, exact Whisper speech-to-text.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Dtype(str, Enum):
    auto = "auto"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"


class Compile(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


class Task(str, Enum):
    transcribe = "transcribe"
    translate = "translate"


class Format(str, Enum):
    txt = "txt"
    json = "json"
    jsonl = "jsonl"
    srt = "srt"
    vtt = "vtt"
    tsv = "tsv"
    all = "all"


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Local HF or CTranslate2 dir, hub id, or alias (tiny, base, small, medium, "
        "large-v3, turbo, *.en). Default: turbo on CUDA, base otherwise.",
    ),
]
DtypeOpt = Annotated[Dtype, typer.Option(help="Floating dtype of the whole run.")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
CompileOpt = Annotated[
    Compile, typer.Option(help="torch.compile the decode step: auto = on for CUDA.")
]
# The transcription options, shared by `transcribe` and `batch` (built by _options).
LanguageOpt = Annotated[
    str | None, typer.Option("--language", "-l", help="Language code; default: detect.")
]
MultilingualOpt = Annotated[
    bool, typer.Option(help="Detect the language of every 30 s window, not once per file.")
]
TaskOpt = Annotated[Task, typer.Option(help="transcribe, or translate to English.")]
TimestampsOpt = Annotated[
    bool,
    typer.Option(
        help="Decode with timestamps (default). --no-timestamps is faster but drops "
        "whole utterances from independent windows (measured: 21-30% of words lost).",
    ),
]
BatchSizeOpt = Annotated[int, typer.Option(min=1, help="Windows decoded together.")]
MaxNewTokensOpt = Annotated[int, typer.Option(min=1, help="Tokens per 30 s window.")]
InitialPromptOpt = Annotated[
    str | None, typer.Option(help="Text that conditions every window (names, terms).")
]
ChannelOpt = Annotated[
    str | None, typer.Option(help="left, right or a channel index; default: down-mix.")
]
FormatOpt = Annotated[Format, typer.Option("--format", "-f", help="Output format.")]
VadOpt = Annotated[
    bool,
    typer.Option(
        help="Decode only where the speech detector (Silero VAD) hears speech. "
        "--no-vad decodes every window, for audio that defeats the detector.",
    ),
]
VadThresholdOpt = Annotated[
    float, typer.Option(min=0.01, max=0.99, help="Speech probability that starts speech.")
]
TEMPERATURES = ",".join(f"{t:g}" for t in Policy.temperatures)
TemperatureOpt = Annotated[
    str,
    typer.Option(
        help="Temperatures tried in turn on a window that fails the checks below: "
        "one value, or a comma list as openai-whisper's (0 = greedy only).",
    ),
]
NoSpeechOpt = Annotated[
    float, typer.Option(help="No-speech probability above which a window may be silence.")
]
LogprobOpt = Annotated[
    float, typer.Option(help="Average log-prob below which a window falls back.")
]
CompressionOpt = Annotated[
    float, typer.Option(help="gzip ratio above which a window falls back (repetitive).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs.")]
DebugOpt = Annotated[bool, typer.Option(help="Show tracebacks.")]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(exc: WhisperCliError, debug: bool) -> typer.Exit:
    if debug:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    _stderr(f"whisper-cli: error: {exc.message}")
    return typer.Exit(exc.exit_code)


def _load(model: str | None, dtype: Dtype, device: str, quiet: bool):
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import default_model, load_model

    policy = resolve_policy(dtype.value, device)
    if model is None:
        model = default_model(policy.device.type)
    started = time.perf_counter()
    loaded = load_model(model, policy)
    if not quiet:
        _stderr(
            f"whisper-cli: model {model} ({loaded.path}), dtype {policy.name}, "
            f"device {policy.device} [{time.perf_counter() - started:.1f} s]"
        )
    return loaded


def _use_compile(choice: Compile, device_type: str) -> bool:
    return choice == Compile.on or (choice == Compile.auto and device_type == "cuda")


def _options(a: dict, device_type: str):
    """TranscribeOptions from the transcription options of `transcribe` or `batch`."""
    from whisper_cli.pipeline import TranscribeOptions

    channel = a["channel"]
    if channel is not None and channel.isdigit():
        channel = int(channel)
    return TranscribeOptions(
        language=a["language"],
        multilingual=a["multilingual"],
        task=a["task"].value,
        timestamps=a["timestamps"],
        batch_size=a["batch_size"],
        max_new_tokens=a["max_new_tokens"],
        initial_prompt=a["initial_prompt"],
        channel=channel,
        compile=_use_compile(a["compile"], device_type),
        vad=a["vad"],
        policy=_policy(a),
    )


@app.command()
def transcribe(
    inputs: Annotated[list[str], typer.Argument(help="Audio files, directories, or - for stdin.")],
    model: ModelOpt = None,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    language: LanguageOpt = None,
    multilingual: MultilingualOpt = False,
    task: TaskOpt = Task.transcribe,
    timestamps: TimestampsOpt = True,
    batch_size: BatchSizeOpt = 16,
    max_new_tokens: MaxNewTokensOpt = 224,
    initial_prompt: InitialPromptOpt = None,
    channel: ChannelOpt = None,
    fmt: FormatOpt = Format.txt,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="Write DIR/<stem>.<ext> files.")
    ] = None,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Recurse into dirs.")
    ] = False,
    skip_existing: Annotated[
        bool, typer.Option(help="Skip inputs whose outputs exist in --output-dir.")
    ] = False,
    compile: CompileOpt = Compile.auto,
    vad: VadOpt = True,
    vad_threshold: VadThresholdOpt = Policy.vad_threshold,
    temperature: TemperatureOpt = TEMPERATURES,
    no_speech_threshold: NoSpeechOpt = Policy.no_speech_threshold,
    logprob_threshold: LogprobOpt = Policy.logprob_threshold,
    compression_ratio_threshold: CompressionOpt = Policy.compression_ratio_threshold,
    quiet: QuietOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print segments.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Transcribe audio files (any format, any length) to text, subtitles or JSON."""
    try:
        code = _transcribe(**locals())
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted; finished outputs are complete, no partial file left")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


def _transcribe(**a) -> int:
    from whisper_cli.inputs import expand_inputs
    from whisper_cli.outputs import OutputPlan

    paths, input_errors = expand_inputs(a["inputs"], a["recursive"])
    if a["inputs"].count("-") > 1:
        raise WhisperCliError("stdin (-) can be given only once")
    plan = OutputPlan.make(a["fmt"].value, a["output_dir"], len(paths) + len(input_errors))
    plan.check_distinct(paths)
    if a["skip_existing"]:
        if a["output_dir"] is None:
            raise WhisperCliError("--skip-existing needs --output-dir")
        skipped = [p for p in paths if p != "-" and plan.is_done(p)]
        paths = [p for p in paths if p not in skipped]
        if skipped and not a["quiet"]:
            _stderr(f"whisper-cli: skipping {len(skipped)} input(s) with existing outputs")
    _policy(a)  # a usage error before the model loads
    loaded = _load(a["model"], a["dtype"], a["device"], a["quiet"])
    from whisper_cli.pipeline import Transcriber

    transcriber = Transcriber(loaded, _options(a, loaded.policy.device.type))
    failures = 0
    for err in input_errors:
        _stderr(f"whisper-cli: error: {err.message}")
        failures += 1

    def on_error(err: WhisperCliError) -> None:
        nonlocal failures
        _check_interrupt()  # a read cut short by Ctrl-C is not a damaged file
        failures += 1
        _stderr(f"whisper-cli: error: {err.message}")

    def on_result(t) -> None:
        _check_interrupt()
        if not a["quiet"] and t.language and loaded.tokenizer.is_multilingual:
            prob = f" (p={t.language_probability:.2f})" if t.language_probability else ""
            _stderr(f"whisper-cli: {t.path}: language {t.language}{prob}")
        if a["verbose"]:
            for s in t.segments:
                _stderr(f"[{s.start:8.2f} --> {s.end:8.2f}] {s.text.strip()}")
        plan.emit(t, sys.stdout)

    with _progress(a["quiet"]) as report:

        def on_progress(p) -> None:
            _check_interrupt()
            if report is not None:
                report(p)

        transcriber.run(paths, on_result, on_error, on_progress, stdin=sys.stdin.buffer)
    _check_interrupt()
    return EXIT_INPUT_FAILED if failures else EXIT_OK


def _policy(a: dict) -> Policy:
    """The policy of the options given (a usage error when they contradict each other)."""
    try:
        temperatures = tuple(float(t) for t in a["temperature"].split(","))
    except ValueError:
        raise WhisperCliError(
            f"invalid --temperature {a['temperature']!r}: one number or a comma list"
        ) from None
    try:
        return Policy(
            vad_threshold=a["vad_threshold"],
            vad_neg_threshold=max(a["vad_threshold"] - 0.15, 0.01),  # Silero's own rule
            temperatures=temperatures,
            no_speech_threshold=a["no_speech_threshold"],
            logprob_threshold=a["logprob_threshold"],
            compression_ratio_threshold=a["compression_ratio_threshold"],
        )
    except ValueError as exc:
        raise WhisperCliError(f"invalid option: {exc}") from None


class _progress:
    """A Rich progress bar on stderr (audio seconds, RTFx, ETA), only on a terminal."""

    def __init__(self, quiet: bool) -> None:
        self.enabled = not quiet and sys.stderr.isatty()
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} s audio"),
            TextColumn("RTFx {task.fields[rtfx]:.1f}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("transcribing", total=None, rtfx=0.0)
        return self.update

    def update(self, p) -> None:
        rtfx = p.audio_done / p.elapsed if p.elapsed > 0 else 0.0
        self.bar.update(self.task, completed=p.audio_done, total=p.audio_total or None, rtfx=rtfx)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


class Engine(str, Enum):
    local = "local"
    ray = "ray"


@app.command()
def batch(
    manifest: Annotated[
        str,
        typer.Argument(
            help="A directory (searched recursively), a text file of paths, or JSONL with "
            '"path" and optional "language"/"task"; a local path or an fsspec URL.'
        ),
    ],
    output_dir: Annotated[
        Path,
        typer.Option(
            "--output-dir", "-o", help="Write DIR/<stem>.<ext> files and DIR/summary.jsonl."
        ),
    ],
    engine: Annotated[
        Engine, typer.Option(help="local: in this process; ray: Ray Data actors.")
    ] = Engine.local,
    ray_address: Annotated[
        str | None,
        typer.Option(help="auto or HOST:PORT of a running cluster; default: a local one."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Ray actors, each loading the model once; default: one per G GPUs of the "
            "cluster, or one per node without GPUs.",
        ),
    ] = None,
    gpus_per_worker: Annotated[
        float | None,
        typer.Option(
            min=0, help="G: GPUs per actor (0.5: two share one); default 1 where there are GPUs."
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(help="I/N: only part I of N (0-based) of the manifest, stable by path."),
    ] = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    language: LanguageOpt = None,
    multilingual: MultilingualOpt = False,
    task: TaskOpt = Task.transcribe,
    timestamps: TimestampsOpt = True,
    batch_size: BatchSizeOpt = 16,
    max_new_tokens: MaxNewTokensOpt = 224,
    initial_prompt: InitialPromptOpt = None,
    channel: ChannelOpt = None,
    fmt: FormatOpt = Format.txt,
    compile: CompileOpt = Compile.auto,
    vad: VadOpt = True,
    vad_threshold: VadThresholdOpt = Policy.vad_threshold,
    temperature: TemperatureOpt = TEMPERATURES,
    no_speech_threshold: NoSpeechOpt = Policy.no_speech_threshold,
    logprob_threshold: LogprobOpt = Policy.logprob_threshold,
    compression_ratio_threshold: CompressionOpt = Policy.compression_ratio_threshold,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Transcribe a manifest into a directory: resumable, shardable, locally or on Ray."""
    try:
        code = _batch(**locals())
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted; finished outputs are complete: run again to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


def _batch(**a) -> int:
    from whisper_cli.batch import BatchConfig, parse_shard, run_batch

    config = BatchConfig(
        manifest=a["manifest"],
        output_dir=a["output_dir"],
        fmt=a["fmt"].value,
        model=a["model"],
        dtype=a["dtype"].value,
        device=a["device"],
        engine=a["engine"].value,
        ray_address=a["ray_address"],
        workers=a["workers"],
        gpus_per_worker=a["gpus_per_worker"],
        shard=parse_shard(a["shard"]) if a["shard"] is not None else None,
    )
    quiet = a["quiet"]

    def on_record(record) -> None:
        _check_interrupt()
        if record.status == "failed":
            _stderr(f"whisper-cli: error: {record.error}")

    def log(message: str) -> None:
        if not quiet:
            _stderr(f"whisper-cli: {message}")

    with _batch_progress(quiet) as on_progress:
        report = run_batch(
            config, lambda device_type: _options(a, device_type), on_record, on_progress, log
        )
    _check_interrupt()
    log(
        f"{report.processed - report.failed} written, {report.failed} failed, "
        f"{report.skipped} already done; summary: {report.summary}"
    )
    return EXIT_INPUT_FAILED if report.failed else EXIT_OK


class _batch_progress:
    """Inputs done / total, audio hours and RTFx on stderr: a bar on a terminal, else lines."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar = None

    def __enter__(self):
        if self.quiet:
            return None
        if not sys.stderr.isatty():
            return self.line
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("inputs, {task.fields[hours]:.2f} h audio, RTFx {task.fields[rtfx]:.1f}"),
            console=Console(stderr=True),
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("transcribing", total=None, hours=0.0, rtfx=0.0)
        return self.update

    @staticmethod
    def _rtfx(p) -> float:
        return p.audio_seconds / p.elapsed if p.elapsed > 0 else 0.0

    def line(self, p) -> None:
        _stderr(
            f"whisper-cli: {p.done}/{p.total} inputs ({p.failed} failed), "
            f"{p.audio_seconds / 3600:.2f} h audio, RTFx {self._rtfx(p):.1f}"
        )

    def update(self, p) -> None:
        self.bar.update(
            self.task,
            completed=p.done,
            total=p.total,
            hours=p.audio_seconds / 3600,
            rtfx=self._rtfx(p),
        )

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="CTranslate2 / faster-whisper model directory.")],
    dst: Annotated[Path, typer.Argument(help="Hugging Face layout directory to write.")],
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Import a CTranslate2 (faster-whisper) Whisper model into the Hugging Face layout."""
    from whisper_cli.convert import convert_ct2

    try:
        convert_ct2(src, dst)
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    _stderr(f"whisper-cli: wrote {dst}")


@app.command(name="eval")
def eval_command(
    manifest: Annotated[Path, typer.Argument(help="Manifest JSON (clips with references).")],
    model: ModelOpt = None,
    dtype: Annotated[
        str, typer.Option(help="auto, f32, f16, bf16, or all (f32, f16 and bf16).")
    ] = "f32",
    device: DeviceOpt = "auto",
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    vad: Annotated[bool, typer.Option(help="The speech map on (default) or off.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Word error rate (pooled over the clips) of a manifest, per dtype."""
    import json

    from whisper_cli.evaluate import evaluate, render_table, report_to_json

    try:
        report = evaluate(
            manifest,
            model or "base",
            dtype.split(","),
            device=device,
            batch_size=batch_size,
            vad=vad,
        )
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    print(json.dumps(report_to_json(report), indent=2) if json_out else render_table(report))


@app.command()
def bench(
    model: ModelOpt = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    dtype: Annotated[str, typer.Option(help="auto, f32, f16, bf16, or all.")] = "auto",
    audio: Annotated[
        str | None, typer.Option(help="Audio file or .npy; default: the bundled real speech.")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Tile the audio to this many seconds.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    compile: CompileOpt = Compile.auto,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs; the median is shown.")] = 3,
    timestamps: Annotated[bool, typer.Option(help="Timestamp mode (the default).")] = True,
    vad: Annotated[bool, typer.Option(help="The speech map on (default) or off.")] = True,
    against: Annotated[
        str | None, typer.Option(help="transformers: also run the reference and compare.")
    ] = None,
    device: DeviceOpt = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Speed and memory, reproducibly, optionally beside the transformers reference."""
    import json

    from whisper_cli.bench import BenchConfig, render_table, report_to_json, run_bench

    config = BenchConfig(
        model=model or ("turbo" if device.startswith("cuda") else "base"),
        dtypes=tuple(dtype.split(",")),
        batch_size=batch_size,
        audio=audio,
        duration=duration,
        max_new_tokens=max_new_tokens,
        compile=compile.value,
        repeats=repeats,
        timestamps=timestamps,
        vad=vad,
        against=against,
        device=device,
    )
    try:
        report = run_bench(config, on_progress=_stderr)
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    print(json.dumps(report_to_json(report), indent=2) if json_out else render_table(report))
    if report.failures:
        raise typer.Exit(EXIT_INPUT_FAILED)


# Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: one that lands in Python
# code called back from C (libsndfile reads file objects through cffi callbacks) is swallowed
# there, so the transcribe callbacks check the flag and stop the run before writing more.
_sigint_seen = False


def _on_sigint(signum, frame) -> None:
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
        return  # swallowed in a C callback; _check_interrupt() stops the run
    sys.__unraisablehook__(info)


def _check_interrupt() -> None:
    if _sigint_seen:
        raise KeyboardInterrupt


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    keep_freed_memory()
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable
    try:
        app()
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except WhisperCliError as exc:  # raised outside a command's own handler
        sys.exit(_fail(exc, debug).exit_code)
    except Exception as exc:
        # Last resort: a bug, not a problem the user can fix; one line unless --debug.
        if debug:
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        detail = str(exc).strip().splitlines()
        hint = "" if debug else " (run with --debug for the traceback)"
        _stderr(
            f"whisper-cli: internal error: {type(exc).__name__}"
            f"{': ' + detail[0] if detail else ''}{hint}"
        )
        sys.exit(EXIT_USAGE)


__all__ = ["EXIT_USAGE", "app", "main"]
