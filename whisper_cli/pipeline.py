"""Transcribe many inputs of any length in batches of independent windows of speech.

Data flows one way: inputs -> audio blocks -> speech map and windows (windows.py) ->
batches of jobs (scheduler.py) -> log-mel -> encoder -> decoder (engine.py) -> the
judge's verdict on each window (judge.py) -> segments, handed to a callback as soon as
the scheduler says they and everything before them are final (a window cut inside
speech keeps its last segment back until the next window is final, unless text is due
sooner, under a latency bound: judge.echoed_words may trim it) -> one Transcript per
input, handed to a callback as soon as its last window is final. Windows of one file
and of several files share batches; only a batch of windows is held in memory at a time.

A window the judge sends back (text too repetitive, average log-prob too low, or
stopped by the repetition guard) is queued again at the next temperature and decoded in
a later batch beside new windows, its encoder output kept; the other rows are untouched.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from whisper_cli.audio import AudioSource, open_audio
from whisper_cli.decoding import DecodedRow, DecodeOptions, LanguageGuess
from whisper_cli.dtypes import dtype_name
from whisper_cli.engine import Decoded, Engine, Reply, Retry, WindowInput
from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.judge import Judgement, echoed_words, judge, may_echo
from whisper_cli.loading import LoadedModel
from whisper_cli.options import (
    RUN_BATCHES,
    Policy,
    TranscribeOptions,
    check_options,
    run_latency,
)
from whisper_cli.progress import FINDING_SPEECH, Progress, Reporter
from whisper_cli.results import Segment, Transcript, TranscriptWarning
from whisper_cli.scheduler import (
    Counters,
    Failed,
    Finished,
    Job,
    Scheduler,
    Settled,
    Track,
    later_attempts,
)
from whisper_cli.segments import attach_words, without_last_words
from whisper_cli.speech import load_detector
from whisper_cli.timing import AlignRow
from whisper_cli.windows import Window, WindowCutter

__all__ = ["Counters", "Policy", "Progress", "TranscribeOptions", "Transcriber", "check_options"]


@dataclass(frozen=True)
class _Held:
    """A settled window cut inside speech, whose last segment waits for the next window
    of its input (judge.echoed_words), with all its segments (word timing needs them)."""

    window: Window
    segments: tuple[Segment, ...]


@dataclass
class _Result:
    """What one input's windows have given so far."""

    language: LanguageGuess | None = None
    settled: list[Segment] = field(default_factory=list)  # of its settled windows, in order
    # Its final windows not settled yet, by index: each window and its own segments.
    pending: dict[int, tuple[Window, tuple[Segment, ...]]] = field(default_factory=dict)
    held: _Held | None = None

    def segments(self) -> list[Segment]:
        """Every segment of its final windows so far."""
        held = [self.held.segments[-1]] if self.held is not None else []
        return self.settled + held + [s for _, segs in self.pending.values() for s in segs]

    # Text the guards or limits cut, reported as the transcript's warnings (_cut_warnings).
    hit_max_tokens: int = 0  # windows that used all of max_new_tokens without ending
    looped: int = 0  # windows that looped at every temperature (cut by the guard)
    too_repetitive: int = 0  # segments dropped as repetitive (see judge.Judgement)
    echoes: int = 0  # window ends trimmed of the next window's words (judge.echoed_words)


@dataclass
class _InRun:
    """A refilled run's judging as its rows finish: the job and attempt of each of its
    rows (the batch's, then the retries as they are asked for), each window's attempts
    that finished before the one ahead of them was judged, and the verdicts (by job)."""

    jobs: list[Job]
    attempts: list[int]
    early: dict[int, dict[int, DecodedRow]] = field(default_factory=dict)  # attempt -> row
    # The windows that fell back, in order: their job and batch row, their last attempt
    # asked for, and the rows of their attempts asked for that have not finished.
    retried: dict[int, tuple[Job, int]] = field(default_factory=dict)
    queued: dict[int, int] = field(default_factory=dict)
    running: dict[int, set[int]] = field(default_factory=dict)
    verdicts: dict[int, Judgement] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: list[Job]) -> _InRun:
        """A batch's rows, an attempt decoded ahead (Scheduler._ahead) as its window's."""
        run = cls([j.ahead_of or j for j in batch], [j.attempt for j in batch])
        for r, job in enumerate(batch):
            owner = job.ahead_of
            if owner is not None:
                key = id(owner)
                run.retried.setdefault(key, (owner, batch.index(owner)))
                run.queued[key] = max(run.queued.get(key, 0), job.attempt)
                run.running.setdefault(key, set()).add(r)
        return run


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
        self.engine = Engine(
            loaded,
            DecodeOptions(
                task=options.task,
                timestamps=options.timestamps,
                max_new_tokens=options.max_new_tokens,
                prompt_tokens=prompt,
                policy=self.policy,
            ),
            compile=options.compile,
            words=options.word_timestamps,
            timed=timed,
        )
        # The map also places the cuts with the detector off, so it is always loaded.
        self.detector = load_detector()
        self.rows = options.batch_size  # halved for the rest of the run on out-of-memory
        self.per_run = 1  # batches of windows a run holds (see TranscribeOptions.refill)
        # Whether a window cut inside speech holds its last segment for the next window
        # (judge.echoed_words): not under a latency bound, where its text is due first.
        self.holds = True
        self.counters = Counters()
        self._results: list[_Result] = []  # per input of the run in progress
        self._reporter = Reporter(None, 0.0, lambda: 0.0)  # the run in progress's

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
        on_segments: Callable[[str, tuple[Segment, ...]], None] | None = None,
    ) -> None:
        """Transcribe every path; each result or per-input error is reported as it happens.

        on_segments(path, segments): an input's next segments, in order, as soon as they
        and all before them are final (they are also in its Transcript, given after them).
        An input may also be an AudioSource already opened (and so validated) by the caller.
        """
        sources = self._open(paths, on_error, stdin)
        known = all(s.info.duration for s in sources)
        total = sum(s.info.duration or 0.0 for s in sources) if known else 0.0
        self._results = [_Result() for _ in sources]
        scheduler = self._scheduler(sources)

        def report() -> None:
            for event in scheduler.events():
                if isinstance(event, Failed):
                    on_error(event.error)
                elif isinstance(event, Settled):
                    segments = self._settle(event)
                    if on_segments and segments:
                        on_segments(event.track.path, segments)
                elif isinstance(event, Finished):
                    segments = self._release(event.track)
                    if on_segments and segments:
                        on_segments(event.track.path, segments)
                    on_result(self._finish(event.track))

        self._reporter = reporter = Reporter(on_progress, total, scheduler.audio_done)
        reporter.enter(FINDING_SPEECH)
        for batch in scheduler.batches():
            report()  # inputs with no speech, or unreadable, met while the batch was filled
            scheduler.settle(batch, self._decode_batch(batch, scheduler.exhausted))
            report()
            reporter.settled()
        report()

    def _open(
        self,
        paths: Iterable[str | AudioSource],
        on_error: Callable[[InputError], None],
        stdin,
    ) -> list[AudioSource]:
        """The inputs that open, as audio sources; each that does not, to on_error."""
        sources: list[AudioSource] = []
        for path in paths:
            try:
                sources.append(
                    path
                    if isinstance(path, AudioSource)
                    else open_audio(path, channel=self.options.channel, stdin=stdin)
                )
            except InputError as exc:
                on_error(exc)
        return sources

    def _scheduler(self, sources: list[AudioSource]) -> Scheduler:
        latency = run_latency(self.options.latency, any(s.live for s in sources))
        refill = self.options.refill
        refill = self.options.compile if refill is None else refill
        self.per_run = RUN_BATCHES if refill and latency is None else 1
        self.holds = latency is None
        return Scheduler(
            sources,
            lambda i: WindowCutter(
                self.detector,
                self.policy,
                vad=self.options.vad,
                source=i,
                latency=latency,
                waited=sources[i].waited,
            ),
            self.options.batch_size * self.per_run,
            len(self.policy.temperatures),
            self.counters,
            rows=lambda: self.rows * self.per_run,
            latency=latency,
        )

    def _decode_batch(self, batch: list[Job], last: bool = True) -> list[Job]:
        """Decode a batch in runs of self.per_run batches of self.rows; out of memory halves
        self.rows and retries.

        Returns the jobs to decode again at their next temperature."""
        again: list[Job] = []
        done = 0
        # Each window counts once towards progress: at its first attempt.
        self._reporter.batch(
            [j.window.duration if j.attempt == 0 and j.ahead_of is None else None for j in batch]
        )
        while done < len(batch):
            chunk = batch[done : done + self.rows * self.per_run]
            try:
                again += self._decode_rows(chunk, done, last)
            except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError in newer torch
                if self.rows == 1:
                    raise WhisperCliError("out of memory with a batch of one window") from None
                tried = min(len(chunk), self.rows)
                self.rows //= 2
                if self.loaded.policy.device.type == "cuda":
                    torch.cuda.empty_cache()
                warnings.warn(
                    f"out of memory at batch size {tried}; retrying with batch size {self.rows}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue  # nothing of the chunk was kept: decode it again, smaller
            done += len(chunk)
        return again

    def _decode_rows(self, batch: list[Job], offset: int = 0, last: bool = True) -> list[Job]:
        """Decode a batch of jobs and judge each row; returns the jobs to decode again.

        Refilled, in the last run (`last`: no window is left to cut), each row is judged
        as it finishes and a window that falls back is decoded again in the same run
        (nothing is returned): no run of retries follows it. Otherwise a window's next
        attempt leads the next batch, one row among new windows, or was decoded ahead in
        this one's spare rows.

        offset: where these rows lie in the scheduler's batch (for progress)."""
        reporter = self._reporter
        reporter.encoding()
        self.counters.batches += 1
        watch = None if reporter.on_progress is None else partial(reporter.rows, offset)
        in_run = _InRun.of(batch) if self.per_run > 1 and last else None
        c = self.counters
        before = [(job.attempt, len(job.attempts)) for job in batch], c.fallbacks, c.ahead
        try:
            decoded = self.engine.run(
                [self._window_input(j) for j in batch],
                partial(self._pick_languages, batch),
                pad_to=self.rows,
                slots=self.rows,
                on_rows=watch,
                on_finish=None if in_run is None else partial(self._retry, in_run),
            )
        except torch.cuda.OutOfMemoryError:  # the batch is decoded again: judged anew
            for job, (attempt, judged) in zip(batch, before[0], strict=True):
                job.attempt = attempt
                del job.attempts[judged:]
            c.fallbacks, c.ahead = before[1:]
            raise
        rows = decoded.rows[: len(batch)]  # the retries after them were judged in the run
        for job, row in zip(batch, rows, strict=True):
            job.language = row.language
        # Attempts decoded ahead: (their job, attempt) -> row.
        ahead = {
            (id(j.ahead_of), j.attempt): row
            for j, row in zip(batch, rows, strict=True)
            if j.ahead_of is not None
        }
        again: list[Job] = []
        final: list[tuple[int, Job, Judgement]] = []
        for r, (job, row) in enumerate(zip(batch, rows, strict=True)):
            if job.ahead_of is not None:
                continue  # read through its job below
            if in_run is not None:
                verdict = in_run.verdicts[id(job)]
            else:
                verdict = self._verdict(job, row, ahead)
            if not verdict.final:  # its next attempt was not decoded ahead: queued again
                job.features = decoded.kept(r)
                again.append(job)
                continue
            job.features = None
            self._count(job, verdict)
            final.append((r, job, verdict))
        self._attach(batch, decoded, final)
        return again

    def _window_input(self, job: Job) -> WindowInput:
        w = job.window
        return WindowInput(
            audio=w.audio,
            features=job.features,
            language=self._language_of(job),
            temperature=self.policy.temperatures[job.attempt],
            seed=self._seed(job),
            speech=w.speech,
            cut_off=w.cut_off,
        )

    def _retry(self, run: _InRun, r: int, row: DecodedRow, spare: int) -> Reply:
        """Row r of a refilled run, judged as it finishes (engine.OnFinish). A window's
        attempts are judged in order, each once the one before it has fallen back; one
        that falls back asks for its next attempt, and one kept stops its later attempts
        decoded ahead. Rows that nothing waits for (`spare`) take later attempts of the
        windows still falling back, round robin, their next first (as Scheduler._ahead
        fills a batch's spare rows)."""
        job, key = run.jobs[r], id(run.jobs[r])
        run.running.get(key, set()).discard(r)
        asked: list[tuple[Job, int]] = []
        stop: list[int] = []
        if key not in run.verdicts:  # else decoded ahead, not needed: an earlier one kept
            early = run.early.setdefault(key, {})
            early[run.attempts[r]] = row
            while job.attempt in early:
                verdict = self._judge(job, early.pop(job.attempt))
                if verdict.final:
                    run.verdicts[key] = verdict
                    stop = sorted(run.running.pop(key, ()))
                    break
                job.attempt += 1
                self.counters.fallbacks += 1
            else:
                run.retried.setdefault(key, (job, r))
                if job.attempt > run.queued.get(key, 0):  # not decoded ahead already
                    asked.append((job, job.attempt))
                    run.queued[key] = job.attempt
        falling = [(j, run.queued[k]) for k, (j, _) in run.retried.items() if k not in run.verdicts]
        for j, attempt in later_attempts(
            falling, len(self.policy.temperatures), spare - len(asked)
        ):
            asked.append((j, attempt))
            run.queued[id(j)] = max(run.queued[id(j)], attempt)
            self.counters.ahead += 1
        retries = []
        for j, attempt in asked:
            run.running.setdefault(id(j), set()).add(len(run.jobs))
            run.jobs.append(j)
            run.attempts.append(attempt)
            temperature = self.policy.temperatures[attempt]
            retries.append((run.retried[id(j)][1], Retry(temperature, self._seed(j, attempt))))
        return Reply(retries, stop)

    def _verdict(
        self, job: Job, row: DecodedRow, ahead: dict[tuple[int, int], DecodedRow]
    ) -> Judgement:
        """The judge's verdict on a job's row, and on its attempts decoded ahead while
        the verdict sends it back."""
        verdict = self._judge(job, row)
        while not verdict.final:
            job.attempt += 1
            self.counters.fallbacks += 1
            row = ahead.get((id(job), job.attempt))
            if row is None:
                break
            verdict = self._judge(job, row)
        return verdict

    def _count(self, job: Job, verdict: Judgement) -> None:
        """What the guards and limits cut of a final window, for its input's warnings."""
        result = self._results[job.window.source]
        if not verdict.silent:
            result.hit_max_tokens += verdict.row.hit_max_tokens
            result.looped += verdict.row.looped
        result.too_repetitive += verdict.repetitive
        self.counters.dropped += verdict.over_non_speech

    def _judge(self, job: Job, row: DecodedRow) -> Judgement:
        job.attempts.append(row)
        return judge(
            job.window, job.attempts, self.policy, self.loaded.tokenizer, use_map=self.options.vad
        )

    def _attach(
        self, batch: list[Job], decoded: Decoded, final: list[tuple[int, Job, Judgement]]
    ) -> None:
        """The batch's finished windows' segments to their inputs: with their words, from
        one alignment pass over the batch, when words are asked for.

        A row that falls back is aligned with no text here; it is aligned in the batch
        where it finishes (its encoder output is the same there)."""
        if not self.options.word_timestamps:
            for _, job, verdict in final:
                result = self._results[job.window.source]
                result.pending[job.window.index] = (job.window, verdict.segments)
            return
        text = [AlignRow((), len(j.window.audio), j.language) for j in batch]
        for r, job, verdict in final:
            tokens = sum((s.tokens for s in verdict.segments), ())
            text[r] = AlignRow(tokens, len(job.window.audio), verdict.row.language)
        aligned = self.engine.align(decoded, text)
        for r, job, verdict in final:
            result = self._results[job.window.source]
            # openai-whisper's last_speech: where the input's speech before this window ends
            # (windows that fell back finish later than the ones after them).
            before = [s.end for s in result.segments() if s.end <= job.window.start]
            last_speech = max(before, default=0.0)
            words = attach_words(list(verdict.segments), aligned[r], job.window.start, last_speech)
            result.pending[job.window.index] = (job.window, tuple(words))

    def _seed(self, job: Job, attempt: int | None = None) -> int:
        """A window's sampling seed: from the policy's seed, where the window lies in its
        input and the attempt (the job's own by default), so it does not depend on the
        batch or the other inputs."""
        w = job.window
        attempt = job.attempt if attempt is None else attempt
        return (self.policy.seed * 1_000_003 + w.first_sample * 31 + attempt) % (2**63)

    def _language_of(self, job: Job) -> str | None:
        """A job's language if it is known before the batch: given, its window's (a
        fallback keeps it), or its input's (found in an earlier batch); None: the
        language pass decides (see _pick_languages)."""
        if not self.loaded.tokenizer.is_multilingual:
            return None
        if self.options.language is not None:
            return self.options.language
        if job.language is not None:
            return job.language
        known = self._results[job.window.source].language
        return known.code if known is not None and not self.options.multilingual else None

    def _pick_languages(self, batch: list[Job], codes: list[str], probs: np.ndarray) -> list[str]:
        """The languages of a batch's rows from the language pass: each row its own
        (--multilingual), or per input, the probabilities of its first windows in the
        batch pooled, each weighted by the speech it holds, over up to
        policy.language_seconds of speech (an intro of music or noise barely counts)."""
        need = [r for r, j in enumerate(batch) if self._language_of(j) is None]
        if self.options.multilingual:
            for r in need:
                best = int(probs[r].argmax())
                batch[r].language = codes[best]
                result = self._results[batch[r].window.source]
                result.language = result.language or LanguageGuess(
                    codes[best], float(probs[r, best])
                )
        else:
            by_input: dict[int, list[int]] = {}
            for r in need:
                by_input.setdefault(batch[r].window.source, []).append(r)
            for source, rows in by_input.items():
                self._results[source].language = self._pooled(codes, probs, batch, rows)
        return [
            j.language if j.language is not None else self._results[j.window.source].language.code
            for j in batch
        ]

    def _pooled(
        self, codes: list[str], probs: np.ndarray, batch: list[Job], rows: list[int]
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

    def _settle(self, event: Settled) -> tuple[Segment, ...]:
        """The segments of the windows just settled, in window order, moved to settled;
        a window cut inside speech holds its last segment back for the next one."""
        result = self._results[event.track.index]
        new: list[Segment] = []
        for w in range(event.first, event.stop):
            window, segments = result.pending.pop(w, (None, ()))
            if result.held is not None:
                new += self._unecho(result, window, segments)
            if segments and window is not None and window.cut_off and self.holds:
                new += segments[:-1]
                result.held = _Held(window, segments)
            else:
                new += segments
        result.settled.extend(new)
        return tuple(new)

    def _release(self, track: Track) -> tuple[Segment, ...]:
        """A finished input's held segment (no window follows it), moved to settled."""
        result = self._results[track.index]
        if result.held is None:
            return ()
        last = result.held.segments[-1]
        result.held = None
        result.settled.append(last)
        return (last,)

    def _unecho(
        self, result: _Result, window: Window | None, segments: tuple[Segment, ...]
    ) -> list[Segment]:
        """The held segment, without the words that the next window (`window`, with its
        `segments`) begins with where judge.echoed_words finds them written once too often."""
        held, result.held = result.held, None
        last = held.segments[-1]
        # Settled windows come in index order, each met once: `window` follows held's.
        if window is None or not segments or not may_echo(last, segments, self.policy):
            return [last]
        timed, following = last, segments
        if not self.options.word_timestamps:
            timed, following = self._timed(result, held, window, segments)
        n = echoed_words(
            timed, held.window, following, window, self.policy, use_map=self.options.vad
        )
        trimmed = without_last_words(timed, n, self.loaded.tokenizer)
        if trimmed is timed:
            return [last]
        result.echoes += 1
        if trimmed is None:
            return []
        if not self.options.word_timestamps:  # its words were for the judge alone
            trimmed = replace(trimmed, start=last.start, end=last.end, words=())
        return [trimmed]

    def _timed(
        self, result: _Result, held: _Held, window: Window, segments: tuple[Segment, ...]
    ) -> tuple[Segment, tuple[Segment, ...]]:
        """The held segment and the next window's segments with their words, from one
        alignment pass over both windows (as --word-timestamps would give them)."""
        rows = [
            AlignRow(sum((s.tokens for s in segs), ()), len(w.audio), segs[0].language)
            for w, segs in ((held.window, held.segments), (window, segments))
        ]
        words = self.engine.align_audio([held.window.audio, window.audio], rows)
        before = max((s.end for s in result.settled if s.end <= held.window.start), default=0.0)
        last = attach_words(list(held.segments), words[0], held.window.start, before)[-1]
        theirs = attach_words(list(segments), words[1], window.start, last.end)
        return last, tuple(theirs)

    def _finish(self, track: Track) -> Transcript:
        result = self._results[track.index]
        # Windows are in time order, and so are a window's segments: settled order is
        # time order, and a streamed output is a prefix of the whole one.
        segments = tuple(result.settled)
        text = "".join(s.text for s in segments).strip()
        language = result.language.code if result.language else None
        if not self.loaded.tokenizer.is_multilingual:
            language = "en"
        return Transcript(
            path=track.path,
            text=text,
            language=language,
            language_probability=result.language.probability if result.language else None,
            segments=segments,
            duration=round(track.duration, 3),
            model=self.loaded.name,
            dtype=dtype_name(self.loaded.policy.dtype),
            timings={"wall": round(time.perf_counter() - track.started, 3)},
            warnings=self._warnings(track, result, segments),
        )

    def _warnings(
        self, track: Track, result: _Result, segments: tuple[Segment, ...]
    ) -> tuple[TranscriptWarning, ...]:
        """What the reader should know: the input's own (audio.py), then what was cut."""
        cut = self._cut_warnings(result, track.windows)
        found = [*getattr(track.source, "warnings", ()), *cut]
        if not segments and not cut:
            found.append(TranscriptWarning("no_speech", "no speech found"))
        return tuple(found)

    def _cut_warnings(self, result: _Result, windows: int) -> list[TranscriptWarning]:
        """What was cut from this transcript (none: nothing was)."""
        o, p, found = self.options, self.policy, []
        if result.hit_max_tokens:
            found.append(
                TranscriptWarning(
                    "text_cut",
                    f"{result.hit_max_tokens} of {windows} window(s) reached --max-new-tokens "
                    f"{o.max_new_tokens} before their end; the text after that is missing",
                )
            )
        if result.looped:
            found.append(
                TranscriptWarning(
                    "looped",
                    f"{result.looped} window(s) kept repeating themselves at every "
                    "temperature and were cut by the repetition guard; the rest of those "
                    "windows is missing",
                )
            )
        if result.echoes:
            found.append(
                TranscriptWarning(
                    "echo",
                    f"{result.echoes} window end(s) cut inside speech wrote the next "
                    "window's first words ahead of their audio; those words were kept once, "
                    "where they are heard",
                )
            )
        if result.too_repetitive:
            found.append(
                TranscriptWarning(
                    "repetitive",
                    f"{result.too_repetitive} segment(s) dropped as repetitive (above "
                    f"--compression-ratio-threshold {p.compression_ratio_threshold:g}, or "
                    "earlier segments' words (nearly) again in under "
                    f"{p.repeat_min_span_fraction:.2f} of their time)",
                )
            )
        return found
