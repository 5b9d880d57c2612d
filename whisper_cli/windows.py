"""Cut a stream of 16 kHz audio blocks into independent windows of at most 30 s.

Whisper sees 30 s at a time. Cutting blindly every 30 s splits words, so each cut is placed
in the quietest stretch of the last few seconds before the limit: the middle of a pause
when there is one, else the deepest dip in the speech. Windows tile the input exactly (no
sample lost or repeated), and are produced lazily so memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from whisper_cli.audio import SAMPLE_RATE

FRAME_SECONDS = 0.025  # energy frame: long enough to span a pitch period of low voices
HOP_SECONDS = 0.010
SMOOTH_FRAMES = 5  # ~50 ms of smoothing: a click or a single stop closure is not a pause
# Frames within this many dB of the region's quietest count as quiet; the longest run of
# them is taken, so a real pause wins over a deeper but momentary dip inside a word.
QUIET_MARGIN_DB = 6.0
_EPS = 1e-10  # energy floor (-100 dB) so digital silence has a finite level


@dataclass(frozen=True)
class Window:
    """A piece of one input that is transcribed on its own."""

    source: int  # index of the input this window belongs to
    index: int  # window number within that input
    start: float  # seconds from the input's start
    audio: np.ndarray  # float32 mono 16 kHz, at most max_seconds long

    @property
    def end(self) -> float:
        # Counted in samples, so a window's end is exactly the next window's start.
        return (round(self.start * SAMPLE_RATE) + len(self.audio)) / SAMPLE_RATE


def cut_windows(
    blocks: Iterable[np.ndarray],
    source: int = 0,
    max_seconds: float = 30.0,
    search_seconds: float = 6.0,
) -> Iterator[Window]:
    """Yield consecutive windows of at most ``max_seconds`` that together tile ``blocks``.

    Each cut is chosen within the last ``search_seconds`` before the limit (see module doc).
    Only about one window of audio is held at a time, whatever the block sizes.
    """
    max_len = round(max_seconds * SAMPLE_RATE)
    search_len = round(search_seconds * SAMPLE_RATE)
    if max_len < 1:
        raise ValueError(f"max_seconds must allow at least one sample, got {max_seconds}")
    if not 0 <= search_len < max_len:
        raise ValueError("search_seconds must be at least 0 and less than max_seconds")

    pending: list[np.ndarray] = []
    pending_len = 0
    offset = 0  # samples already emitted
    index = 0
    for block in blocks:
        block = np.asarray(block, dtype=np.float32)
        if block.ndim != 1:
            raise ValueError(f"audio blocks must be 1-D, got shape {block.shape}")
        pending.append(block)
        pending_len += len(block)
        # Cut only once more than a full window is buffered: only then is a cut needed.
        if pending_len <= max_len:
            continue
        buffer = np.concatenate(pending)
        while len(buffer) > max_len:
            cut = choose_cut(buffer[:max_len], max_len - search_len)
            yield Window(source, index, offset / SAMPLE_RATE, buffer[:cut].copy())
            offset += cut
            index += 1
            buffer = buffer[cut:]
        pending = [buffer.copy()]  # the copy lets the big concatenated buffer be freed
        pending_len = len(buffer)
    if pending_len:
        yield Window(source, index, offset / SAMPLE_RATE, np.concatenate(pending))


def choose_cut(audio: np.ndarray, search_start: int) -> int:
    """Sample index in ``[search_start, len(audio)]`` at which to end a window.

    The middle of the longest quiet run of frames in the search region (ties: the later).
    """
    region = audio[search_start:]
    frame = round(FRAME_SECONDS * SAMPLE_RATE)
    hop = round(HOP_SECONDS * SAMPLE_RATE)
    if len(region) < frame + hop * SMOOTH_FRAMES:  # no room to search: cut at the limit
        return len(audio)
    level = _smoothed_level_db(region, frame, hop)
    quiet = level <= level.min() + QUIET_MARGIN_DB
    first, last = _longest_run(quiet)
    centre_frame = (first + last) / 2
    return search_start + round(centre_frame * hop) + frame // 2


def _smoothed_level_db(x: np.ndarray, frame: int, hop: int) -> np.ndarray:
    """Mean power of each frame (hop apart), smoothed over SMOOTH_FRAMES, in dB."""
    power = np.concatenate(([0.0], np.cumsum(np.square(x, dtype=np.float64))))
    starts = np.arange(0, len(x) - frame + 1, hop)
    energy = (power[starts + frame] - power[starts]) / frame
    kernel = np.ones(SMOOTH_FRAMES) / SMOOTH_FRAMES
    # mode="same" would mix in zeros at the edges and fake a pause there; pad with edges.
    padded = np.pad(energy, SMOOTH_FRAMES // 2, mode="edge")
    smoothed = np.convolve(padded, kernel, mode="valid")
    return 10 * np.log10(smoothed + _EPS)


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """First and last index of the longest run of True in ``mask`` (the later on ties)."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)  # exclusive
    lengths = ends - starts
    best = len(lengths) - 1 - int(np.argmax(lengths[::-1]))
    return int(starts[best]), int(ends[best]) - 1
