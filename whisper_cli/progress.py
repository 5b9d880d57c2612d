"""What a run reports while it works: the stage it is in, and the audio decoded so far.

Decoded audio moves during a batch, not only when one ends: the final part (the
scheduler's, which windows are done) plus, for each window of the batch being decoded,
how far into it its latest timestamp reaches (the engine's `on_rows`). The figure never
goes back and never passes the known total; a window that falls back is not counted
again. Data flows one way: the caller hands a callback down and gets Progress values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# The stages of a run, in order (the CLI's own "loading model" comes before them).
FINDING_SPEECH = "finding speech"  # the speech map of the first windows
ENCODING = "encoding"  # the first batch's encoder pass (and a first run's kernel timing)
TRANSCRIBING = "transcribing"


@dataclass(frozen=True)
class Progress:
    """What the pipeline reports: after each batch, and during one as it decodes."""

    audio_done: float  # seconds of audio decoded so far
    audio_total: float  # seconds of audio in all inputs (known durations)
    elapsed: float
    stage: str = TRANSCRIBING


class Reporter:
    """Builds Progress from the scheduler's final audio and the rows of the batch."""

    def __init__(
        self,
        on_progress: Callable[[Progress], None] | None,
        total: float,
        audio_done: Callable[[], float],
    ) -> None:
        """total: 0 when some input's length is unknown (stdin); audio_done(): the
        scheduler's seconds of final audio."""
        self.on_progress = on_progress
        self.total = total
        self.audio_done = audio_done
        self.started = time.perf_counter()
        self.shown = 0.0
        self.stage: str | None = None
        self._base = 0.0
        self._windows: list[float | None] = []  # per row: its window's length, None: skip
        self._at: dict[int, float] = {}  # row -> seconds of its window decoded

    def enter(self, stage: str) -> None:
        if stage != self.stage:
            self.stage = stage
            self._emit(self.shown)

    def encoding(self) -> None:
        """An encoder pass starts: a stage of its own only before the first decode."""
        if self.stage == FINDING_SPEECH:
            self.enter(ENCODING)

    def batch(self, windows: list[float | None]) -> None:
        """A batch starts: each row's window length (None: an attempt already counted)."""
        if self.on_progress is None:
            return  # nobody watches: not even the scheduler's sum is taken
        self._base = self.audio_done()
        self._windows = windows
        self._at = {}

    def rows(self, offset: int, positions: dict[int, float | None]) -> None:
        """The engine's RowPositions for the rows from `offset` of the batch."""
        for row, at in positions.items():
            r = row + offset
            length = self._windows[r] if r < len(self._windows) else None
            if length is not None:
                self._at[r] = length if at is None else min(at, length)
        self.stage = TRANSCRIBING
        self._emit(self._base + sum(self._at.values()))

    def settled(self) -> None:
        """The batch is done: the scheduler's figure."""
        self.stage = TRANSCRIBING
        if self.on_progress is not None:
            self._emit(self.audio_done())

    def _emit(self, done: float) -> None:
        if self.total:
            done = min(done, self.total)
        self.shown = max(self.shown, done)
        if self.on_progress is not None:
            elapsed = time.perf_counter() - self.started
            self.on_progress(Progress(self.shown, self.total, elapsed, self.stage))
