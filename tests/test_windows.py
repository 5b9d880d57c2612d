"""Tests for cutting audio into independent windows of at most 30 s (whisper_cli.windows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from util import REPO, shared_clip

from whisper_cli.audio import SAMPLE_RATE, load_audio
from whisper_cli.windows import Window, cut_windows

SR = SAMPLE_RATE
MAX = 30 * SR
SEARCH = 6 * SR

# --- helpers ------------------------------------------------------------------------------


def random_blocks(x: np.ndarray, rng: np.random.Generator, largest: int) -> Iterator[np.ndarray]:
    """x in blocks of random sizes (empty blocks included) that together are exactly x."""
    start = 0
    while start < len(x):
        size = int(rng.integers(0, largest))
        yield x[start : start + size]
        start += size


def babble(seconds: float, seed: int = 0) -> np.ndarray:
    """Speech-like noise with syllable-rate loudness changes and no pause anywhere."""
    rng = np.random.default_rng(seed)
    n = round(seconds * SR)
    t = np.arange(n) / SR
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6.28))
    return (0.1 * envelope * rng.standard_normal(n)).astype(np.float32)


def check_tiling(windows: list[Window], x: np.ndarray, source: int = 0) -> None:
    """Windows are consecutive, in order, within limits, and together are exactly x."""
    if not windows:
        assert len(x) == 0
        return
    position = 0
    for i, window in enumerate(windows):
        assert (window.source, window.index) == (source, i)
        assert window.audio.dtype == np.float32 and window.audio.ndim == 1
        assert window.start == position / SR
        assert 0 < len(window.audio) <= MAX
        if i < len(windows) - 1:  # every cut but the end of input lies in the search region
            assert len(window.audio) >= MAX - SEARCH
            assert window.end == windows[i + 1].start
        position += len(window.audio)
    assert position == len(x)
    np.testing.assert_array_equal(np.concatenate([w.audio for w in windows]), x)


def frame_power(x: np.ndarray, frame: int = 400, hop: int = 160) -> np.ndarray:
    """Mean power of 25 ms frames every 10 ms (independent of the cutter's own measure)."""
    csum = np.concatenate(([0.0], np.cumsum(x.astype(np.float64) ** 2)))
    starts = np.arange(0, len(x) - frame + 1, hop)
    return (csum[starts + frame] - csum[starts]) / frame


def power_at(x: np.ndarray, sample: int, frame: int = 400) -> float:
    piece = x[max(0, sample - frame // 2) : sample + frame // 2].astype(np.float64)
    return float(np.mean(piece**2))


def continuous_speech() -> np.ndarray:
    """The shared clips back to back, no gaps: jfk, both diarization channels, multilingual."""
    wav = shared_clip("stereo_diarization.wav")
    parts = [
        load_audio(shared_clip("jfk.flac")),
        load_audio(wav, "left"),
        load_audio(wav, "right"),
        load_audio(shared_clip("multilingual.mp3")),
    ]
    return np.concatenate(parts)


# --- tiling -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_windows_tile_the_input_exactly_whatever_the_blocks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = babble(float(rng.uniform(31, 125)), seed)
    largest = int(rng.choice([50, 4000, 200_000, 2_000_000]))
    windows = list(cut_windows(random_blocks(x, rng, largest), source=seed))
    check_tiling(windows, x, source=seed)
    assert len(windows) >= int(len(x) / MAX) + 1


@pytest.mark.parametrize("seconds", [0.0, 0.5, 29.99, 30.0])
def test_up_to_30_s_is_one_window(seconds: float) -> None:
    x = babble(seconds)
    windows = list(cut_windows([x[: len(x) // 2], x[len(x) // 2 :]]))
    assert len(windows) == (1 if len(x) else 0)
    check_tiling(windows, x)


def test_just_over_30_s_is_cut_inside_the_search_region() -> None:
    x = babble(30.0 + 1 / SR)
    windows = list(cut_windows([x]))
    assert len(windows) == 2
    check_tiling(windows, x)


def test_window_end_and_custom_limits() -> None:
    x = babble(25.0)
    windows = list(cut_windows([x], source=3, max_seconds=10.0, search_seconds=2.0))
    assert [w.index for w in windows] == [0, 1, 2]
    assert all(8.0 <= w.end - w.start <= 10.0 for w in windows[:-1])
    assert windows[-1].end == pytest.approx(25.0)
    np.testing.assert_array_equal(np.concatenate([w.audio for w in windows]), x)


def test_search_seconds_zero_cuts_exactly_at_the_limit() -> None:
    x = babble(65.0)
    windows = list(cut_windows([x], search_seconds=0.0))
    assert [len(w.audio) for w in windows] == [MAX, MAX, 5 * SR]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"search_seconds": 30.0}, "search_seconds"), ({"max_seconds": 0.0}, "max_seconds")],
)
def test_bad_limits(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next(cut_windows([babble(1.0)], **kwargs))


def test_blocks_must_be_mono() -> None:
    with pytest.raises(ValueError, match="1-D"):
        next(cut_windows([np.zeros((100, 2), np.float32)]))


# --- where the cut goes -------------------------------------------------------------------


@pytest.mark.parametrize("pause_at", [24.3, 26.0, 27.5, 29.6])
def test_cut_lands_in_an_inserted_pause(pause_at: float) -> None:
    speech = babble(70.0, seed=1)
    rng = np.random.default_rng(2)
    pause = (3e-4 * rng.standard_normal(round(0.3 * SR))).astype(np.float32)  # room noise
    at = round(pause_at * SR)
    x = np.concatenate([speech[:at], pause, speech[at:]])
    first = next(cut_windows([x]))
    assert pause_at < first.end < pause_at + 0.3


def test_a_long_pause_beats_a_slightly_deeper_short_dip() -> None:
    x = babble(45.0, seed=3)
    rng = np.random.default_rng(4)
    long_pause = slice(round(25.0 * SR), round(25.5 * SR))  # 0.5 s at about -55 dB
    short_dip = slice(round(28.9 * SR), round(28.98 * SR))  # 80 ms at about -58 dB
    x[long_pause] = 1.8e-3 * rng.standard_normal(long_pause.stop - long_pause.start)
    x[short_dip] = 1.25e-3 * rng.standard_normal(short_dip.stop - short_dip.start)
    first = next(cut_windows([x]))
    assert 25.0 < first.end < 25.5


def test_cut_lands_in_an_inserted_silence_in_real_speech() -> None:
    speech = continuous_speech()
    at = round(27.2 * SR)
    x = np.concatenate([speech[:at], np.zeros(round(0.4 * SR), np.float32), speech[at:]])
    windows = list(cut_windows(random_blocks(x, np.random.default_rng(5), 40_000)))
    check_tiling(windows, x)
    assert 27.2 < windows[0].end < 27.6


@pytest.mark.parametrize("offset", [0.0, 2.5, 5.0, 7.5, 10.0, 12.5, 15.0, 17.5])
def test_cut_in_continuous_real_speech_is_at_an_energy_minimum(offset: float) -> None:
    # Starting the same speech at different offsets moves the search region over different
    # words, so each case checks a different cut. All are made without any inserted gap.
    x = continuous_speech()[round(offset * SR) :]
    windows = list(cut_windows(random_blocks(x, np.random.default_rng(6), 100_000)))
    check_tiling(windows, x)
    assert len(windows) >= 3
    for window in windows[:-1]:
        start = round(window.start * SR)
        cut = round(window.end * SR)
        region = frame_power(x[start + MAX - SEARCH : start + MAX])
        assert power_at(x, cut) <= np.percentile(region, 20), (
            f"cut at {window.end:.2f} s is not in a quiet spot of {window.start + 24:.0f}-"
            f"{window.start + 30:.0f} s"
        )


# --- memory stays bounded on long input ---------------------------------------------------

PEAK_BOUND_MB = 100  # a whole hour at 16 kHz float32 alone is 220 MiB; at 24 kHz, 330 MiB

MEASURE = """
import json, resource, sys
from whisper_cli.audio import SAMPLE_RATE, open_audio
from whisper_cli.windows import cut_windows

def peak_mib():  # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20

def run(path):
    lengths = [len(w.audio) for w in cut_windows(open_audio(path).blocks())]
    return lengths

run(sys.argv[2])  # warm up: libraries and first-use buffers are not what is measured
baseline = peak_mib()
lengths = run(sys.argv[1])
print(json.dumps({"extra_peak_mib": peak_mib() - baseline, "lengths": lengths}))
"""


def write_long_flac(path: Path, seconds: int, rate: int = 24000) -> None:
    """Tone bursts with pauses and a little noise, written 10 s at a time (small in memory)."""
    rng = np.random.default_rng(7)
    t = np.arange(10 * rate) / rate
    voice = 0.2 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 360 * t + 1)
    gate = np.sin(2 * np.pi * 0.35 * t) > -0.3  # ~1 s pauses every ~3 s
    pattern = (voice * gate + 5e-4 * rng.standard_normal(len(t))).astype(np.float32)
    with sf.SoundFile(path, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds // 10):
            f.write(pattern)


def test_one_hour_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    pytest.importorskip("resource")
    hour, warmup = tmp_path / "hour.flac", tmp_path / "minute.flac"
    write_long_flac(hour, 3600)
    write_long_flac(warmup, 60)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(hour), str(warmup)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    hour.unlink()  # 75 MB; pytest keeps recent tmp dirs
    report = json.loads(result.stdout)
    lengths = report["lengths"]
    assert sum(lengths) == 3600 * SR  # 24 kHz -> 16 kHz, every sample accounted for
    assert max(lengths) <= MAX and min(lengths[:-1]) >= MAX - SEARCH
    assert report["extra_peak_mib"] < PEAK_BOUND_MB, report["extra_peak_mib"]
