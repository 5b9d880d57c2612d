"""Transcribe many inputs of any length in batches of independent windows of speech.

Data flows one way: inputs -> audio blocks -> speech map and windows (windows.py) ->
batches -> log-mel -> encoder -> decoder -> segments -> one Transcript per input, handed
to a callback as soon as its last window is decoded. Windows of one file and of several
files share batches; only a batch of windows is held in memory at a time.

A window whose decode fails openai-whisper's checks (text too repetitive, average
log-prob too low, or stopped by the repetition guard) is queued again at the next
temperature of the policy and decoded in a later batch, beside new windows, so batches
stay full and the other rows are untouched. Once the inputs hold no more new windows, the
rows a batch has spare decode its retries' later temperatures ahead, in the same batch:
a window that fails several temperatures no longer costs a batch per temperature at the
end of a run. The result is the same as one attempt at a time (each attempt's sampling
is seeded by its window and temperature, not by its batch).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from whisper_cli.audio import AudioSource, open_audio
from whisper_cli.decoding import DecodedRow, DecodeOptions, LanguageGuess
from whisper_cli.dtypes import dtype_name
from whisper_cli.engine import Engine
from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.features import SAMPLE_RATE, batch_log_mel
from whisper_cli.loading import LoadedModel
from whisper_cli.options import Policy, TranscribeOptions
from whisper_cli.results import Segment, Transcript
from whisper_cli.segments import attach_words, compression_ratio, window_segments
from whisper_cli.speech import FRAME_SECONDS, load_detector
from whisper_cli.timing import Aligner, AlignRow
from whisper_cli.tokenizer import TIME_PRECISION
from whisper_cli.windows import Window, WindowCutter

__all__ = ["Counters", "Policy", "Progress", "TranscribeOptions", "Transcriber"]

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class Progress:
    """What the pipeline reports after each batch."""

    audio_done: float  # seconds of audio decoded so far
    audio_total: float  # seconds of audio in all inputs (known durations)
    elapsed: float


@dataclass
class Counters:
    """What a run did around the engine (whose own counters say what it ran)."""

    windows: int = 0  # windows cut (each decoded at least once)
    batches: int = 0
    fallbacks: int = 0  # window decodes repeated at a higher temperature
    ahead: int = 0  # attempts decoded ahead in spare rows (used or not; see _ahead)
    detector_s: float = 0.0  # wall time of the speech detector
    align_s: float = 0.0  # wall time of the word-alignment passes (timed runs: synchronised)


@dataclass
class _Input:
    index: int
    path: str
    source: AudioSource
    duration: float = 0.0
    language: LanguageGuess | None = None
    segments: list[Segment] = field(default_factory=list)
    pending: int = 0  # windows cut but not finally decoded yet
    done_to: float = 0.0  # seconds: the end of its latest finally decoded window
    windows: int = 0  # windows cut so far
    # Text the guards or limits cut, reported as the transcript's notes (see _notes).
    hit_max_tokens: int = 0  # windows that used all of max_new_tokens without ending
    looped: int = 0  # windows that looped at every temperature (cut by the guard)
    too_repetitive: int = 0  # segments dropped above compression_ratio_threshold
    cut_done: bool = False  # the last window of this input has been cut
    started: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Job:
    """One window to decode, at the temperature of its attempt."""

    window: Window
    attempt: int = 0  # index into policy.temperatures
    language: str | None = None  # once known (a fallback keeps its window's language)
    candidates: list[DecodedRow] = field(default_factory=list)  # earlier attempts
    # (S, C): its encoder output, kept while it waits to be decoded again (it is the
    # same at every temperature, so the window is encoded once)
    features: torch.Tensor | None = None
    # A later attempt of that job, decoded ahead in a spare row of its batch (see _ahead).
    ahead_of: _Job | None = None


def check_options(options: TranscribeOptions) -> None:
    """Run-level checks that need no model (the CLI makes them before loading one)."""
    if options.task not in TASKS:
        raise WhisperCliError(f"invalid task {options.task!r}; choose transcribe or translate")
    if options.batch_size < 1:
        raise WhisperCliError("--batch-size must be at least 1")
    if options.language is not None and options.multilingual:
        raise WhisperCliError(
            f"--multilingual detects the language of every window; it contradicts "
            f"--language {options.language}"
        )


def validate_options(loaded: LoadedModel, options: TranscribeOptions) -> None:
    """Run-level checks, before any work starts."""
    check_options(options)
    tokenizer = loaded.tokenizer
    if options.language is not None:
        if not tokenizer.is_multilingual and options.language != "en":
            raise WhisperCliError(
                f"{loaded.name} is an English-only model; it cannot transcribe "
                f"language {options.language!r} (use a multilingual model)"
            )
        if tokenizer.is_multilingual:
            tokenizer.language_id(options.language)
    if not tokenizer.is_multilingual and options.multilingual:
        raise WhisperCliError(
            f"{loaded.name} is an English-only model; --multilingual needs a multilingual one"
        )
    if not tokenizer.is_multilingual and options.task == "translate":
        raise WhisperCliError(f"{loaded.name} is an English-only model; it cannot translate")


class Transcriber:
    """Holds a loaded model and the speech detector, and decodes batches of windows."""

    def __init__(
        self, loaded: LoadedModel, options: TranscribeOptions, timed: bool = False
    ) -> None:
        """timed: synchronise the device around each stage and count its time (bench)."""
        validate_options(loaded, options)
        self.loaded = loaded
        self.options = options
        self.policy = options.policy
        tokenizer = loaded.tokenizer
        prompt = ()
        if options.initial_prompt:
            # Fixed for the run, so every window's prompt (and the step's shape) is the same.
            max_prompt = loaded.config.max_target_positions // 2 - 1
            prompt = tuple(tokenizer.encode_text(" " + options.initial_prompt.strip()))
            prompt = prompt[-max_prompt:]
        p = self.policy
        self.engine = Engine(
            loaded,
            DecodeOptions(
                task=options.task,
                timestamps=options.timestamps,
                max_new_tokens=options.max_new_tokens,
                prompt_tokens=prompt,
                loop_check_every=p.loop_check_every,
                max_loop_period=p.max_loop_period,
                min_loop_span=p.min_loop_span,
            ),
            compile=options.compile,
            retain_cross=options.word_timestamps,
            timed=timed,
        )
        # The map also places the cuts with the detector off, so it is always loaded.
        self.detector = load_detector()
        self.aligner = Aligner(loaded, options.task) if options.word_timestamps else None
        self.rows = options.batch_size  # halved for the rest of the run on out-of-memory
        self.counters = Counters()

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
        paths: Iterable[str | AudioSource],
        on_result: Callable[[Transcript], None],
        on_error: Callable[[InputError], None],
        on_progress: Callable[[Progress], None] | None = None,
        stdin=None,
    ) -> None:
        """Transcribe every path; each result or per-input error is reported as it happens.

        An input may also be an AudioSource already opened (and so validated) by the caller.
        """
        inputs: list[_Input] = []
        for path in paths:
            try:
                source = (
                    path
                    if isinstance(path, AudioSource)
                    else open_audio(path, channel=self.options.channel, stdin=stdin)
                )
            except InputError as exc:
                on_error(exc)
                continue
            inputs.append(_Input(len(inputs), source.info.path, source))
        total = sum(i.source.info.duration or 0.0 for i in inputs)
        started = time.perf_counter()
        failed: set[int] = set()
        retries: deque[_Job] = deque()

        def finish(item: _Input) -> None:
            if item.pending == 0 and item.cut_done and item.index not in failed | reported:
                reported.add(item.index)
                on_result(self._finish(item))

        reported: set[int] = set()
        for batch in self._batches(inputs, failed, on_error, retries, finish):
            again = self._decode_batch(inputs, batch)
            retries.extend(again)  # failed at their temperature: decoded again later
            for job in batch:
                if job.ahead_of is not None:
                    continue  # its window is accounted for by its job
                item = inputs[job.window.source]
                if all(job is not other for other in again):
                    item.pending -= 1
                    item.done_to = max(item.done_to, job.window.end)
                finish(item)
            if on_progress:
                done = sum(i.duration if i.index in reported else i.done_to for i in inputs)
                on_progress(Progress(done, total, time.perf_counter() - started))

    # -- batching --------------------------------------------------------------------

    def _windows(
        self,
        inputs: list[_Input],
        failed: set[int],
        on_error: Callable[[InputError], None],
        finish: Callable[[_Input], None],
    ) -> Iterator[Window]:
        for item in inputs:
            item.started = time.perf_counter()  # its wall time counts from its first window
            cutter = WindowCutter(
                self.detector, self.policy, vad=self.options.vad, source=item.index
            )
            try:
                windows = cutter.cut(item.source.blocks())
                window = next(windows, None)
                while window is not None:
                    # One window of look-ahead: an input is known to be cut through when its
                    # last window is yielded, so it is handed over as soon as that is decoded
                    # (not only when a later batch happens to hold one of its windows).
                    following = next(windows, None)
                    item.pending += 1
                    item.windows += 1
                    item.cut_done = following is None
                    if item.cut_done:
                        item.duration = cutter.samples / SAMPLE_RATE
                    self.counters.windows += 1
                    yield window
                    window = following
                item.duration = cutter.samples / SAMPLE_RATE
                if cutter.samples == 0:
                    raise InputError(item.path, "contains no audio")
            except InputError as exc:
                failed.add(item.index)
                on_error(exc)
            self.counters.detector_s += cutter.stream.seconds
            item.cut_done = True
            if item.pending == 0:
                finish(item)  # no speech at all: an empty transcript, at once

    def _batches(
        self,
        inputs: list[_Input],
        failed: set[int],
        on_error: Callable[[InputError], None],
        retries: deque[_Job],
        finish: Callable[[_Input], None],
    ) -> Iterator[list[_Job]]:
        """Batches of up to batch_size jobs: windows queued again first, then new ones."""
        windows = self._windows(inputs, failed, on_error, finish)
        exhausted = False
        while True:
            batch: list[_Job] = []
            while retries and len(batch) < self.options.batch_size:
                batch.append(retries.popleft())
            while not exhausted and len(batch) < self.options.batch_size:
                window = next(windows, None)
                if window is None:
                    exhausted = True
                else:
                    batch.append(_Job(window))
            if not batch:
                return
            if exhausted:
                batch += self._ahead(batch, self.rows - len(batch))
            yield batch

    def _ahead(self, batch: list[_Job], spare: int) -> list[_Job]:
        """Up to `spare` later attempts of the batch's retries, their next temperature
        first, round robin: rows that would otherwise decode nothing (or padding)."""
        n = len(self.policy.temperatures)
        retries = [j for j in batch if j.features is not None]
        # Round r holds each retry's (r + 1)-th attempt after its own, where it has one.
        rounds = [(j, j.attempt + r) for r in range(1, n) for j in retries if j.attempt + r < n]
        extra = [
            _Job(job.window, a, job.language, features=job.features, ahead_of=job)
            for job, a in rounds[: max(spare, 0)]
        ]
        self.counters.ahead += len(extra)
        return extra

    # -- decoding --------------------------------------------------------------------

    def _decode_batch(self, inputs: list[_Input], batch: list[_Job]) -> list[_Job]:
        """Decode a batch in chunks of self.rows; out of memory halves self.rows and retries.

        Returns the jobs to decode again at their next temperature."""
        again: list[_Job] = []
        done = 0
        while done < len(batch):
            chunk = batch[done : done + self.rows]
            try:
                again += self._decode_rows(inputs, chunk)
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
        return again

    def _encode(self, batch: list[_Job]) -> torch.Tensor:
        """(rows, S, C) encoder output of the batch, padding rows after it (see rows_for);
        only the windows not encoded before pass through the encoder."""
        n_rows = self.engine.rows_for(len(batch), self.rows)
        fresh = [r for r, j in enumerate(batch) if j.features is None]
        encoded = None
        if len(fresh) + n_rows - len(batch):
            mel = batch_log_mel(
                [batch[r].window.audio for r in fresh],
                len(fresh) + n_rows - len(batch),
                self.loaded.config.num_mel_bins,
                self.loaded.policy.device,
            )
            encoded = self.engine.encode(mel)  # the fresh rows, then the padding
        if len(fresh) == len(batch):
            return encoded
        kept = [r for r, j in enumerate(batch) if j.features is not None]
        like = batch[kept[0]].features
        features = like.new_empty((n_rows, *like.shape))
        features[kept] = torch.stack([batch[r].features for r in kept])
        if encoded is not None:
            features[fresh] = encoded[: len(fresh)]
            features[len(batch) :] = encoded[len(fresh) :]
        return features

    def _decode_rows(self, inputs: list[_Input], batch: list[_Job]) -> list[_Job]:
        device = self.loaded.policy.device
        features = self._encode(batch)
        self.counters.batches += 1
        languages = self._languages(inputs, batch, features)
        speech_after = None
        if self.options.timestamps and self.options.vad:
            n_ts = self.loaded.config.vocab_size - self.loaded.tokenizer.special.timestamp_begin
            table = np.zeros((len(batch), n_ts), dtype=bool)
            for r, job in enumerate(batch):
                table[r] = speech_after_timestamps(
                    job.window.speech, n_ts, self.policy.min_speech_seconds
                )
            speech_after = torch.from_numpy(table).to(device)
        temperatures = [self.policy.temperatures[j.attempt] for j in batch]
        seeds = [self._seed(j) for j in batch]
        rows = self.engine.decode(features, languages, speech_after, temperatures, seeds)
        # Attempts decoded ahead: (their job, attempt) -> row.
        ahead = {
            (id(j.ahead_of), j.attempt): row
            for j, row in zip(batch, rows, strict=True)
            if j.ahead_of is not None
        }
        again = []
        final: list[tuple[int, _Job, DecodedRow, list[Segment]]] = []
        for r, (job, row) in enumerate(zip(batch, rows, strict=True)):
            if job.ahead_of is not None:
                continue  # read through its job below
            while self._needs_fallback(row) and job.attempt + 1 < len(self.policy.temperatures):
                job.candidates.append(row)
                job.attempt += 1
                self.counters.fallbacks += 1
                row = ahead.get((id(job), job.attempt))
                if row is None:
                    break
            if row is None:  # its next attempt was not decoded ahead: queued again
                job.features = features[r].clone()  # not a view holding the whole batch
                again.append(job)
                continue
            job.features = None
            row = self._best([*job.candidates, row])
            item = inputs[job.window.source]
            segments, repetitive = self._segments(job.window, row)
            if not self._is_silent(row):
                item.hit_max_tokens += row.hit_max_tokens
                item.looped += row.looped
            item.too_repetitive += repetitive
            final.append((r, job, row, segments))
        self._attach(inputs, batch, features, final)
        return again

    def _attach(
        self,
        inputs: list[_Input],
        batch: list[_Job],
        features: torch.Tensor,
        final: list[tuple[int, _Job, DecodedRow, list[Segment]]],
    ) -> None:
        """The batch's finished windows' segments to their inputs: with their words, from
        one alignment pass over the batch, when words are asked for.

        A row that falls back is aligned with no text here; it is aligned in the batch
        where it finishes (its encoder output is the same there)."""
        if self.aligner is None:
            for _, job, _, segments in final:
                inputs[job.window.source].segments.extend(segments)
            return
        text = [AlignRow((), len(j.window.audio), j.language) for j in batch]
        for r, job, row, segments in final:
            tokens = sum((s.tokens for s in segments), ())
            text[r] = AlignRow(tokens, len(job.window.audio), row.language)
        self.engine.sync_if_timed()
        started = time.perf_counter()
        aligned = self.aligner.align(features, text, self.engine.cross_kv(features))
        self.engine.sync_if_timed()
        self.counters.align_s += time.perf_counter() - started
        for r, job, _, segments in final:
            done = inputs[job.window.source].segments
            # openai-whisper's last_speech: where the input's speech before this window ends
            # (windows that fell back finish later than the ones after them).
            before = [s.end for s in done if s.end <= job.window.start]
            last_speech = max(before, default=0.0)
            done.extend(attach_words(segments, aligned[r], job.window.start, last_speech))

    def _seed(self, job: _Job) -> int:
        """A window's sampling seed: from the policy's seed, where the window lies in its
        input and the attempt, so it does not depend on the batch or the other inputs."""
        w = job.window
        return (self.policy.seed * 1_000_003 + w.first_sample * 31 + job.attempt) % (2**63)

    def _needs_fallback(self, row: DecodedRow) -> bool:
        """openai-whisper's rule: too repetitive or too unsure, unless it is no speech."""
        p = self.policy
        if self._is_silent(row):
            return False
        return (
            row.looped
            or self._compression(row) > p.compression_ratio_threshold
            or row.avg_logprob < p.logprob_threshold
        )

    def _best(self, candidates: list[DecodedRow]) -> DecodedRow:
        """The last attempt if it passed; else, as faster-whisper, the best average log-prob
        among the attempts that are not too repetitive (or among all, if none is)."""
        last = candidates[-1]
        if len(candidates) == 1 or not self._needs_fallback(last):
            return last
        p = self.policy
        fine = [
            c
            for c in candidates
            if not c.looped and self._compression(c) <= p.compression_ratio_threshold
        ]
        return max(fine or candidates, key=lambda c: c.avg_logprob)

    def _compression(self, row: DecodedRow) -> float:
        ts_begin = self.loaded.tokenizer.special.timestamp_begin
        text = self.loaded.tokenizer.decode([t for t in row.tokens if t < ts_begin])
        return compression_ratio(text)

    def _segments(self, window: Window, row: DecodedRow) -> tuple[list[Segment], int]:
        """The row's segments in input time, and how many were dropped as repetitive.

        None for a silent row; none that lies over what the speech map calls non-speech.
        """
        if self._is_silent(row):
            return [], 0
        p = self.policy
        segments = window_segments(
            row.tokens,
            self.loaded.tokenizer,
            offset=window.start,
            duration=window.duration,
            avg_logprob=row.avg_logprob,
            no_speech_prob=row.no_speech_prob,
            language=row.language,
        )
        kept, repetitive = [], 0
        for s in segments:
            if s.compression_ratio > p.compression_ratio_threshold:
                repetitive += 1  # a loop that survived every temperature
                continue
            share = window.speech_share(s.start - window.start, s.end - window.start)
            if self.options.vad and share < p.segment_min_speech:
                continue  # text written over what the speech map calls non-speech
            kept.append(s)
        return kept, repetitive

    def _is_silent(self, row: DecodedRow) -> bool:
        """openai-whisper's rule: likely no speech, and the text is not confidently decoded.

        A confident decode overrides the no-speech probability only when it holds words: text
        of punctuation or symbols alone (" . . .", music notes) under a high no-speech
        probability is what the model writes for noise and tones, not speech.
        """
        p = self.policy
        if row.no_speech_prob <= p.no_speech_threshold:
            return False
        if row.avg_logprob < p.logprob_threshold:
            return True
        ts_begin = self.loaded.tokenizer.special.timestamp_begin
        text = self.loaded.tokenizer.decode([t for t in row.tokens if t < ts_begin])
        return not any(ch.isalnum() for ch in text)

    def _languages(
        self, inputs: list[_Input], batch: list[_Job], features: torch.Tensor
    ) -> list[str | None]:
        """The language of each row: given, per input, or per window (--multilingual).

        Per input, the probabilities of its first windows in the batch are pooled, each
        weighted by the speech it holds, over up to policy.language_seconds of speech: an
        intro of music or noise (little speech) barely counts.
        """
        if not self.loaded.tokenizer.is_multilingual:
            return [None] * len(batch)
        if self.options.language is not None:
            return [self.options.language] * len(batch)
        need = [
            r
            for r, j in enumerate(batch)
            if j.language is None
            and (self.options.multilingual or inputs[j.window.source].language is None)
        ]
        if need:
            # One step over the whole batch (fixed shape), read for the rows that need it.
            codes, probs = self.engine.language_probs(features)
            probs = probs.cpu().numpy()
            if self.options.multilingual:
                for r in need:
                    best = int(probs[r].argmax())
                    batch[r].language = codes[best]
                    inputs[batch[r].window.source].language = inputs[
                        batch[r].window.source
                    ].language or LanguageGuess(codes[best], float(probs[r, best]))
            else:
                by_input: dict[int, list[int]] = {}
                for r in need:
                    by_input.setdefault(batch[r].window.source, []).append(r)
                for source, rows in by_input.items():
                    inputs[source].language = self._pooled(codes, probs, batch, rows)
        for job in batch:
            if job.language is None:
                job.language = inputs[job.window.source].language.code
        return [j.language for j in batch]

    def _pooled(
        self, codes: list[str], probs: np.ndarray, batch: list[_Job], rows: list[int]
    ) -> LanguageGuess:
        weights, seconds = [], 0.0
        for r in sorted(rows, key=lambda r: batch[r].window.index):
            if seconds >= self.policy.language_seconds:
                break
            speech = batch[r].window.speech_seconds
            weights.append((r, min(speech, self.policy.language_seconds - seconds)))
            seconds += speech
        total = sum(w for _, w in weights)
        if total <= 0:  # no speech anywhere (detector off): the windows count alike
            weights, total = [(r, 1.0) for r, _ in weights], float(len(weights))
        pooled = sum(w * probs[r] for r, w in weights) / total
        best = int(pooled.argmax())
        return LanguageGuess(codes[best], float(pooled[best]))

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
            notes=self._notes(item),
        )

    def _notes(self, item: _Input) -> tuple[str, ...]:
        """What the user should know was cut from this transcript (none: nothing was)."""
        o, p, notes = self.options, self.policy, []
        if item.hit_max_tokens:
            notes.append(
                f"{item.hit_max_tokens} of {item.windows} window(s) reached --max-new-tokens "
                f"{o.max_new_tokens} before their end; the text after that is missing"
            )
        if item.looped:
            notes.append(
                f"{item.looped} window(s) kept repeating themselves at every temperature and "
                "were cut by the repetition guard; the rest of those windows is missing"
            )
        if item.too_repetitive:
            notes.append(
                f"{item.too_repetitive} segment(s) dropped as repetitive (above "
                f"--compression-ratio-threshold {p.compression_ratio_threshold:g})"
            )
        return tuple(notes)


def speech_after_timestamps(
    speech: np.ndarray, n_timestamps: int, min_seconds: float
) -> np.ndarray:
    """(n_timestamps,) bool: whether at least `min_seconds` of speech frames (the window's
    speech map) lie after each timestamp (20 ms apart): where a decode may not end."""
    after = np.cumsum(speech[::-1])[::-1] * FRAME_SECONDS  # speech from frame f on, seconds
    after = np.append(after, 0.0)
    frames = np.ceil(np.arange(n_timestamps) * TIME_PRECISION / FRAME_SECONDS - 1e-9)
    frames = np.minimum(frames.astype(np.int64), len(after) - 1)
    return after[frames] >= min_seconds
