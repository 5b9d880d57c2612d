"""Transcribe many inputs of any length in batches of independent 30 s windows.

Data flows one way: inputs -> audio blocks -> windows -> batches -> log-mel ->
encoder -> greedy decoder -> segments -> one Transcript per input, handed to a
callback as soon as its last window is decoded. Windows of one file and of several
files share batches; only a batch of windows is held in memory at a time.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from whisper_cli.audio import AudioSource, open_audio
from whisper_cli.decoding import DecodedRow, DecodeOptions, GreedyDecoder, LanguageGuess
from whisper_cli.dtypes import dtype_name
from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.features import SAMPLE_RATE, batch_log_mel
from whisper_cli.loading import LoadedModel
from whisper_cli.results import Segment, Transcript
from whisper_cli.segments import attach_words, window_segments
from whisper_cli.timing import Aligner, AlignRow
from whisper_cli.tokenizer import TIME_PRECISION
from whisper_cli.windows import Window, cut_windows

TASKS = ("transcribe", "translate")
# A window whose loudest sample is below this (-80 dBFS, about 3 LSB of 16-bit audio) holds
# no audible signal; the model still writes text for it (" you"), so it is not decoded.
SILENCE_PEAK = 1e-4
# A window's decode may not end while the audio after its latest timestamp is at least
# OPEN_MIN_SECONDS long and holds OPEN_SOUND_SECONDS within OPEN_SOUND_DB of the window's
# loud level (and above OPEN_SILENCE_DBFS: digital silence is never worth decoding).
OPEN_MIN_SECONDS = 0.3
OPEN_SOUND_DB = 25.0
OPEN_SOUND_SECONDS = 0.25
OPEN_SILENCE_DBFS = -70.0
# Text written after the point where the decoder would have ended is kept only when its
# average log-prob is at least this. On the shared clips and tiled copies of them, speech
# read there scored -0.05 to -0.44, and what the models wrote for noise ("Thank you.",
# "Wow.", "Ah!") -0.69 to -1.5.
CONTINUED_LOGPROB = -0.6
# ... and when it fits the audio left after the point: speech read there ran at up to 21
# characters per second.
CONTINUED_MAX_CHARS_PER_SECOND = 30.0


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: detect per input (or per window if multilingual)
    multilingual: bool = False  # detect the language of every window
    task: str = "transcribe"
    timestamps: bool = True
    batch_size: int = 16
    max_new_tokens: int = 224
    initial_prompt: str | None = None
    channel: str | int | None = None
    compile: bool = False
    # Silence / hallucination guards, openai-whisper's defaults.
    no_speech_threshold: float = 0.6
    logprob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    word_timestamps: bool = False  # words with times (one alignment pass per batch)


@dataclass(frozen=True)
class Progress:
    """What the pipeline reports after each batch."""

    audio_done: float  # seconds of audio decoded so far
    audio_total: float  # seconds of audio in all inputs (known durations)
    elapsed: float


@dataclass
class _Input:
    index: int
    path: str
    source: AudioSource
    duration: float = 0.0
    language: LanguageGuess | None = None
    segments: list[Segment] = field(default_factory=list)
    pending: int = 0  # windows cut or queued but not decoded yet
    cut_done: bool = False  # the last window of this input has been cut
    started: float = field(default_factory=time.perf_counter)


def validate_options(loaded: LoadedModel, options: TranscribeOptions) -> None:
    """Run-level checks, before any work starts."""
    tokenizer = loaded.tokenizer
    if options.task not in TASKS:
        raise WhisperCliError(f"invalid task {options.task!r}; choose transcribe or translate")
    if options.batch_size < 1:
        raise WhisperCliError("--batch-size must be at least 1")
    if options.language is not None:
        if not tokenizer.is_multilingual and options.language != "en":
            raise WhisperCliError(
                f"{loaded.name} is an English-only model; it cannot transcribe "
                f"language {options.language!r} (use a multilingual model)"
            )
        if tokenizer.is_multilingual:
            tokenizer.language_id(options.language)
    if not tokenizer.is_multilingual and options.task == "translate":
        raise WhisperCliError(f"{loaded.name} is an English-only model; it cannot translate")


class Transcriber:
    """Holds a loaded model and decodes batches of windows from many inputs."""

    def __init__(self, loaded: LoadedModel, options: TranscribeOptions) -> None:
        validate_options(loaded, options)
        self.loaded = loaded
        self.options = options
        tokenizer = loaded.tokenizer
        prompt = ()
        if options.initial_prompt:
            # Fixed for the run, so every window's prompt (and the step's shape) is the same.
            max_prompt = loaded.config.max_target_positions // 2 - 1
            prompt = tuple(tokenizer.encode_text(" " + options.initial_prompt.strip()))
            prompt = prompt[-max_prompt:]
        on_cuda = loaded.policy.device.type == "cuda"
        step = None
        if options.compile:
            from whisper_cli.compiled import compiled_step

            step = compiled_step(loaded.model)
        self.decoder = GreedyDecoder(
            loaded,
            DecodeOptions(
                task=options.task,
                timestamps=options.timestamps,
                max_new_tokens=options.max_new_tokens,
                prompt_tokens=prompt,
                sync_every=8 if on_cuda else 1,
                open_max_no_speech=options.no_speech_threshold,
                shrink_batch=not options.compile,
            ),
            step=step,
        )
        self.aligner = Aligner(loaded, options.task) if options.word_timestamps else None
        # A compiled step has one batch shape: pad the last batch up to it.
        self.pad_batches = options.compile
        self.rows = options.batch_size  # halved for the rest of the run on out-of-memory

    # -- public API ----------------------------------------------------------------

    def transcribe(self, path: str, stdin=None) -> Transcript:
        """One input, whole (convenience for library users and tests)."""
        results: list[Transcript] = []
        errors: list[InputError] = []
        self.run([path], results.append, errors.append, stdin=stdin)
        if errors:
            raise errors[0]
        return results[0]

    def run(
        self,
        paths: Iterable[str],
        on_result: Callable[[Transcript], None],
        on_error: Callable[[InputError], None],
        on_progress: Callable[[Progress], None] | None = None,
        stdin=None,
    ) -> None:
        """Transcribe every path; each result or per-input error is reported as it happens."""
        inputs: list[_Input] = []
        for path in paths:
            try:
                source = open_audio(path, channel=self.options.channel, stdin=stdin)
            except InputError as exc:
                on_error(exc)
                continue
            inputs.append(_Input(len(inputs), path, source))
        total = sum(i.source.info.duration or 0.0 for i in inputs)
        started = time.perf_counter()
        done_audio = 0.0
        failed: set[int] = set()
        for batch in self._batches(inputs, failed, on_error):
            self._decode_batch(inputs, batch)
            done_audio += sum(len(w.audio) for w in batch) / SAMPLE_RATE
            for window in batch:
                item = inputs[window.source]
                item.pending -= 1
                if item.pending == 0 and item.cut_done and item.index not in failed:
                    on_result(self._finish(item))
            if on_progress:
                on_progress(Progress(done_audio, total, time.perf_counter() - started))

    # -- batching --------------------------------------------------------------------

    def _windows(
        self, inputs: list[_Input], failed: set[int], on_error: Callable[[InputError], None]
    ) -> Iterator[Window]:
        for item in inputs:
            try:
                item.started = time.perf_counter()  # its wall time counts from its first window
                windows = cut_windows(item.source.blocks(), source=item.index)
                window = next(windows, None)
                if window is None:
                    raise InputError(item.path, "contains no audio")
                while window is not None:
                    # One window of look-ahead: an input is known to be cut through when its
                    # last window is yielded, so it is handed over as soon as that is decoded
                    # (not only when a later batch happens to hold one of its windows).
                    following = next(windows, None)
                    item.pending += 1
                    item.duration = window.end
                    item.cut_done = following is None
                    yield window
                    window = following
            except InputError as exc:
                failed.add(item.index)
                on_error(exc)
            item.cut_done = True

    def _batches(
        self, inputs: list[_Input], failed: set[int], on_error: Callable[[InputError], None]
    ) -> Iterator[list[Window]]:
        windows = self._windows(inputs, failed, on_error)
        while batch := list(itertools.islice(windows, self.options.batch_size)):
            yield batch

    # -- decoding --------------------------------------------------------------------

    def _decode_batch(self, inputs: list[_Input], batch: list[Window]) -> None:
        """Decode a batch in chunks of self.rows; out of memory halves self.rows and retries."""
        batch = [w for w in batch if w.audio.size and np.abs(w.audio).max() >= SILENCE_PEAK]
        done = 0
        while done < len(batch):
            chunk = batch[done : done + self.rows]
            try:
                self._decode_rows(inputs, chunk)
            except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError in newer torch
                if self.rows == 1:
                    raise WhisperCliError("out of memory with a batch of one window") from None
                self.rows //= 2
                if self.loaded.policy.device.type == "cuda":
                    torch.cuda.empty_cache()
                warnings.warn(
                    f"out of memory at batch size {len(chunk)}; "
                    f"retrying with batch size {self.rows}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue  # nothing of the chunk was kept: decode it again, smaller
            done += len(chunk)

    def _decode_rows(self, inputs: list[_Input], batch: list[Window]) -> None:
        device = self.loaded.policy.device
        n_rows = self.rows if self.pad_batches else len(batch)
        mel = batch_log_mel(
            [w.audio for w in batch], n_rows, self.loaded.config.num_mel_bins, device
        )
        with torch.inference_mode():
            features = self.decoder.encode(mel)
        languages = self._languages(inputs, batch, features)
        languages += [languages[0]] * (n_rows - len(batch))  # padding rows
        open_after = None
        if self.options.timestamps:
            n_ts = self.loaded.config.vocab_size - self.loaded.tokenizer.special.timestamp_begin
            table = np.zeros((n_rows, n_ts), dtype=bool)  # padding rows: never open
            for r, window in enumerate(batch):
                table[r] = open_after_timestamps(window.audio, n_ts)
            open_after = torch.from_numpy(table).to(device)
        rows = self.decoder.decode(features, languages, open_after)
        kept: list[list[Segment]] = []
        for window, row in zip(batch, rows, strict=False):
            kept.append([])
            duration = len(window.audio) / SAMPLE_RATE
            if self._is_silent(row.no_speech_prob, row.avg_logprob, row.tokens):
                continue
            tokens = row.tokens
            if row.continued_at >= 0:
                tokens = tokens[: self._continued_end(row, duration)]
            segments = window_segments(
                tokens,
                self.loaded.tokenizer,
                offset=window.start,
                duration=duration,
                avg_logprob=row.avg_logprob,
                no_speech_prob=row.no_speech_prob,
                language=row.language,
            )
            ratio = self.options.compression_ratio_threshold
            kept[-1] = [s for s in segments if s.compression_ratio <= ratio]
        if self.aligner is not None:  # one pass for the batch; windows in order of time
            aligned = self.aligner.align(
                features,
                [
                    AlignRow(sum((s.tokens for s in segs), ()), len(w.audio), row.language)
                    for w, row, segs in zip(batch, rows, kept, strict=False)
                ],
            )
            for r, window in enumerate(batch):
                done = inputs[window.source].segments
                last_speech = done[-1].end if done else 0.0
                done.extend(attach_words(kept[r], aligned[r], window.start, last_speech))
        else:
            for window, segs in zip(batch, kept, strict=True):
                inputs[window.source].segments.extend(segs)

    def _continued_end(self, row: DecodedRow, duration: float) -> int:
        """How many of the row's tokens are kept when it went on past its own end.

        The audio after the point where it would have ended held sound, so the decoder
        went on. What it wrote there is kept when it is confident (noise gives " Thank
        you." or " Wow." at low log-probs), and then segment by segment while the text
        fits the audio left: it may also repeat the last sentence, or the window's
        earlier text, at a rate no one speaks.
        """
        if row.continued_logprob < CONTINUED_LOGPROB:
            return row.continued_at
        tokenizer = self.loaded.tokenizer
        ts_begin = tokenizer.special.timestamp_begin
        stamps = [t for t in row.tokens[: row.continued_at] if t >= ts_begin]
        left = duration - ((stamps[-1] - ts_begin) * TIME_PRECISION if stamps else 0.0)
        budget = CONTINUED_MAX_CHARS_PER_SECOND * max(left, 0.0)
        end, text = row.continued_at, []
        for i in range(row.continued_at, len(row.tokens)):
            if row.tokens[i] < ts_begin:
                text.append(row.tokens[i])
            elif text and row.tokens[i - 1] < ts_begin:  # a segment's closing timestamp
                if len(tokenizer.decode(text).strip()) > budget:
                    break
                end = i + 1
        return end

    def _is_silent(
        self, no_speech_prob: float, avg_logprob: float, tokens: tuple[int, ...]
    ) -> bool:
        """openai-whisper's rule: likely no speech, and the text is not confidently decoded.

        A confident decode overrides the no-speech probability only when it holds words: text
        of punctuation or symbols alone (" . . .", music notes) under a high no-speech
        probability is what the model writes for noise and tones, not speech.
        """
        o = self.options
        if no_speech_prob <= o.no_speech_threshold:
            return False
        if avg_logprob < o.logprob_threshold:
            return True
        ts_begin = self.loaded.tokenizer.special.timestamp_begin
        text = self.loaded.tokenizer.decode([t for t in tokens if t < ts_begin])
        return not any(ch.isalnum() for ch in text)

    def _languages(
        self, inputs: list[_Input], batch: list[Window], features: torch.Tensor
    ) -> list[str | None]:
        """The language of each row: given, per input (first window), or per window."""
        if not self.loaded.tokenizer.is_multilingual:
            return [None] * len(batch)
        if self.options.language is not None:
            return [self.options.language] * len(batch)
        if self.options.multilingual:
            need = list(range(len(batch)))
        else:
            need = [r for r, w in enumerate(batch) if inputs[w.source].language is None]
        guesses: dict[int, LanguageGuess] = {}
        if need:
            # One step over the whole batch (fixed shape), read for the rows that need it.
            detected = self.decoder.detect_language(features)
            guesses = {r: detected[r] for r in need}
        languages: list[str | None] = []
        for r, window in enumerate(batch):
            item = inputs[window.source]
            if item.language is None and r in guesses:
                item.language = guesses[r]  # the first window of the input decides
            guess = guesses[r] if self.options.multilingual else item.language
            languages.append(guess.code)
        return languages

    def _finish(self, item: _Input) -> Transcript:
        segments = tuple(sorted(item.segments, key=lambda s: s.start))
        text = "".join(s.text for s in segments).strip()
        language = item.language.code if item.language else None
        if not self.loaded.tokenizer.is_multilingual:
            language = "en"
        return Transcript(
            path=item.path,
            text=text,
            language=language,
            language_probability=item.language.probability if item.language else None,
            segments=segments,
            duration=round(item.duration, 3),
            model=self.loaded.name,
            dtype=dtype_name(self.loaded.policy.dtype),
            timings={"wall": round(time.perf_counter() - item.started, 3)},
        )


def open_after_timestamps(audio: np.ndarray, n_timestamps: int) -> np.ndarray:
    """(n_timestamps,) bool: whether the window's audio after each timestamp is still open.

    Whisper ends a window early when it takes the last utterance for one that runs on
    past the window (openai-whisper then seeks there and decodes again), and after a
    pause it often ends wrongly, so whole utterances would be lost. Windows here are cut
    at pauses and decoded independently, so the decoder instead may not end while the
    audio after its latest timestamp is open: at least OPEN_MIN_SECONDS long, with
    OPEN_SOUND_SECONDS of 20 ms frames (one timestamp step) near the window's loud level
    (its 95th percentile, less OPEN_SOUND_DB, and above OPEN_SILENCE_DBFS).
    """
    frame = round(TIME_PRECISION * SAMPLE_RATE)
    n = len(audio) // frame
    out = np.zeros(n_timestamps, dtype=bool)
    if n == 0:
        return out
    power = np.square(audio[: n * frame], dtype=np.float64).reshape(n, frame).mean(axis=1)
    level = 10 * np.log10(power + 1e-10)
    threshold = max(np.percentile(level, 95) - OPEN_SOUND_DB, OPEN_SILENCE_DBFS)
    loud_after = np.cumsum((level > threshold)[::-1])[::-1]  # loud frames from frame f on
    left = len(audio) / SAMPLE_RATE - np.arange(n) * TIME_PRECISION  # seconds after f
    ok = (loud_after * TIME_PRECISION >= OPEN_SOUND_SECONDS) & (left >= OPEN_MIN_SECONDS)
    m = min(n, n_timestamps)
    out[:m] = ok[:m]
    return out
