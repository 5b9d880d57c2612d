"""Windows of many inputs -> batches of jobs; fallback attempts queued again; input events.

The scheduler pulls windows from each input's cutter in turn (only a batch of windows
is held at a time), fills batches with the attempts that must be decoded again first
and new windows after them, and, once no new window is left, fills a batch's spare rows
with its retries' later temperatures (decoded ahead; the same text as one attempt at a
time, since every attempt is seeded by its window and temperature, not its batch).

It knows nothing of decoding: after each batch the caller says which of its jobs must
be decoded again (`settle`), and the scheduler turns that into explicit events: an
input's windows are `Settled` as soon as they and every window before them are final
(their text can be written: nothing before it can change), the input is `Finished` when
its last window has been cut and every window of it is final, or `Failed` when its audio
cannot be read. Events are drained with `events()`.

Under a latency bound (live input) a batch is decoded as soon as its oldest window's
first speech was read `latency` seconds ago, full or not; the inputs are then read in
small blocks, and the cutter hands control back after each one, so that a window does
not wait on audio that has not arrived.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from whisper_cli.audio import SAMPLE_RATE, AudioSource
from whisper_cli.decoding import DecodedRow
from whisper_cli.errors import InputError
from whisper_cli.windows import Window, WindowCutter

# Under a latency bound, inputs are read in blocks this long: the bound is checked as
# each arrives (a live pipe delivers audio in real time).
LIVE_BLOCK_SECONDS = 0.5
_END = object()  # _windows: no window is left
T = TypeVar("T")


@dataclass
class Counters:
    """What a run did around the engine (whose own counters say what it ran)."""

    windows: int = 0  # windows cut (each decoded at least once)
    batches: int = 0
    fallbacks: int = 0  # window decodes repeated at a higher temperature
    ahead: int = 0  # attempts decoded ahead in spare rows (used or not)
    dropped: int = 0  # segments dropped as text over non-speech (see judge.py)
    detector_s: float = 0.0  # wall time of the speech detector


@dataclass(eq=False)
class Job:
    """One window to decode, at the temperature of its attempt."""

    window: Window
    attempt: int = 0  # index into policy.temperatures
    language: str | None = None  # once known (a fallback keeps its window's language)
    attempts: list[DecodedRow] = field(default_factory=list)  # its earlier attempts' rows
    # (S, C): its encoder output, kept while it waits to be decoded again (it is the
    # same at every temperature, so the window is encoded once)
    features: torch.Tensor | None = None
    # A later attempt of that job, decoded ahead in a spare row of its batch.
    ahead_of: Job | None = None


@dataclass
class Track:
    """Where one input stands."""

    index: int
    source: AudioSource
    duration: float = 0.0  # seconds of audio read so far (all of it once cut through)
    windows: int = 0  # windows cut so far
    pending: int = 0  # windows cut but not final yet
    done_to: float = 0.0  # seconds: the end of its latest final window
    cut_done: bool = False  # its last window has been cut
    failed: bool = False  # its audio could not be read (its windows' text is not used)
    started: float = 0.0  # perf_counter when its first audio was read
    settled: int = 0  # windows 0..settled-1 are final
    final: set[int] = field(default_factory=set)  # final windows after those

    @property
    def path(self) -> str:
        return self.source.info.path


@dataclass(frozen=True)
class Settled:
    """Windows first..stop-1 of an input are final, and so is every window before them."""

    track: Track
    first: int
    stop: int


@dataclass(frozen=True)
class Finished:
    track: Track


@dataclass(frozen=True)
class Failed:
    track: Track
    error: InputError


def later_attempts(
    windows: list[tuple[T, int]], temperatures: int, spare: int
) -> list[tuple[T, int]]:
    """Attempts decoded ahead in `spare` rows: for each (window, its latest attempt),
    round robin, each window's next attempt first, then the one after, none past the
    last temperature."""
    # Round r holds each window's (r + 1)-th attempt after its latest, where it has one.
    rounds = [
        (w, a + r) for r in range(1, temperatures) for w, a in windows if a + r < temperatures
    ]
    return rounds[: max(spare, 0)]


class Scheduler:
    """Batches of jobs over `sources`, in order (see the module doc)."""

    def __init__(
        self,
        sources: list[AudioSource],
        cutter: Callable[[int], WindowCutter],
        batch_size: int,
        temperatures: int,
        counters: Counters,
        rows: Callable[[], int] | None = None,
        latency: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """cutter(i): a fresh cutter for input i; temperatures: attempts per window;
        rows(): the rows a decode takes at once now (below batch_size after an
        out-of-memory), which bounds the attempts decoded ahead; latency: the bound (see
        the module doc), its windows' `ready` times read on `clock`."""
        self.latency = latency
        self.clock = clock
        self.tracks = [Track(i, s) for i, s in enumerate(sources)]
        self.cutter = cutter
        self.batch_size = batch_size
        self.rows = rows or (lambda: batch_size)
        self.temperatures = temperatures
        self.counters = counters
        self.retries: deque[Job] = deque()
        self._events: list[Settled | Finished | Failed] = []
        self._reading: WindowCutter | None = None  # the cutter of the input being read
        # No window is left to cut: the batches from now on hold only retries (and the
        # last windows, in the batch where this turned true).
        self.exhausted = False

    def events(self) -> list[Settled | Finished | Failed]:
        """The events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def batches(self) -> Iterator[list[Job]]:
        """Batches of up to batch_size jobs: attempts queued again first, then new windows;
        with no new window left, later attempts of its retries in the spare rows."""
        windows = self._windows()
        while True:
            batch: list[Job] = []
            while self.retries and len(batch) < self.batch_size:
                batch.append(self.retries.popleft())
            while not self.exhausted and len(batch) < self.batch_size and not self._due(batch):
                window = next(windows)
                if window is _END:
                    self.exhausted = True
                elif window is not None:  # None: a block arrived, with no window yet
                    batch.append(Job(window))
            if not batch:
                return
            if self.exhausted:
                batch += self._ahead(batch, self.rows() - len(batch))
            yield batch

    def settle(self, batch: list[Job], again: list[Job]) -> None:
        """The batch is decoded; `again` (jobs of it) are decoded at their next temperature."""
        retried = {id(j) for j in again}
        self.retries.extend(again)
        for job in batch:
            if job.ahead_of is not None or id(job) in retried:
                continue  # an ahead attempt is its job's; a retry is not final yet
            track = self.tracks[job.window.source]
            track.pending -= 1
            track.done_to = max(track.done_to, job.window.end)
            track.final.add(job.window.index)
            first = track.settled
            while track.settled in track.final:
                track.final.remove(track.settled)
                track.settled += 1
            if track.settled > first and not track.failed:
                self._events.append(Settled(track, first, track.settled))
            self._finish_if_done(track)

    def audio_done(self) -> float:
        """Seconds of audio final so far, over every input."""
        return sum(t.duration if t.cut_done and t.pending == 0 else t.done_to for t in self.tracks)

    # -- internals ------------------------------------------------------------------------

    def _finish_if_done(self, track: Track) -> None:
        if track.cut_done and track.pending == 0 and not track.failed:
            self._events.append(Finished(track))

    def _due(self, batch: list[Job]) -> bool:
        """Under a latency bound: the batch's oldest window has waited long enough, and
        more would mean waiting for audio that has not arrived."""
        if self.latency is None or (self._reading is not None and not self._reading.starving):
            return False
        ready = [j.window.ready for j in batch if j.window.ready is not None]
        return bool(ready) and self.clock() - min(ready) >= self.latency

    def _windows(self) -> Iterator[Window | object | None]:
        """Each input's windows in turn, then _END; None where a live block gave none."""
        live = self.latency is not None
        for track in self.tracks:
            track.started = time.perf_counter()  # its wall time counts from its first window
            cutter = self._reading = self.cutter(track.index)
            try:
                blocks = track.source.blocks(LIVE_BLOCK_SECONDS) if live else track.source.blocks()
                for window in cutter.cut(blocks, ticks=live):
                    track.duration = cutter.samples / SAMPLE_RATE
                    if window is not None:
                        track.pending += 1
                        track.windows += 1
                        self.counters.windows += 1
                    yield window
                track.duration = cutter.samples / SAMPLE_RATE
                if cutter.samples == 0:
                    raise InputError(track.path, "contains no audio")
            except InputError as exc:
                track.failed = True
                self._events.append(Failed(track, exc))
            finally:
                self.counters.detector_s += cutter.stream.seconds
                track.cut_done = True
            # Every window cut may be final already (or there was none: no speech at all).
            self._finish_if_done(track)
        self._reading = None
        while True:
            yield _END

    def _ahead(self, batch: list[Job], spare: int) -> list[Job]:
        """Up to `spare` later attempts of the batch's retries, their next temperature
        first, round robin: rows that would otherwise decode nothing (or padding)."""
        retries = [(j, j.attempt) for j in batch if j.features is not None]
        extra = [
            Job(job.window, a, job.language, features=job.features, ahead_of=job)
            for job, a in later_attempts(retries, self.temperatures, spare)
        ]
        self.counters.ahead += len(extra)
        return extra
