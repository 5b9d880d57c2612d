"""The command line: parse, call the library, render. The only module that knows Typer and Rich.

Heavy imports (torch, the model) happen inside the commands, so `--help` is instant.
Exit codes: 0 success, 1 some input failed, 2 run-level error, 130 interrupted,
141 stdout closed by its reader (`| head`).

Every check that needs no model runs before it loads (options, output folders, every
input opened and validated), so a mistake costs a second, not a model load and a decode.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

from whisper_cli import __version__
from whisper_cli.allocator import keep_freed_memory
from whisper_cli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INPUT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    DecoderMessage,
    WhisperCliError,
    WhisperCliWarning,
)
from whisper_cli.options import COMPILE_CHOICES, Policy, default_model, use_compile

if TYPE_CHECKING:
    from whisper_cli.pipeline import TranscribeOptions


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


# --- options: one alias each, shared by every command that takes them --------------------

PANEL_IO = "Input and output"
PANEL_MODEL = "Model and precision"
PANEL_DECODING = "Decoding"
PANEL_GUARDS = "Guards (what is dropped as silence or repetition)"
PANEL_PERFORMANCE = "Performance"
PANEL_MESSAGES = "Messages"

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
DeviceOpt = Annotated[
    str,
    typer.Option(metavar="DEV", help="auto, cpu, cuda or cuda:N.", rich_help_panel=PANEL_MODEL),
]
CompileOpt = Annotated[
    Compile,
    typer.Option(
        help="torch.compile the decode step: auto = on for CUDA.",
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
MultilingualOpt = Annotated[
    bool,
    typer.Option(
        "--multilingual",
        metavar="",
        help="Detect the language of every 30 s window, not once per file "
        "(multilingual models; not with --language).",
        rich_help_panel=PANEL_DECODING,
    ),
]
TaskOpt = Annotated[
    Task,
    typer.Option(help="transcribe, or translate to English.", rich_help_panel=PANEL_DECODING),
]
NoTimestampsOpt = Annotated[
    bool,
    typer.Option(
        "--no-timestamps",
        metavar="",
        help="Decode without timestamps: faster, but drops whole utterances from "
        "independent windows (measured: 21-30% of words lost).",
        rich_help_panel=PANEL_DECODING,
    ),
]
MaxNewTokensOpt = Annotated[
    int,
    typer.Option(
        min=1,
        metavar="N",
        help="Most tokens decoded per 30 s window (a warning says when text was cut).",
        rich_help_panel=PANEL_DECODING,
    ),
]
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
RecursiveOpt = Annotated[
    bool,
    typer.Option(
        "--recursive",
        "-r",
        metavar="",
        help="Also read the subdirectories of directory inputs.",
        rich_help_panel=PANEL_IO,
    ),
]
SkipExistingOpt = Annotated[
    bool,
    typer.Option(
        "--skip-existing",
        metavar="",
        help="Skip inputs whose outputs exist in --output-dir (resume a run).",
        rich_help_panel=PANEL_IO,
    ),
]
WordTimestampsOpt = Annotated[
    bool,
    typer.Option(
        "--word-timestamps",
        metavar="",
        help="Time every word (json/jsonl 'words'; word-timed subtitle cues).",
        rich_help_panel=PANEL_IO,
    ),
]
MaxLineWidthOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="Subtitles: characters per line (needs --word-timestamps).",
        rich_help_panel=PANEL_IO,
    ),
]
MaxLineCountOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="Subtitles: lines per cue, with --max-line-width.",
        rich_help_panel=PANEL_IO,
    ),
]
MaxWordsPerLineOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="Subtitles: words per cue (no effect with --max-line-width).",
        rich_help_panel=PANEL_IO,
    ),
]
HighlightWordsOpt = Annotated[
    bool,
    typer.Option(
        "--highlight-words",
        metavar="",
        help="srt/vtt: underline each word as it is spoken.",
        rich_help_panel=PANEL_IO,
    ),
]
NoVadOpt = Annotated[
    bool,
    typer.Option(
        "--no-vad",
        metavar="",
        help="Decode every window, also where the speech detector (Silero VAD, on by "
        "default) hears no speech: for audio that defeats the detector.",
        rich_help_panel=PANEL_GUARDS,
    ),
]
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
BatchSizeOpt = Annotated[
    int,
    typer.Option(
        min=1, metavar="N", help="Windows decoded together.", rich_help_panel=PANEL_PERFORMANCE
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        metavar="",
        help="Nothing on stderr but errors: no progress, logs or warnings.",
        rich_help_panel=PANEL_MESSAGES,
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        metavar="",
        help="Also print each segment, and what the audio decoders said.",
        rich_help_panel=PANEL_MESSAGES,
    ),
]
DebugOpt = Annotated[
    bool,
    typer.Option("--debug", metavar="", help="Show tracebacks.", rich_help_panel=PANEL_MESSAGES),
]

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


def transcribe_options(a: dict[str, Any], device_type: str) -> TranscribeOptions:
    """TranscribeOptions from a command's parsed transcribe options (the names above).

    The one place that maps them; it also refuses what is wrong or contradictory
    without a model (bad language or channel, --multilingual with --language).
    """
    from whisper_cli.audio import parse_channel
    from whisper_cli.pipeline import TranscribeOptions, check_options
    from whisper_cli.tokenizer import language_code

    options = TranscribeOptions(
        language=None if a["language"] is None else language_code(a["language"]),
        multilingual=a["multilingual"],
        task=a["task"].value,
        timestamps=not a["no_timestamps"],
        batch_size=a["batch_size"],
        max_new_tokens=a["max_new_tokens"],
        initial_prompt=a["initial_prompt"],
        channel=parse_channel(a["channel"]),
        compile=use_compile(a["compile"], device_type),
        vad=not a["no_vad"],
        policy=_policy(a),
        word_timestamps=a.get("word_timestamps", False),
    )
    check_options(options)
    return options


def _policy(a: dict[str, Any]) -> Policy:
    """The policy of the options given (a usage error when they are invalid)."""
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


def _load(model: str | None, policy, term: _Terminal):
    from whisper_cli.loading import load_model

    started = time.perf_counter()
    loaded = load_model(model, policy)
    term.info(
        f"model {loaded.name} ({loaded.path}), dtype {policy.name}, "
        f"device {policy.device} [{time.perf_counter() - started:.1f} s]"
    )
    return loaded


@app.command(cls=_Command, epilog=TRANSCRIBE_EXAMPLES)
def transcribe(
    inputs: InputsArg,
    fmt: FormatOpt = Format.txt,
    output_dir: OutputDirOpt = None,
    recursive: RecursiveOpt = False,
    skip_existing: SkipExistingOpt = False,
    word_timestamps: WordTimestampsOpt = False,
    max_line_width: MaxLineWidthOpt = None,
    max_line_count: MaxLineCountOpt = None,
    max_words_per_line: MaxWordsPerLineOpt = None,
    highlight_words: HighlightWordsOpt = False,
    channel: ChannelOpt = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    language: LanguageOpt = None,
    multilingual: MultilingualOpt = False,
    task: TaskOpt = Task.transcribe,
    no_timestamps: NoTimestampsOpt = False,
    max_new_tokens: MaxNewTokensOpt = 224,
    initial_prompt: InitialPromptOpt = None,
    temperature: TemperatureOpt = TEMPERATURES,
    no_vad: NoVadOpt = False,
    vad_threshold: VadThresholdOpt = Policy.vad_threshold,
    no_speech_threshold: NoSpeechThresholdOpt = Policy.no_speech_threshold,
    logprob_threshold: LogprobThresholdOpt = Policy.logprob_threshold,
    compression_ratio_threshold: CompressionRatioThresholdOpt = Policy.compression_ratio_threshold,
    batch_size: BatchSizeOpt = 16,
    compile: CompileOpt = Compile.auto,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Transcribe audio files (any format, any length) to text, subtitles or JSON."""
    a = dict(locals())
    term = _Terminal(quiet=quiet, verbose=verbose)
    try:
        with term.session():
            code = _transcribe(a, term)
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


def _write_stdout(term: _Terminal, write) -> None:
    try:
        with term.above_progress():
            write()
    except BrokenPipeError:
        raise _StdoutClosed from None
    except OSError as exc:  # a full disk (> /dev/full), an I/O error
        _silence_stdout()
        raise WhisperCliError(f"cannot write to stdout: {exc.strerror or exc}") from None


def _transcribe(a: dict[str, Any], term: _Terminal) -> int:
    from whisper_cli.inputs import expand_inputs
    from whisper_cli.outputs import OutputPlan

    started = time.perf_counter()
    if a["quiet"] and a["verbose"]:
        raise WhisperCliError("--quiet and --verbose contradict each other; give one")
    if a["inputs"].count("-") > 1:
        raise WhisperCliError("stdin (-) can be given only once")
    expanded = expand_inputs(a["inputs"], a["recursive"])
    files = expanded.files
    n_inputs = len(files) + len(expanded.errors)
    from whisper_cli.formats import SubtitleOptions

    subtitles = SubtitleOptions(
        a["max_line_width"], a["max_line_count"], a["max_words_per_line"], a["highlight_words"]
    )
    subtitles.check(a["word_timestamps"])
    plan = OutputPlan.make(a["fmt"].value, a["output_dir"], files, n_inputs, subtitles)
    plan.check_distinct([f.path for f in files])
    skipped = []
    if a["skip_existing"]:
        if a["output_dir"] is None:
            raise WhisperCliError("--skip-existing needs --output-dir")
        skipped = [f for f in files if f.path != "-" and plan.is_done(f.path)]
        files = [f for f in files if f not in skipped]
    plan.prepare()  # output folders exist and take a file, before any work
    try:
        return _run(a, term, plan, expanded, files, skipped, started)
    finally:
        plan.remove_created()  # nothing was written there: leave no empty folder behind


def _run(a, term: _Terminal, plan, expanded, files, skipped, started: float) -> int:
    """The rest of _transcribe, once the output folders exist."""
    for path in dict.fromkeys(expanded.duplicates):
        term.info(f"{path} is named more than once; transcribed once")
    if skipped:
        term.info(f"skipping {len(skipped)} input(s) with existing outputs")

    from whisper_cli.audio import open_audio
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.errors import InputError

    policy = resolve_policy(a["dtype"].value, a["device"])
    options = transcribe_options(a, policy.device.type)
    failures = 0

    def on_error(err: WhisperCliError) -> None:
        nonlocal failures
        _check_interrupt()  # a read cut short by Ctrl-C is not a damaged file
        failures += 1
        term.error(err.message)

    for err in expanded.errors:
        on_error(err)
    # Every input is opened (and so validated) before the model loads.
    sources = []
    for f in files:
        try:
            sources.append(open_audio(f.path, options.channel, stdin=sys.stdin.buffer))
        except InputError as err:
            on_error(err)
    written, warned, files_written, audio_seconds = 0, 0, 0, 0.0
    n_inputs = len(expanded.files) + len(expanded.errors)
    if sources:
        known = all(s.info.duration for s in sources)
        total = sum(s.info.duration or 0.0 for s in sources) if known else None
        with term.progress(len(sources), total):
            loaded = _load(a["model"], policy, term)
            from whisper_cli.pipeline import Transcriber

            transcriber = Transcriber(loaded, options)

            def on_result(t) -> None:
                nonlocal written, warned, files_written, audio_seconds
                _check_interrupt()
                if t.language and loaded.tokenizer.is_multilingual:
                    prob = f" (p={t.language_probability:.2f})" if t.language_probability else ""
                    term.info(f"{t.path}: language {t.language}{prob}")
                if a["verbose"]:
                    for s in t.segments:
                        term.line(f"[{s.start:8.2f} --> {s.end:8.2f}] {s.text.strip()}")
                _show_warnings(term, t)
                if plan.output_dir is None:
                    _write_stdout(term, lambda: plan.emit(t, sys.stdout))
                else:
                    files_written += len(plan.emit(t, sys.stdout))
                written += 1
                warned += bool(t.warnings)
                audio_seconds += t.duration
                term.file_done()

            def on_input_error(err: WhisperCliError) -> None:
                on_error(err)
                term.file_done()

            transcriber.run(sources, on_result, on_input_error, term.update)
    _check_interrupt()
    # A run with several inputs counts them; one that writes files says what it wrote
    # (otherwise a single input with -o would end without a word).
    if n_inputs > 1:
        parts = [f"{written} written", *([f"{warned} with warnings"] if warned else [])]
        parts.append(f"{failures} failed")
        if skipped:
            parts.append(f"{len(skipped)} skipped")
    elif plan.output_dir is not None:
        parts = [f"wrote {files_written} file{'' if files_written == 1 else 's'}"]
    else:
        parts = []
    if parts:
        term.info(
            f"{', '.join(parts)}, {_duration(audio_seconds)} of audio "
            f"in {_duration(time.perf_counter() - started)}"
        )
    return EXIT_INPUT_FAILED if failures else EXIT_OK


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
        self._stage = "loading model"
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


class Engine(str, Enum):
    local = "local"
    ray = "ray"


@app.command(cls=_Command)
def batch(
    manifest: Annotated[
        str,
        typer.Argument(
            help="A directory (searched recursively), a text file of paths, or JSONL with "
            '"path" and optional "language"/"task"/"output"; a local path or an fsspec URL.'
        ),
    ],
    output_dir: Annotated[
        Path,
        typer.Option(
            "--output-dir",
            "-o",
            help="Write each input's files below DIR, as the manifest's tree holds it "
            "(a/x.wav: DIR/a/x.<ext>), and DIR/summary.jsonl.",
        ),
    ],
    engine: Annotated[
        Engine, typer.Option(help="local: in this process; ray: a pool of Ray actors.")
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
    no_timestamps: NoTimestampsOpt = False,
    batch_size: BatchSizeOpt = 16,
    max_new_tokens: MaxNewTokensOpt = 224,
    initial_prompt: InitialPromptOpt = None,
    channel: ChannelOpt = None,
    fmt: FormatOpt = Format.txt,
    compile: CompileOpt = Compile.auto,
    temperature: TemperatureOpt = TEMPERATURES,
    no_vad: NoVadOpt = False,
    vad_threshold: VadThresholdOpt = Policy.vad_threshold,
    no_speech_threshold: NoSpeechThresholdOpt = Policy.no_speech_threshold,
    logprob_threshold: LogprobThresholdOpt = Policy.logprob_threshold,
    compression_ratio_threshold: CompressionRatioThresholdOpt = Policy.compression_ratio_threshold,
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
        for w in record.warnings if not quiet else ():
            kind = "" if w.code == "no_speech" else "warning: "
            _stderr(f"whisper-cli: {kind}{record.path}: {w.message}")

    def log(message: str) -> None:
        if not quiet:
            _stderr(f"whisper-cli: {message}")

    with _batch_progress(quiet) as on_progress:
        report = run_batch(
            config,
            lambda device_type: transcribe_options(a, device_type),
            on_record,
            on_progress,
            log,
        )
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

    from whisper_cli.tools.evaluate import evaluate, render_table, report_to_json

    try:
        with _Terminal(quiet=False, verbose=False).session():
            report = evaluate(
                manifest,
                model,
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
    word_timestamps: Annotated[
        bool, typer.Option(help="Also time words (the alignment pass's cost).")
    ] = False,
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

    from whisper_cli.tools.bench import BenchConfig, render_table, report_to_json, run_bench

    config = BenchConfig(
        model=model,
        dtypes=tuple(dtype.split(",")),
        batch_size=batch_size,
        audio=audio,
        duration=duration,
        max_new_tokens=max_new_tokens,
        compile=compile.value,
        repeats=repeats,
        timestamps=timestamps,
        word_timestamps=word_timestamps,
        vad=vad,
        against=against,
        device=device,
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
