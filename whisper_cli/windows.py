"""Speech map -> windows of at most 30 s that start at speech and are cut at non-speech.

The audio streams in once. The speech map (speech.py) scores every 32 ms frame; frames
are speech by hysteresis (policy.vad_threshold / vad_neg_threshold), speech shorter than
policy.min_speech_seconds is dropped, and pauses shorter than policy.min_silence_seconds
are kept inside the speech around them, except where one scores at least
policy.short_speech_threshold (a short word said clearly). Each stretch of speech,
padded by policy.speech_lead_seconds before and policy.speech_tail_seconds after, is a
*piece*; a window opens at the start of a
piece and takes the pieces that follow while it stays within 30 s, so it starts shortly
before speech and ends shortly after it. Audio between windows (everything the map calls
non-speech, beyond the padding) is never decoded. A window is one stretch of the input,
pauses included: the model sees speech with its real timing, as it was trained.

A stretch of speech longer than a window is cut at its least speech-like frame in the
last policy.cut_search_seconds before the limit. With the detector off (`vad=False`) the
whole input is one stretch of speech: windows then tile it exactly, cut at the least
speech-like frame in the same way.

Only the pieces of the window being filled and the stretch being read are held, so
memory stays bounded whatever the input's length.

With a latency bound (live input), the window being filled is also cut once its first
speech was read `latency` seconds ago (wall time) and the input has made the reader wait
(the audio after it has not arrived: waiting for it is what the bound limits), at a
place the map allows: before a stretch still being spoken, or after one that has gone
quiet for the tail's length. An utterance that runs on past the bound is cut at its
first such pause, or at 30 s as above; never inside a word. Input that arrives faster
than it is read (a file, a recording piped in whole) is cut as without a bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.features import CHUNK_SECONDS
from whisper_cli.options import Policy
from whisper_cli.speech import (
    FRAME_SAMPLES,
    FRAME_SECONDS,
    LevelGain,
    QuietSection,
    SileroVAD,
    SpeechStream,
)


def speech_stream(detector: SileroVAD, policy: Policy) -> SpeechStream:
    """A fresh speech map of one input, scored as the policy says (its gain, its quiet
    sections heard again)."""
    quiet = None
    if policy.quiet_drop_db is not None:
        quiet = QuietSection.from_db(
            policy.quiet_drop_db, policy.quiet_hold_seconds, policy.quiet_room_db
        )
    return SpeechStream(
        detector,
        level_gain(policy),
        quiet,
        threshold=policy.vad_threshold,
        min_run=min_speech_frames(policy),
    )


def min_speech_frames(policy: Policy) -> int:
    """The frames of speech running that make a stretch of speech, not a click or a
    breath (policy.min_speech_seconds): for the cutter and for a quiet section's hearing."""
    return max(1, round(policy.min_speech_seconds / FRAME_SECONDS))


def level_gain(policy: Policy) -> LevelGain | None:
    """A fresh state of the detector's gain for one input (None: the policy has none)."""
    if policy.detector_target_dbfs is None:
        return None
    return LevelGain.from_dbfs(policy.detector_target_dbfs, policy.detector_max_gain_db)


@dataclass(frozen=True)
class Window:
    """A stretch of one input that is transcribed on its own."""

    source: int  # index of the input this window belongs to
    index: int  # window number within that input
    first_sample: int  # where it starts in the input
    audio: np.ndarray  # float32 mono 16 kHz, at most 30 s
    speech: np.ndarray  # (ceil(len(audio) / 512),) bool: the speech frames of `audio`
    # time.monotonic() when its first speech was read, under a latency bound (else None)
    ready: float | None = None
    # Its last speech runs to less than a tail (policy.speech_tail_seconds) before its end:
    # the window was cut inside a stretch of speech, or the input ended there. What the
    # decode leaves of that speech no other window holds (see Policy.cut_end_slack_seconds).
    cut_off: bool = False

    @property
    def start(self) -> float:
        return self.first_sample / SAMPLE_RATE

    @property
    def end(self) -> float:
        return (self.first_sample + len(self.audio)) / SAMPLE_RATE

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    @property
    def speech_seconds(self) -> float:
        return float(self.speech.sum()) * FRAME_SECONDS

    def speech_seconds_between(self, start: float, end: float) -> float:
        """Seconds of speech frames in [start, end) seconds of the window (clipped to it)."""
        first = max(0, int(start / FRAME_SECONDS))
        last = max(first, int(np.ceil(end / FRAME_SECONDS)))
        return float(self.speech[first:last].sum()) * FRAME_SECONDS


class WindowCutter:
    """Cuts one input's audio into windows as it streams (see the module doc).

    After `cut` is exhausted, `samples` is the input's length and `speech_map` its map.
    """

    def __init__(
        self,
        detector: SileroVAD,
        policy: Policy,
        *,
        vad: bool = True,
        source: int = 0,
        max_seconds: float = CHUNK_SECONDS,
        latency: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        waited: Callable[[], bool] = lambda: True,
    ) -> None:
        """latency: cut the window being filled this long after its first speech was
        read, where the map allows, when waited() says the input made its reader wait
        since it was last asked (see the module doc); None: only by length."""
        self.policy = policy
        self.latency = latency
        self.clock = clock
        self.waited = waited
        self.starving = False  # reading the latest block waited for the input
        self.vad = vad
        self.source = source
        self.stream = speech_stream(detector, policy)
        frames = lambda s: max(0, round(s / FRAME_SECONDS))  # noqa: E731
        self.max_frames = int(max_seconds / FRAME_SECONDS)  # 937 frames: 29.98 s
        # ... and the input's last, partial frame may take a window to the full 30 s: an
        # input of exactly 30 s is one window, not one and a 16 ms tail.
        self.max_samples = round(max_seconds * SAMPLE_RATE)
        self.lead = frames(policy.speech_lead_seconds)
        self.tail = frames(policy.speech_tail_seconds)
        self.min_speech = min_speech_frames(policy)
        self.min_silence = max(1, frames(policy.min_silence_seconds))
        self.search = min(frames(policy.cut_search_seconds), self.max_frames - 1)
        if vad and self.lead + self.tail >= self.max_frames:
            raise ValueError("speech_lead_seconds and speech_tail_seconds leave no room for speech")

    @property
    def samples(self) -> int:
        return self.stream.samples

    @property
    def speech_map(self) -> np.ndarray:
        return self.stream.map()

    def cut(self, blocks: Iterable[np.ndarray], ticks: bool = False) -> Iterator[Window | None]:
        """The input's windows, in order; ticks: also None after each block that gave none
        (a caller waiting on a live input gets control back as each block arrives)."""
        self._audio: list[np.ndarray] = []  # audio from sample self._audio_start on
        self._audio_start = 0
        self._frame = 0  # frames decided so far
        self._speaking = False  # hysteresis state of the last frame
        self._speech: list[bool] = []  # per frame from self._audio_start // 512 on
        self._run: tuple[int, int] | None = None  # open stretch: first, last+1 speech frame
        self._probs: list[float] = []  # the same frames' speech probabilities
        self._piece_from = 0  # the open stretch's piece starts here (frames)
        self._pieces: list[tuple[int, int]] = []  # frames of the window being filled
        self._emitted_to = 0  # frames up to which earlier windows took pieces
        self._index = 0
        self._ready: float | None = None  # clock() at the first speech of the open window
        for block in blocks:
            block = np.asarray(block, dtype=np.float32)
            if block.ndim != 1:
                raise ValueError(f"audio blocks must be 1-D, got shape {block.shape}")
            self._audio.append(block)
            self.starving = self.waited()
            emitted = self._index
            yield from self._decide(self.stream.push(block))
            if ticks and self._index == emitted:
                yield None
        yield from self._decide(self.stream.finish())
        yield from self._close_run()
        yield from self._emit()

    # -- frame by frame ------------------------------------------------------------------

    def _decide(self, probs: np.ndarray) -> Iterator[Window]:
        p = self.policy
        for prob in probs.tolist():
            i = self._frame
            self._frame += 1
            level = p.vad_neg_threshold if self._speaking else p.vad_threshold
            self._speaking = prob >= level
            self._speech.append(self._speaking)
            self._probs.append(prob)
            is_speech = self._speaking or not self.vad  # detector off: all is speech
            if is_speech:
                if self._run is not None and i - self._run[1] >= self.min_silence:
                    yield from self._close_run()
                if self._run is None:
                    if self._ready is None and self.latency is not None:
                        self._ready = self.clock()
                    self._run = (i, i + 1)
                    self._piece_from = max(i - self.lead, self._last_piece_end())
                else:
                    self._run = (self._run[0], i + 1)
            elif self._run is not None and i + 1 - self._run[1] >= self.min_silence:
                yield from self._close_run()
            if self._run is not None and self._too_long(self._frame):
                yield from self._split()
            if self._ready is not None:
                yield from self._cut_if_due()
        self._drop_unneeded_audio()

    def _cut_if_due(self) -> Iterator[Window]:
        """Under a latency bound, the window being filled once it is due (module doc)."""
        if self.clock() - self._ready < self.latency:
            return
        if not self.starving:
            return  # the audio after it is here already: the window goes on as usual
        if self._run is not None and self._frame - self._run[1] >= max(self.tail, 1):
            yield from self._close_run()  # quiet for the tail: the stretch ends here
        yield from self._emit()  # the pieces before a stretch still being spoken
        if not self._pieces and self._run is None:
            self._ready = None  # what was due was a click: nothing waits now

    def _last_piece_end(self) -> int:
        return self._pieces[-1][1] if self._pieces else self._emitted_to

    def _close_run(self) -> Iterator[Window]:
        """The open stretch of speech has ended: it becomes a piece, or is dropped."""
        if self._run is None:
            return
        first, last = self._run
        self._run = None
        if self.vad and last - first < self.min_speech:
            base = self._audio_start // FRAME_SAMPLES
            peak = max(self._probs[first - base : last - base], default=0.0)
            if peak < self.policy.short_speech_threshold:
                return  # a click or a breath
        # Detector off: the windows tile the input, up to its last sample.
        end = min(last + self.tail, self._frame) if self.vad else self._frame
        yield from self._add_piece(self._piece_from, end)

    def _too_long(self, end: int) -> bool:
        """Whether the window being filled would pass 30 s if it ended at frame `end`."""
        end_sample = min(end * FRAME_SAMPLES, self.samples)
        return end_sample - self._window_start() * FRAME_SAMPLES > self.max_samples

    def _window_start(self) -> int:
        return self._pieces[0][0] if self._pieces else self._piece_from

    def _split(self) -> Iterator[Window]:
        """The window being filled, with the open stretch, is longer than 30 s: cut it where
        it is least speech-like, so that windows come out full.

        In the last `search` frames before the limit: a quarter into the longest run of
        non-speech frames (a pause too short to end the stretch, or the gap before it; at
        most a pad into it) if there is one, so that the next window opens with most of
        the pause before its first word, as Whisper's training windows do and as a pad
        does; else the frame of least speech probability (a 3-frame mean: one dip is not
        a pause). A cut before the open stretch starts ends the window at its last
        piece; a cut inside it ends the window there and the stretch goes on from the cut
        (with the detector on, from a pad before the pause ends: the pause is not decoded).
        """
        limit = self._window_start() + self.max_frames
        first = limit - self.search
        quiet = ~np.array(self._speech_frames(first, limit), dtype=bool)
        if quiet.any():
            run_first, run_last = longest_run(quiet)
            cut = resume = first + run_first + min(self.tail, (run_last + 1 - run_first) // 4)
            if self.vad:  # the pause itself need not be decoded: a pad either side of it
                resume = max(resume, first + run_last + 1 - self.lead)
        else:
            probs = self.stream.map()[first:limit]
            smooth = np.convolve(np.pad(probs, 1, mode="edge"), np.ones(3) / 3, mode="valid")
            cut = resume = first + int(np.argmin(smooth))
        if self._pieces and cut <= self._piece_from:
            yield from self._emit()  # the stretch starts after the cut: it opens the next one
            return
        cut = max(cut, self._piece_from + 1)
        resume = max(resume, cut)
        yield from self._add_piece(self._piece_from, cut)
        yield from self._emit()
        self._piece_from = resume
        if self._run is not None and self._run[1] <= cut:
            self._run = None  # its speech ended before the cut: the next speech opens anew
        elif self._run is not None:
            self._run = (resume, max(self._run[1], resume))

    def _add_piece(self, start: int, end: int) -> Iterator[Window]:
        if end <= start:
            return
        if self._pieces and self._too_long(end):
            yield from self._emit()
        self._pieces.append((start, end))

    def _emit(self) -> Iterator[Window]:
        if not self._pieces:
            return
        start, end = self._pieces[0][0], self._pieces[-1][1]
        audio = self._take_audio(start, end)
        speech = np.array(self._speech_frames(start, end), dtype=bool)
        # A stretch that ended on its own is followed by a whole tail of non-speech.
        cut_off = self.vad and self.tail > 0 and bool(speech[-self.tail :].any())
        self._emitted_to = end
        self._pieces = []
        ready = self._ready
        # The stretch still open (if any) opens the next window: it is due as early.
        self._ready = ready if self._run is not None else None
        yield Window(self.source, self._index, start * FRAME_SAMPLES, audio, speech, ready, cut_off)
        self._index += 1

    # -- the audio buffer --------------------------------------------------------------------

    def _take_audio(self, start: int, end: int) -> np.ndarray:
        buffer = np.concatenate(self._audio) if len(self._audio) > 1 else self._audio[0]
        self._audio = [buffer]
        a = start * FRAME_SAMPLES - self._audio_start
        b = min(end * FRAME_SAMPLES, self._audio_start + len(buffer)) - self._audio_start
        assert a >= 0, "audio of a piece was dropped before it was cut"
        return buffer[a:b].copy()

    def _speech_frames(self, start: int, end: int) -> list[bool]:
        first = self._audio_start // FRAME_SAMPLES
        return self._speech[start - first : end - first]

    def _drop_unneeded_audio(self) -> None:
        """Forget audio (and frame decisions) that no window can take any more."""
        if self._pieces:
            keep = self._pieces[0][0]  # the window being filled
        elif self._run is not None:
            keep = self._piece_from
        else:
            keep = max(self._frame - self.lead, self._emitted_to)
        keep_sample = keep * FRAME_SAMPLES
        drop = keep_sample - self._audio_start
        if drop <= 0 or not self._audio:
            return
        buffer = np.concatenate(self._audio)
        self._audio = [buffer[drop:].copy()]
        self._speech = self._speech[drop // FRAME_SAMPLES :]
        self._probs = self._probs[drop // FRAME_SAMPLES :]
        self._audio_start = keep_sample


def cut_windows(
    blocks: Iterable[np.ndarray],
    detector: SileroVAD,
    policy: Policy | None = None,
    *,
    vad: bool = True,
    source: int = 0,
) -> Iterator[Window]:
    """Windows of one input (see WindowCutter), for callers that need only the windows."""
    yield from WindowCutter(detector, policy or Policy(), vad=vad, source=source).cut(blocks)


def longest_run(mask: np.ndarray) -> tuple[int, int]:
    """First and last index of the longest run of True in ``mask`` (the later on ties)."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)  # exclusive
    best = len(starts) - 1 - int(np.argmax((ends - starts)[::-1]))
    return int(starts[best]), int(ends[best]) - 1
