"""The command line: parse, call the library, render. The only module that knows Typer and Rich.

Heavy imports (torch, the model) happen inside the commands, so `--help` is instant.
Exit codes: 0 success, 1 some input failed, 2 run-level error, 130 interrupted,
141 stdout closed by its reader (`| head`).

Every check that needs no model runs before it loads (options, output folders, every
input opened and validated), so a mistake costs a second, not a model load and a decode.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from whisper_cli import __version__
from whisper_cli.allocator import keep_freed_memory
from whisper_cli.batch import ENGINES
from whisper_cli.collector import start_up_imports
from whisper_cli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INPUT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    DecoderMessage,
    InputError,
    WhisperCliError,
    WhisperCliWarning,
)
from whisper_cli.formats import FORMAT_CHOICES, SubtitleOptions
from whisper_cli.options import (
    COMPILE_CHOICES,
    LIVE_LATENCY_SECONDS,
    MAX_NEW_TOKENS,
    TASKS,
    Policy,
    RunOptions,
    TranscribeOptions,
    default_model,
    parse_latency,
)


class _NoFlagPlaceholder:
    """Help without a `<bool>` placeholder after --help (flags of ours set metavar="")."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None and hasattr(option, "metavar"):
            option.metavar = ""
        return option


class _Group(_NoFlagPlaceholder, typer.core.TyperGroup):
    pass


class _Command(_NoFlagPlaceholder, typer.core.TyperCommand):
    pass


app = typer.Typer(
    name="whisper-cli",
    help="Fast, exact Whisper speech-to-text.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=_Group,
)


def _show_version(value: bool) -> None:
    if value:
        print(f"whisper-cli {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            metavar="",
            help="Show the version and exit.",
        ),
    ] = False,
) -> None:
    """Fast, exact Whisper speech-to-text."""


class Dtype(str, Enum):
    auto = "auto"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"


Compile = Enum("Compile", {name: name for name in COMPILE_CHOICES}, type=str)


Task = Enum("Task", {name: name for name in TASKS}, type=str)


Format = Enum("Format", {name: name for name in FORMAT_CHOICES}, type=str)


# --- options: one alias each, shared by every command that takes them --------------------

PANEL_IO = "Input and output"
PANEL_MODEL = "Model and precision"
PANEL_DECODING = "Decoding"
PANEL_GUARDS = "Guards (what is dropped as silence or repetition)"
PANEL_PERFORMANCE = "Performance"
PANEL_MESSAGES = "Messages"


def _flag(*names: str, help: str, panel: str) -> Any:
    """A flag that only turns something on (`--name`, no `--no-name`), shown in --help
    without a `<bool>` placeholder (metavar "", with _NoFlagPlaceholder for --help)."""
    return Annotated[bool, typer.Option(*names, metavar="", help=help, rich_help_panel=panel)]


def _count(kind: Any, *, help: str, panel: str) -> Any:
    """An option that takes a count N >= 1 (typer refuses less)."""
    return Annotated[kind, typer.Option(min=1, metavar="N", help=help, rich_help_panel=panel)]


InputsArg = Annotated[
    list[str],
    typer.Argument(
        help="Audio files (any format FFmpeg reads), directories, or - for stdin.",
        metavar="AUDIO",
        show_default=False,
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        metavar="NAME",
        help="Local HF or CTranslate2 dir, hub id, or alias (tiny, base, small, medium, "
        f"large-v3, turbo, *.en). Default: {default_model('cuda')} on CUDA, "
        f"{default_model('cpu')} otherwise.",
        rich_help_panel=PANEL_MODEL,
    ),
]
DtypeOpt = Annotated[
    Dtype,
    typer.Option(
        help="Floating dtype of the whole run: weights, caches, activations. "
        "auto: bf16 (or f16) on CUDA, f32 on CPU.",
        rich_help_panel=PANEL_MODEL,
    ),
]
QuantizeOpt = Annotated[
    str,
    typer.Option(
        metavar="Q",
        help="none, or int8: the linear layers' weights as int8 (CPU only); "
        "activations stay in --dtype.",
        rich_help_panel=PANEL_MODEL,
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(metavar="DEV", help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL),
]
CompileOpt = Annotated[
    Compile,
    typer.Option(
        help="torch.compile the decode step: auto = on for CUDA (slower on CPU).",
        rich_help_panel=PANEL_PERFORMANCE,
    ),
]
RefillOpt = Annotated[
    bool | None,
    typer.Option(
        "--refill/--no-refill",
        metavar="",
        help="Give each row that finishes the next window at once (continuous batching; "
        "the same text either way). Default: where the step is compiled.",
        rich_help_panel=PANEL_PERFORMANCE,
    ),
]
LanguageOpt = Annotated[
    str | None,
    typer.Option(
        "--language",
        "-l",
        metavar="LANG",
        help="Language code or English name, any case (de, German); default: detect.",
        rich_help_panel=PANEL_DECODING,
    ),
]
MultilingualOpt = _flag(
    "--multilingual",
    help="Detect the language of every 30 s window, not once per file "
    "(multilingual models; not with --language).",
    panel=PANEL_DECODING,
)
TaskOpt = Annotated[
    Task,
    typer.Option(help="transcribe, or translate to English.", rich_help_panel=PANEL_DECODING),
]
NoTimestampsOpt = _flag(
    "--no-timestamps",
    help="Decode without timestamps: faster, but drops whole utterances from "
    "independent windows (measured: 21-30% of words lost).",
    panel=PANEL_DECODING,
)
MaxNewTokensOpt = _count(
    int,
    help="Most tokens decoded per 30 s window (a warning says when text was cut).",
    panel=PANEL_DECODING,
)
InitialPromptOpt = Annotated[
    str | None,
    typer.Option(
        metavar="TEXT",
        help="Text that conditions every window (names, terms).",
        rich_help_panel=PANEL_DECODING,
    ),
]
ChannelOpt = Annotated[
    str | None,
    typer.Option(
        metavar="CH",
        help="left, right or a 0-based channel index; default: mix all channels.",
        rich_help_panel=PANEL_IO,
    ),
]
FormatOpt = Annotated[
    Format,
    typer.Option(
        "--format",
        "-f",
        help="Output format (all: every one; needs --output-dir).",
        rich_help_panel=PANEL_IO,
    ),
]
OutputDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--output-dir",
        "-o",
        metavar="DIR",
        help="Write DIR/<name>.<format> files instead of printing (with -r, DIR mirrors "
        "the input tree).",
        rich_help_panel=PANEL_IO,
    ),
]
RecursiveOpt = _flag(
    "--recursive",
    "-r",
    help="Also read the subdirectories of directory inputs.",
    panel=PANEL_IO,
)
SkipExistingOpt = _flag(
    "--skip-existing",
    help="Skip inputs whose outputs exist in --output-dir (resume a run).",
    panel=PANEL_IO,
)
WordTimestampsOpt = _flag(
    "--word-timestamps",
    help="Time every word (json/jsonl 'words'; word-timed subtitle cues).",
    panel=PANEL_IO,
)
MaxLineWidthOpt = _count(
    int | None, help="Subtitles: characters per line (needs --word-timestamps).", panel=PANEL_IO
)
MaxLineCountOpt = _count(
    int | None, help="Subtitles: lines per cue, with --max-line-width.", panel=PANEL_IO
)
MaxWordsPerLineOpt = _count(
    int | None, help="Subtitles: words per cue (no effect with --max-line-width).", panel=PANEL_IO
)
HighlightWordsOpt = _flag(
    "--highlight-words",
    help="srt/vtt: underline each word as it is spoken.",
    panel=PANEL_IO,
)
NoVadOpt = _flag(
    "--no-vad",
    help="Decode every window, also where the speech detector (Silero VAD, on by "
    "default) hears no speech: for audio that defeats the detector.",
    panel=PANEL_GUARDS,
)
VadThresholdOpt = Annotated[
    float,
    typer.Option(
        metavar="P",
        help="Speech probability at which the detector starts speech.",
        rich_help_panel=PANEL_GUARDS,
    ),
]
TEMPERATURES = ",".join(f"{t:g}" for t in Policy.temperatures)
TemperatureOpt = Annotated[
    str,
    typer.Option(
        metavar="T[,T...]",
        help="Temperatures tried in turn on a window that fails the guards (repetitive, "
        "unsure or looping); 0 alone: greedy only.",
        rich_help_panel=PANEL_DECODING,
    ),
]
NoSpeechThresholdOpt = Annotated[
    float,
    typer.Option(
        metavar="P",
        help="A window is silent above this no-speech probability (if it is unsure).",
        rich_help_panel=PANEL_GUARDS,
    ),
]
LogprobThresholdOpt = Annotated[
    float,
    typer.Option(
        metavar="LP",
        help="Unsure: an average log-prob below this; such a window falls back.",
        rich_help_panel=PANEL_GUARDS,
    ),
]
CompressionRatioThresholdOpt = Annotated[
    float,
    typer.Option(
        metavar="R",
        help="Repetitive: text that compresses better than this (gzip); such a window "
        "falls back, and a segment that still is is dropped.",
        rich_help_panel=PANEL_GUARDS,
    ),
]
BatchSizeOpt = _count(int, help="Windows decoded together.", panel=PANEL_PERFORMANCE)
LatencyOpt = Annotated[
    str,
    typer.Option(
        metavar="SECONDS",
        help="Decode a window once its first speech has waited this long, without "
        "waiting for a full batch: text of live input as it is spoken. auto = "
        f"{LIVE_LATENCY_SECONDS:g} s for a pipe on stdin, off for files; off = never.",
        rich_help_panel=PANEL_PERFORMANCE,
    ),
]
QuietOpt = _flag(
    "--quiet",
    "-q",
    help="Nothing on stderr but errors: no progress, logs or warnings.",
    panel=PANEL_MESSAGES,
)
VerboseOpt = _flag(
    "--verbose",
    "-v",
    help="Also print each segment, and what the audio decoders said.",
    panel=PANEL_MESSAGES,
)
DebugOpt = _flag("--debug", help="Show tracebacks.", panel=PANEL_MESSAGES)

TRANSCRIBE_EXAMPLES = """[bold]Examples[/bold]

  whisper-cli transcribe talk.mp3                      [dim]# text to stdout[/dim]
  whisper-cli transcribe talk.mp3 -f srt > talk.srt    [dim]# subtitles[/dim]
  whisper-cli transcribe calls/ -r -o out -f all       [dim]# out/ mirrors calls/[/dim]
  curl -s URL | whisper-cli transcribe - -l German     [dim]# from stdin[/dim]
  whisper-cli transcribe *.wav -f jsonl -q | jq .text  [dim]# a JSON line each[/dim]
"""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(exc: WhisperCliError, debug: bool) -> typer.Exit:
    if debug:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    _stderr(f"whisper-cli: error: {exc.message}")
    return typer.Exit(exc.exit_code)


# --- the transcription options: one parameter set, built once into RunOptions ----------

# Every transcription option: its flag (annotated above) and default, in --help's order.
TRANSCRIPTION_OPTIONS: dict[str, tuple[Any, Any]] = {
    "fmt": (FormatOpt, Format.txt),
    "word_timestamps": (WordTimestampsOpt, False),
    "max_line_width": (MaxLineWidthOpt, None),
    "max_line_count": (MaxLineCountOpt, None),
    "max_words_per_line": (MaxWordsPerLineOpt, None),
    "highlight_words": (HighlightWordsOpt, False),
    "channel": (ChannelOpt, None),
    "model": (ModelOpt, None),
    "dtype": (DtypeOpt, Dtype.auto),
    "quantize": (QuantizeOpt, "none"),
    "device": (DeviceOpt, "auto"),
    "language": (LanguageOpt, None),
    "multilingual": (MultilingualOpt, False),
    "task": (TaskOpt, Task.transcribe),
    "no_timestamps": (NoTimestampsOpt, False),
    "max_new_tokens": (MaxNewTokensOpt, MAX_NEW_TOKENS),
    "initial_prompt": (InitialPromptOpt, None),
    "temperature": (TemperatureOpt, TEMPERATURES),
    "no_vad": (NoVadOpt, False),
    "vad_threshold": (VadThresholdOpt, Policy.vad_threshold),
    "no_speech_threshold": (NoSpeechThresholdOpt, Policy.no_speech_threshold),
    "logprob_threshold": (LogprobThresholdOpt, Policy.logprob_threshold),
    "compression_ratio_threshold": (
        CompressionRatioThresholdOpt,
        Policy.compression_ratio_threshold,
    ),
    "batch_size": (BatchSizeOpt, TranscribeOptions.batch_size),
    "compile": (CompileOpt, Compile.auto),
    "refill": (RefillOpt, None),
}
# What bench varies (its --dtype takes a list; its audio is its own) and what eval does.
BENCH_OPTIONS = (
    "model",
    "device",
    "compile",
    "refill",
    "language",
    "no_timestamps",
    "max_new_tokens",
    "batch_size",
    "word_timestamps",
    "no_vad",
)
EVAL_OPTIONS = ("model", "device", "batch_size", "no_vad")
MESSAGE_FLAGS = ("quiet", "verbose", "debug")


def takes_options(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command that takes these transcription flags (none named: every one), and gets
    them as one RunOptions in its keyword `options`, built by `run_options`.

    The flags are added to the command's signature, which Typer reads, so every command
    that takes an option takes the same flag, with the same help and default.
    """
    names = names or tuple(TRANSCRIPTION_OPTIONS)

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.name != "options"
        ]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=TRANSCRIPTION_OPTIONS[name][0],
                default=TRANSCRIPTION_OPTIONS[name][1],
            )
            for name in names
        ]

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            flags = {name: kwargs.pop(name) for name in names}
            try:
                # Warnings about the options themselves as one line each, as the run's.
                with _Terminal(quiet=kwargs.get("quiet", False), verbose=False).session():
                    options = run_options(flags)
            except WhisperCliError as exc:
                raise _fail(exc, kwargs.get("debug", False)) from None
            command(**kwargs, options=options)

        # --help lists panels in the order of their first flag: the messages' last.
        last = [p for p in own if p.name in MESSAGE_FLAGS]
        first = [p for p in own if p.name not in MESSAGE_FLAGS]
        signature = inspect.Signature([*first, *shared, *last])
        run.__signature__ = signature  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return run

    return decorate


def run_options(flags: dict[str, Any]) -> RunOptions:
    """The RunOptions of transcription flags (those not given at their defaults).

    The one place flags become options; it refuses, without a model, what is wrong or
    contradictory (bad language, channel or temperature, --multilingual with --language).
    """
    from whisper_cli.audio import parse_channel
    from whisper_cli.tokenizer import language_code

    f = {name: default for name, (_, default) in TRANSCRIPTION_OPTIONS.items()} | flags
    decoding = TranscribeOptions(
        language=None if f["language"] is None else language_code(f["language"]),
        multilingual=f["multilingual"],
        task=f["task"].value,
        timestamps=not f["no_timestamps"],
        batch_size=f["batch_size"],
        max_new_tokens=f["max_new_tokens"],
        initial_prompt=f["initial_prompt"],
        channel=parse_channel(f["channel"]),
        vad=not f["no_vad"],
        refill=f["refill"],
        policy=_policy(f),
        word_timestamps=f["word_timestamps"],
    )
    subtitles = SubtitleOptions(
        f["max_line_width"], f["max_line_count"], f["max_words_per_line"], f["highlight_words"]
    )
    options = RunOptions(
        model=f["model"],
        dtype=f["dtype"].value,
        quantize=f["quantize"],
        device=f["device"],
        compile=f["compile"].value,
        decoding=decoding,
        fmt=f["fmt"].value,
        subtitles=subtitles,
    )
    options.check()
    return options


def _policy(f: dict[str, Any]) -> Policy:
    """The policy of the flags given (a usage error when they are invalid)."""
    try:
        temperatures = tuple(float(t) for t in f["temperature"].split(","))
    except ValueError:
        raise WhisperCliError(
            f"invalid --temperature {f['temperature']!r}: one number or a comma list"
        ) from None
    try:
        return Policy(
            vad_threshold=f["vad_threshold"],
            temperatures=temperatures,
            no_speech_threshold=f["no_speech_threshold"],
            logprob_threshold=f["logprob_threshold"],
            compression_ratio_threshold=f["compression_ratio_threshold"],
        )
    except ValueError as exc:
        raise WhisperCliError(f"invalid option: {exc}") from None


def _load(model: str | None, policy, term: _Terminal, options=None):
    from whisper_cli.loading import load_model

    started = time.perf_counter()
    loaded = load_model(model, policy, options)
    term.info(
        f"model {loaded.name} ({loaded.path}), dtype {policy.name}, "
        f"device {policy.device} [{time.perf_counter() - started:.1f} s]"
    )
    if term.verbose and loaded.model.plan is not None:
        term.info(f"kernels {loaded.model.plan.summary()}")
    return loaded


# --- transcribe ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """What `transcribe` is asked beside its transcription options."""

    inputs: tuple[str, ...]
    output_dir: Path | None
    recursive: bool
    skip_existing: bool
    verbose: bool


@app.command(cls=_Command, epilog=TRANSCRIBE_EXAMPLES)
@takes_options()
def transcribe(
    inputs: InputsArg,
    output_dir: OutputDirOpt = None,
    recursive: RecursiveOpt = False,
    skip_existing: SkipExistingOpt = False,
    latency: LatencyOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
    *,
    options: RunOptions,
) -> None:
    """Transcribe audio files (any format, any length) to text, subtitles or JSON."""
    request = _Request(tuple(inputs), output_dir, recursive, skip_existing, verbose)
    term = _Terminal(quiet=quiet, verbose=verbose)
    try:
        options = options.with_latency(parse_latency(latency))
        with term.session():
            code = _transcribe(request, options, term)
    except _StdoutClosed:
        _silence_stdout()
        raise typer.Exit(EXIT_BROKEN_PIPE) from None
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted; finished outputs are complete, no partial file left")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


class _StdoutClosed(Exception):
    """The reader of stdout went away (`| head -1`): stop quietly."""


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush of stdout cannot fail."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _write_stdout(term: _Terminal, text: str) -> None:
    try:
        with term.above_progress():
            sys.stdout.write(text)
            sys.stdout.flush()
    except BrokenPipeError:
        raise _StdoutClosed from None
    except OSError as exc:  # a full disk (> /dev/full), an I/O error
        _silence_stdout()
        raise WhisperCliError(f"cannot write to stdout: {exc.strerror or exc}") from None


def _transcribe(request: _Request, options: RunOptions, term: _Terminal) -> int:
    from whisper_cli.inputs import expand_inputs
    from whisper_cli.outputs import OutputPlan

    started = time.perf_counter()
    if term.quiet and term.verbose:
        raise WhisperCliError("--quiet and --verbose contradict each other; give one")
    if request.inputs.count("-") > 1:
        raise WhisperCliError("stdin (-) can be given only once")
    expanded = expand_inputs(list(request.inputs), request.recursive)
    files = expanded.files
    n_inputs = len(files) + len(expanded.errors)
    plan = OutputPlan.make(options.fmt, request.output_dir, files, n_inputs, options.subtitles)
    plan.check_distinct([f.path for f in files])
    skipped = []
    if request.skip_existing:
        if request.output_dir is None:
            raise WhisperCliError("--skip-existing needs --output-dir")
        skipped = [f for f in files if f.path != "-" and plan.is_done(f.path)]
        files = [f for f in files if f not in skipped]
    plan.prepare()  # output folders exist and take a file, before any work
    for path in dict.fromkeys(expanded.duplicates):
        term.info(f"{path} is named more than once; transcribed once")
    if skipped:
        term.info(f"skipping {len(skipped)} input(s) with existing outputs")
    tally = _Tally(term, plan, request.verbose)
    try:
        _run(options, tally, expanded.errors, files)
    finally:
        plan.remove_created()  # nothing was written there: leave no empty folder behind
    _check_interrupt()
    tally.summary(n_inputs, len(skipped), time.perf_counter() - started)
    return EXIT_INPUT_FAILED if tally.failed else EXIT_OK


def _run(options: RunOptions, tally: _Tally, errors, files) -> None:
    """Open every input (and so validate it) before the model loads, then decode them."""
    start_up_imports("whisper_cli.pipeline")  # and so torch: see collector.py
    from whisper_cli.audio import open_audio
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.errors import InputError
    from whisper_cli.outputs import OutputStream
    from whisper_cli.pipeline import Transcriber

    policy = resolve_policy(options.dtype, options.device, options.quantize)
    decoding = options.for_device(policy.device.type)
    for err in errors:
        tally.error(err)
    sources = []
    for f in files:
        try:
            sources.append(open_audio(f.path, decoding.channel, stdin=sys.stdin.buffer))
        except InputError as err:
            tally.error(err)
    if not sources:
        return
    term = tally.term
    known = all(s.info.duration for s in sources)
    total = sum(s.info.duration or 0.0 for s in sources) if known else None
    tally.stream = OutputStream(
        tally.plan, [s.info.path for s in sources], lambda text: _write_stdout(term, text)
    )
    try:
        with term.progress(len(sources), total):
            loaded = _load(options.model, policy, term, decoding)
            transcriber = Transcriber(loaded, decoding)
            tally.multilingual = loaded.tokenizer.is_multilingual
            transcriber.run(
                sources, tally.result, tally.input_error, term.update, on_segments=tally.segments
            )
    finally:
        tally.stream.abort()  # interrupted or failed: no partial output file is left


class _Tally:
    """What transcribe shows and counts of each input as it ends; the closing line."""

    def __init__(self, term: _Terminal, plan, verbose: bool) -> None:
        self.term = term
        self.plan = plan
        self.verbose = verbose
        self.multilingual = False
        self.written = self.warned = self.failed = self.files_written = 0
        self.audio_seconds = 0.0
        self.stream = None  # the run's OutputStream, once its inputs are open

    def error(self, err: WhisperCliError) -> None:
        _check_interrupt()  # a read cut short by Ctrl-C is not a damaged file
        self.failed += 1
        self.term.error(err.message)

    def input_error(self, err: WhisperCliError) -> None:
        self.error(err)
        if isinstance(err, InputError):
            self.stream.drop(err.path)
        self.term.file_done()

    def segments(self, path: str, segments) -> None:
        _check_interrupt()
        if self.verbose:
            for s in segments:
                self.term.line(f"[{s.start:8.2f} --> {s.end:8.2f}] {s.text.strip()}")
        self.stream.segments(path, segments)

    def result(self, t) -> None:
        _check_interrupt()
        term = self.term
        if t.language and self.multilingual:
            prob = f" (p={t.language_probability:.2f})" if t.language_probability else ""
            term.info(f"{t.path}: language {t.language}{prob}")
        _show_warnings(term, t)
        self.files_written += len(self.stream.finish(t))
        self.written += 1
        self.warned += bool(t.warnings)
        self.audio_seconds += t.duration
        term.file_done()

    def summary(self, n_inputs: int, skipped: int, elapsed: float) -> None:
        """A run with several inputs counts them; one that writes files says what it wrote
        (otherwise a single input with -o would end without a word)."""
        if n_inputs > 1:
            parts = [f"{self.written} written"]
            parts += [f"{self.warned} with warnings"] if self.warned else []
            parts.append(f"{self.failed} failed")
            parts += [f"{skipped} skipped"] if skipped else []
        elif self.plan.output_dir is not None:
            n = self.files_written
            parts = [f"wrote {n} file{'' if n == 1 else 's'}"]
        else:
            return
        self.term.info(
            f"{', '.join(parts)}, {_duration(self.audio_seconds)} of audio in {_duration(elapsed)}"
        )


def _show_warnings(term: _Terminal, t) -> None:
    """The transcript's warnings on stderr (no speech is news, not a fault: an info line)."""
    for w in t.warnings:
        if w.code == "no_speech":
            term.info(f"{t.path}: {w.message}")
        else:
            term.warning(f"{t.path}: {w.message}")


def _duration(seconds: float) -> str:
    """4.2 s, 12 s, 2.5 min, 12 min, 1 h 05 min: the summaries' and progress lines' scale."""
    # Each unit while its rounded value stays below the next: no "60 s" or "10.0 min".
    if round(seconds) < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if round(seconds / 60, 1) < 10:
        return f"{seconds / 60:.1f} min"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class _Terminal:
    """What the transcribe command shows on stderr: messages, warnings, the progress bar.

    The bar (Rich, only when stderr is a terminal) draws on its own duplicate of fd 2,
    so that it is untouched while the audio reader captures fd 2 around C decoders. Lines
    printed while it is drawn go above it; transcripts written to a terminal stdout pause
    it. It is stopped (the cursor shown again) on every way out of `progress`.
    """

    def __init__(self, *, quiet: bool, verbose: bool) -> None:
        self.quiet = quiet
        self.verbose = verbose
        self.bar = None
        self._task = None
        self._files = (0, 0)  # done, total
        self._stage = "loading model"  # until the pipeline reports its own (Progress.stage)
        self._last = None  # the latest pipeline Progress

    # -- messages -----------------------------------------------------------------------

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            _stderr(text)

    def info(self, text: str) -> None:
        if not self.quiet:
            self.line(f"whisper-cli: {text}")

    def warning(self, text: str) -> None:
        if not self.quiet:
            self.line(f"whisper-cli: warning: {text}")

    def error(self, text: str) -> None:
        self.line(f"whisper-cli: error: {text}")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Python warnings become one `whisper-cli: warning:` line each while it lasts.

        Ours (WhisperCliWarning, or raised in this package) unless --quiet; what the audio
        decoders said and other libraries' warnings only with --verbose.
        """
        package = os.path.dirname(os.path.abspath(__file__))

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            ours = issubclass(category, WhisperCliWarning) or os.path.abspath(filename).startswith(
                package + os.sep
            )
            if (issubclass(category, DecoderMessage) or not ours) and not self.verbose:
                return
            self.warning(" ".join(str(message).split()))

        with warnings.catch_warnings():
            warnings.simplefilter("always", WhisperCliWarning)
            warnings.showwarning = show
            yield

    # -- progress -------------------------------------------------------------------------

    @contextlib.contextmanager
    def progress(self, n_files: int, total: float | None) -> Iterator[None]:
        if self.quiet or not sys.stderr.isatty():
            yield
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        self._files = (0, n_files)
        self._total = total
        tty = os.fdopen(os.dup(sys.stderr.fileno()), "w", encoding="utf-8", errors="replace")
        try:
            bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[audio]}"),
                TextColumn("{task.fields[speed]}"),
                TimeRemainingColumn(),
                console=Console(file=tty),
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._task = bar.add_task(self._description(), total=total, **self._fields(0.0, 0.0))
            self.bar = bar
            bar.start()
            yield
        finally:
            self.bar = None
            with contextlib.suppress(Exception):
                bar.stop()  # shows the cursor again
            tty.close()

    def _description(self) -> str:
        done, n = self._files
        if self._stage != "transcribing":
            return self._stage
        return f"transcribing {done}/{n} files" if n > 1 else "transcribing"

    def _fields(self, done: float, elapsed: float) -> dict[str, str]:
        total = f"/{self._total:.0f}" if self._total else ""
        speed = f"{done / elapsed:.1f}x real time" if elapsed > 0 and done > 0 else ""
        return {"audio": f"{done:.0f}{total} s audio", "speed": speed}

    def update(self, p) -> None:
        _check_interrupt()
        self._last = p
        self._stage = p.stage
        if self.bar is not None:
            self.bar.update(
                self._task,
                completed=p.audio_done,
                description=self._description(),
                **self._fields(p.audio_done, p.elapsed),
            )

    def file_done(self) -> None:
        done, n = self._files
        self._files = (done + 1, n)
        if self.bar is not None:
            self.bar.update(self._task, description=self._description())

    @contextlib.contextmanager
    def above_progress(self) -> Iterator[None]:
        """Write to stdout: when it is the terminal the bar is on, the bar steps aside."""
        bar = self.bar
        if bar is None or not sys.stdout.isatty():
            yield
            return
        bar.stop()
        try:
            yield
        finally:
            bar.start()


Engine = Enum("Engine", {name: name for name in ENGINES}, type=str)


ManifestArg = Annotated[
    str,
    typer.Argument(
        help="A directory (searched recursively), a text file of paths, or JSONL with "
        '"path" and optional "language"/"task"/"output"; a local path or an fsspec URL.'
    ),
]
BatchOutputDirOpt = Annotated[
    Path,
    typer.Option(
        "--output-dir",
        "-o",
        help="Write each input's files below DIR, as the manifest's tree holds it "
        "(a/x.wav: DIR/a/x.<ext>), and DIR/summary.jsonl.",
        rich_help_panel=PANEL_IO,
    ),
]
EngineOpt = Annotated[
    Engine, typer.Option(help="local: in this process; ray: a pool of Ray actors.")
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(help="auto or HOST:PORT of a running cluster; default: a local one."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Ray actors, each loading the model once; default: one per G GPUs of the "
        "cluster, or one per node without GPUs.",
    ),
]
GpusPerWorkerOpt = Annotated[
    float | None,
    typer.Option(
        min=0, help="G: GPUs per actor (0.5: two share one); default 1 where there are GPUs."
    ),
]
ShardOpt = Annotated[
    str | None,
    typer.Option(help="I/N: only part I of N (0-based) of the manifest, stable by path."),
]


@app.command(cls=_Command)
@takes_options()
def batch(
    manifest: ManifestArg,
    output_dir: BatchOutputDirOpt,
    engine: EngineOpt = Engine.local,
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    gpus_per_worker: GpusPerWorkerOpt = None,
    shard: ShardOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
    *,
    options: RunOptions,
) -> None:
    """Transcribe a manifest into a directory: resumable, shardable, locally or on Ray."""
    from whisper_cli.batch import BatchConfig, parse_shard

    try:
        config = BatchConfig(
            manifest=manifest,
            output_dir=output_dir,
            fmt=options.fmt,
            model=options.model,
            dtype=options.dtype,
            quantize=options.quantize,
            device=options.device,
            engine=engine.value,
            ray_address=ray_address,
            workers=workers,
            gpus_per_worker=gpus_per_worker,
            shard=parse_shard(shard) if shard is not None else None,
            subtitles=options.subtitles,
        )
        code = _batch(config, options, quiet)
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted; finished outputs are complete: run again to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


def _batch(config, options: RunOptions, quiet: bool) -> int:
    from whisper_cli.batch import run_batch

    def on_record(record) -> None:
        _check_interrupt()
        if record.status == "failed":
            _stderr(f"whisper-cli: error: {record.error}")
        for w in record.warnings if not quiet else ():
            kind = "" if w.code == "no_speech" else "warning: "
            _stderr(f"whisper-cli: {kind}{record.path}: {w.message}")

    def log(message: str) -> None:
        if not quiet:
            _stderr(f"whisper-cli: {message}")

    with _batch_progress(quiet) as on_progress:
        report = run_batch(config, options.for_device, on_record, on_progress, log)
    _check_interrupt()
    warned = f"{report.with_warnings} with warnings, " if report.with_warnings else ""
    log(
        f"{report.processed - report.failed} written, {warned}{report.failed} failed, "
        f"{report.skipped} already done, {_duration(report.audio_seconds)} of audio "
        f"in {_duration(report.elapsed)}; summary: {report.summary}"
    )
    return EXIT_INPUT_FAILED if report.failed else EXIT_OK


class _batch_progress:
    """Inputs done / total, audio decoded and RTFx on stderr: a bar on a terminal, else lines."""

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
            TextColumn("inputs, {task.fields[audio]} audio, RTFx {task.fields[rtfx]:.1f}"),
            console=Console(stderr=True),
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("transcribing", total=None, audio=_duration(0), rtfx=0.0)
        return self.update

    @staticmethod
    def _rtfx(p) -> float:
        return p.audio_seconds / p.elapsed if p.elapsed > 0 else 0.0

    def line(self, p) -> None:
        _stderr(
            f"whisper-cli: {p.done}/{p.total} inputs ({p.failed} failed), "
            f"{_duration(p.audio_seconds)} audio, RTFx {self._rtfx(p):.1f}"
        )

    def update(self, p) -> None:
        self.bar.update(
            self.task,
            completed=p.done,
            total=p.total,
            audio=_duration(p.audio_seconds),
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
    from whisper_cli.tools.convert import convert_ct2

    try:
        convert_ct2(src, dst)
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    _stderr(f"whisper-cli: wrote {dst}")


JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]


@app.command(name="eval", cls=_Command)
@takes_options(*EVAL_OPTIONS)
def eval_command(
    manifest: Annotated[Path, typer.Argument(help="Manifest JSON (clips with references).")],
    dtype: Annotated[
        str, typer.Option(help="auto, f32, f16, bf16, or all (f32, f16 and bf16).")
    ] = "f32",
    quantize: QuantizeOpt = "none",
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    *,
    options: RunOptions,
) -> None:
    """Word error rate (pooled over the clips) of a manifest, per dtype."""
    import json

    from whisper_cli.tools.evaluate import evaluate, render_table, report_to_json

    try:
        with _Terminal(quiet=False, verbose=False).session():
            report = evaluate(
                manifest,
                options.model,
                dtype.split(","),
                device=options.device,
                batch_size=options.decoding.batch_size,
                vad=options.decoding.vad,
                quantize=quantize,
            )
    except WhisperCliError as exc:
        raise _fail(exc, debug) from None
    print(json.dumps(report_to_json(report), indent=2) if json_out else render_table(report))


@app.command(cls=_Command)
@takes_options(*BENCH_OPTIONS)
def bench(
    dtype: Annotated[str, typer.Option(help="auto, f32, f16, bf16, or all.")] = "auto",
    quantize: QuantizeOpt = "none",
    audio: Annotated[
        str | None, typer.Option(help="Audio file or .npy; default: the bundled real speech.")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Tile the audio to this many seconds.")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs; the median is shown.")] = 3,
    against: Annotated[
        str | None, typer.Option(help="transformers: also run the reference and compare.")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch threads; default: torch's choice.")
    ] = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds per configuration.")] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    *,
    options: RunOptions,
) -> None:
    """Speed and memory, reproducibly, optionally beside the transformers reference."""
    import json

    from whisper_cli.tools.bench import BenchConfig, render_table, report_to_json, run_bench

    config = BenchConfig.of(
        options,
        dtypes=tuple(dtype.split(",")),
        quantize=quantize,
        audio=audio,
        duration=duration,
        repeats=repeats,
        against=against,
        threads=threads,
        timeout_s=timeout,
    )
    try:
        with _Terminal(quiet=False, verbose=False).session():
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
    except SystemExit as exc:  # every command ends so (click's standalone mode)
        code = exc.code
    except KeyboardInterrupt:
        _stderr("whisper-cli: interrupted")
        code = EXIT_INTERRUPTED
    except WhisperCliError as exc:  # raised outside a command's own handler
        code = _fail(exc, debug).exit_code
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
        code = EXIT_USAGE
    _exit(0 if code is None else code)


def _exit(code: int | str) -> None:
    """Leave the process as a normal exit would (the atexit handlers run, both streams
    flushed, the same status), without the interpreter's teardown of every module and
    object after it: with torch imported that alone takes 0.47-0.51 s (`import torch`,
    then exit; AMD EPYC Zen 4), time in every run that produces nothing. Where a normal
    exit would do more (a non-daemon thread still running, waited for; a status that is
    a message; a stream that cannot be flushed), it exits normally."""
    import atexit
    import threading

    main_thread = threading.main_thread()
    waits = any(t is not main_thread and not t.daemon for t in threading.enumerate())
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # CPython's own, run at exit
    if waits or not isinstance(code, int) or run_exitfuncs is None:
        sys.exit(code)
    run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)  # the interpreter reports it, as a normal exit does
    os._exit(code)


__all__ = ["EXIT_USAGE", "app", "main"]
