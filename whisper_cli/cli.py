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
WordTimestampsOpt = Annotated[
    bool, typer.Option(help="Time every word (json/jsonl 'words'; word-timed subtitle cues).")
]
MaxLineWidthOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Subtitles: characters per line (needs --word-timestamps)."),
]
MaxLineCountOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Subtitles: lines per cue, with --max-line-width."),
]
MaxWordsPerLineOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Subtitles: words per cue (no effect with --max-line-width)."),
]
HighlightWordsOpt = Annotated[
    bool, typer.Option(help="srt/vtt: underline each word as it is spoken.")
]


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
    from whisper_cli.loading import load_model

    policy = resolve_policy(dtype.value, device)
    if model is None:
        model = "turbo" if policy.device.type == "cuda" else "base"
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


@app.command()
def transcribe(
    inputs: Annotated[list[str], typer.Argument(help="Audio files, directories, or - for stdin.")],
    model: ModelOpt = None,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    language: Annotated[
        str | None, typer.Option("--language", "-l", help="Language code; default: detect.")
    ] = None,
    multilingual: Annotated[
        bool, typer.Option(help="Detect the language of every 30 s window, not once per file.")
    ] = False,
    task: Annotated[Task, typer.Option(help="transcribe, or translate to English.")] = (
        Task.transcribe
    ),
    timestamps: Annotated[
        bool,
        typer.Option(
            help="Decode with timestamps (default). --no-timestamps is faster but drops "
            "whole utterances from independent windows (measured: 21-30% of words lost).",
        ),
    ] = True,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows decoded together.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per 30 s window.")] = 224,
    initial_prompt: Annotated[
        str | None, typer.Option(help="Text that conditions every window (names, terms).")
    ] = None,
    channel: Annotated[
        str | None, typer.Option(help="left, right or a channel index; default: down-mix.")
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.txt,
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
    word_timestamps: WordTimestampsOpt = False,
    max_line_width: MaxLineWidthOpt = None,
    max_line_count: MaxLineCountOpt = None,
    max_words_per_line: MaxWordsPerLineOpt = None,
    highlight_words: HighlightWordsOpt = False,
    no_speech_threshold: Annotated[float, typer.Option(help="Silence guard.")] = 0.6,
    logprob_threshold: Annotated[float, typer.Option(help="Silence guard.")] = -1.0,
    compression_ratio_threshold: Annotated[
        float, typer.Option(help="Drop looping segments above this gzip ratio.")
    ] = 2.4,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print segments.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
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
    from whisper_cli.formats import SubtitleOptions
    from whisper_cli.inputs import expand_inputs
    from whisper_cli.outputs import OutputPlan

    paths, input_errors = expand_inputs(a["inputs"], a["recursive"])
    if a["inputs"].count("-") > 1:
        raise WhisperCliError("stdin (-) can be given only once")
    subtitles = SubtitleOptions(
        a["max_line_width"], a["max_line_count"], a["max_words_per_line"], a["highlight_words"]
    )
    subtitles.check(a["word_timestamps"])
    n_inputs = len(paths) + len(input_errors)
    plan = OutputPlan.make(a["fmt"].value, a["output_dir"], n_inputs, subtitles)
    plan.check_distinct(paths)
    if a["skip_existing"]:
        if a["output_dir"] is None:
            raise WhisperCliError("--skip-existing needs --output-dir")
        skipped = [p for p in paths if p != "-" and plan.is_done(p)]
        paths = [p for p in paths if p not in skipped]
        if skipped and not a["quiet"]:
            _stderr(f"whisper-cli: skipping {len(skipped)} input(s) with existing outputs")
    channel = a["channel"]
    if channel is not None and channel.isdigit():
        channel = int(channel)

    loaded = _load(a["model"], a["dtype"], a["device"], a["quiet"])
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    transcriber = Transcriber(
        loaded,
        TranscribeOptions(
            language=a["language"],
            multilingual=a["multilingual"],
            task=a["task"].value,
            timestamps=a["timestamps"],
            batch_size=a["batch_size"],
            max_new_tokens=a["max_new_tokens"],
            initial_prompt=a["initial_prompt"],
            channel=channel,
            compile=_use_compile(a["compile"], loaded.policy.device.type),
            no_speech_threshold=a["no_speech_threshold"],
            logprob_threshold=a["logprob_threshold"],
            compression_ratio_threshold=a["compression_ratio_threshold"],
            word_timestamps=a["word_timestamps"],
        ),
    )
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
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Word error rate (pooled over the clips) of a manifest, per dtype."""
    import json

    from whisper_cli.evaluate import evaluate, render_table, report_to_json

    try:
        report = evaluate(
            manifest, model or "base", dtype.split(","), device=device, batch_size=batch_size
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
    word_timestamps: WordTimestampsOpt = False,
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
        word_timestamps=word_timestamps,
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
