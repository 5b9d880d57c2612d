"""Windows from the speech map (whisper_cli.windows), on planted maps and on real speech.

Most tests plant the map: a stand-in detector scores each 32 ms frame with the mean of
its samples, so a signal of constant values per frame *is* its speech map. That tests the
cutter's rules exactly; the real detector is tested in test_speech.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from util import REPO

from whisper_cli.options import Policy
from whisper_cli.speech import CONTEXT_SAMPLES, FRAME_SAMPLES
from whisper_cli.windows import Window, WindowCutter, cut_windows

SR = 16000
F = FRAME_SAMPLES  # 512 samples, 32 ms
MAX_FRAMES = 937  # the most 32 ms frames in 30 s
POLICY = Policy()


class PlantedMap(torch.nn.Module):
    """A detector whose P(speech) of a frame is the mean of the frame's own samples."""

    def forward(self, frames: torch.Tensor, state=None):
        return frames[:, CONTEXT_SAMPLES:].mean(dim=1), state


DETECTOR = PlantedMap()


def planted(*runs: tuple[float, float]) -> np.ndarray:
    """A signal of (seconds, probability) runs, each rounded to whole frames."""
    return np.concatenate([np.full(round(s * SR / F) * F, p, np.float32) for s, p in runs])


def random_blocks(x: np.ndarray, rng: np.random.Generator, largest: int) -> Iterator[np.ndarray]:
    """x in blocks of random sizes (empty blocks included) that together are exactly x."""
    start = 0
    while start < len(x):
        size = int(rng.integers(0, largest))
        yield x[start : start + size]
        start += size


def cut(x: np.ndarray, seed: int = 0, largest: int = 100_000, **kwargs) -> list[Window]:
    blocks = random_blocks(x, np.random.default_rng(seed), largest)
    return list(cut_windows(blocks, DETECTOR, POLICY, **kwargs))


def check_window(w: Window, x: np.ndarray) -> None:
    a = w.first_sample
    np.testing.assert_array_equal(w.audio, x[a : a + len(w.audio)])  # one stretch of input
    assert 0 < len(w.audio) <= 30 * SR
    assert len(w.speech) == -(-len(w.audio) // F)


# --- with the detector on -------------------------------------------------------------------


def test_a_window_opens_a_lead_before_speech_and_closes_a_tail_after_it() -> None:
    x = planted((10.0, 0.0), (5.0, 0.9), (10.0, 0.0))
    (w,) = cut(x)
    check_window(w, x)
    assert w.start == pytest.approx(10.0 - POLICY.speech_lead_seconds, abs=0.05)
    assert w.end == pytest.approx(15.0 + POLICY.speech_tail_seconds, abs=0.05)
    assert w.speech_seconds == pytest.approx(5.0, abs=0.04)


@pytest.mark.parametrize("largest", [50, 4000, 200_000, 2_000_000])
def test_windows_hold_every_speech_frame_and_no_long_non_speech(largest: int) -> None:
    rng = np.random.default_rng(largest)
    runs = []
    for _ in range(40):  # utterances of 0.3-12 s between pauses of 0.1-25 s
        runs += [(float(rng.uniform(0.1, 25.0)), 0.02), (float(rng.uniform(0.3, 12.0)), 0.95)]
    x = planted(*runs, (1.0, 0.0))
    windows = cut(x, seed=largest, largest=largest)
    speech = np.zeros(len(x) // F, bool)
    covered = np.zeros(len(x) // F, bool)
    previous_end = 0
    for i, w in enumerate(windows):
        check_window(w, x)
        assert (w.source, w.index) == (0, i)
        assert w.first_sample >= previous_end  # in order, no overlap
        previous_end = w.first_sample + len(w.audio)
        first = w.first_sample // F
        covered[first : first + len(w.speech)] = True
        speech[first : first + len(w.speech)] |= w.speech
        # It opens within the pad before its first speech frame.
        assert np.flatnonzero(w.speech)[0] <= round(POLICY.speech_lead_seconds * SR / F)
    truth = x[: len(x) // F * F].reshape(-1, F)[:, 0] >= POLICY.vad_threshold
    assert covered[truth].all()  # no speech frame left out of the windows
    np.testing.assert_array_equal(speech, truth)  # the windows' maps are the input's
    assert covered.mean() < 0.75  # long pauses are not decoded


def test_a_pause_shorter_than_min_silence_stays_inside_one_piece() -> None:
    x = planted((1.0, 0.0), (3.0, 0.9), (1.5, 0.0), (3.0, 0.9), (1.0, 0.0))
    (w,) = cut(x)
    assert w.end - w.start == pytest.approx(
        7.5 + POLICY.speech_lead_seconds + POLICY.speech_tail_seconds, abs=0.05
    )


def test_a_long_silence_between_utterances_makes_two_windows() -> None:
    # 10 s + 20 s of silence + 10 s: together more than 30 s, so each opens its own window.
    x = planted((1.0, 0.0), (10.0, 0.9), (20.0, 0.0), (10.0, 0.9), (1.0, 0.0))
    first, second = cut(x)
    assert first.end == pytest.approx(11.0 + POLICY.speech_tail_seconds, abs=0.05)
    assert second.start == pytest.approx(31.0 - POLICY.speech_lead_seconds, abs=0.05)


def test_utterances_that_fit_share_a_window_with_the_pause_between() -> None:
    x = planted((1.0, 0.0), (5.0, 0.9), (10.0, 0.0), (5.0, 0.9), (1.0, 0.0))
    (w,) = cut(x)
    assert w.speech_seconds == pytest.approx(10.0, abs=0.07)
    assert w.speech[len(w.speech) // 2] == False  # noqa: E712 - the pause is kept as it is


def test_hysteresis_and_minimum_speech() -> None:
    # 0.4 never starts speech, but continues it (>= 0.35); 0.16 s of speech that never
    # scores the short-speech threshold is a click.
    click = (POLICY.vad_threshold + POLICY.short_speech_threshold) / 2
    x = planted((1.0, 0.0), (2.0, 0.4), (1.0, 0.0), (0.16, click), (3.0, 0.0))
    assert cut(x) == []
    x = planted((1.0, 0.0), (1.0, 0.9), (2.0, 0.4), (3.0, 0.0))
    (w,) = cut(x)
    assert w.speech_seconds == pytest.approx(3.0, abs=0.04)


def test_a_short_stretch_that_scores_high_is_a_word() -> None:
    """0.16 s above the short-speech threshold (a clear "yes") opens a window, padded."""
    x = planted((20.0, 0.0), (0.16, 0.99), (3.0, 0.0))
    (w,) = cut(x)
    assert w.start == pytest.approx(20.0 - POLICY.speech_lead_seconds, abs=0.04)
    assert w.end == pytest.approx(20.16 + POLICY.speech_tail_seconds, abs=0.04)
    assert w.speech_seconds == pytest.approx(0.16, abs=0.04)


def test_no_speech_at_all_gives_no_window_and_counts_every_sample() -> None:
    x = planted((61.0, 0.1))
    cutter = WindowCutter(DETECTOR, POLICY)
    assert list(cutter.cut([x[:100_000], x[100_000:]])) == []
    assert cutter.samples == len(x)
    assert len(cutter.speech_map) == len(x) // F


@pytest.mark.parametrize("dip_at", [24.5, 26.0, 29.0])
def test_speech_longer_than_a_window_is_cut_at_its_least_speech_like_frame(dip_at) -> None:
    # A planted dip (a short pause the map still calls speech) in 70 s of speech.
    x = planted((dip_at, 0.9), (0.1, 0.4), (70.0 - dip_at, 0.9))
    windows = cut(x)
    assert windows[0].start == 0.0 and windows[0].end == pytest.approx(dip_at + 0.05, abs=0.05)
    assert all(w.duration <= 30.0 for w in windows)
    assert windows[1].first_sample == windows[0].first_sample + len(windows[0].audio)


def test_a_cut_goes_early_into_a_non_speech_run() -> None:
    # A 0.6 s pause (shorter than min_silence, so the stretch goes on) at 26 s: the cut is
    # a quarter into it, so the next window opens with most of the pause before its speech.
    x = planted((26.0, 0.9), (0.6, 0.1), (40.0, 0.9))
    first, second = cut(x)[:2]
    assert first.end == pytest.approx(26.15, abs=0.04)
    # It opens a lead before the speech, or at the cut if the lead reaches back past it.
    lead_start = max(first.end, 26.6 - POLICY.speech_lead_seconds)
    assert second.start == pytest.approx(lead_start, abs=0.04)


def test_a_window_whose_end_cut_its_speech_off_says_so() -> None:
    # Windows cut inside a stretch (70 s of speech, a 0.6 s pause at 26 s), and the last,
    # which the input's end cuts off 0.1 s after its speech, are cut off ...
    x = planted((26.0, 0.9), (0.6, 0.1), (40.0, 0.9), (0.1, 0.0))
    windows = cut(x)
    assert len(windows) == 3 and all(w.cut_off for w in windows)
    # ... a window closed a whole tail after its speech (the stretch ended), or by the
    # cutter's hold before a long pause, is not.
    x = planted((1.0, 0.0), (10.0, 0.9), (20.0, 0.0), (10.0, 0.9), (1.0, 0.0))
    assert [w.cut_off for w in cut(x)] == [False, False]
    x = planted((26.0, 0.9), (3.0, 0.1), (10.0, 0.9), (2.0, 0.0))
    assert [w.cut_off for w in cut(x)] == [False, False]
    # With the detector off nothing is judged by a map: no window is.
    assert not any(w.cut_off for w in cut(planted((70.0, 0.9)), vad=False))


def test_blocks_must_be_mono() -> None:
    with pytest.raises(ValueError, match="1-D"):
        next(cut_windows([np.zeros((100, 2), np.float32)], DETECTOR))


# --- with the detector off: windows tile the input -------------------------------------------


def test_thirty_seconds_is_one_window() -> None:
    for vad in (True, False):
        (w,) = cut(np.full(30 * SR, 0.9, np.float32), vad=vad)
        assert w.duration == 30.0


@pytest.mark.parametrize("seconds", [0.01, 0.5, 29.98, 30.0, 31.0, 125.3])
def test_detector_off_tiles_the_input_exactly(seconds: float) -> None:
    n = round(seconds * SR)
    x = np.random.default_rng(1).uniform(0, 0.3, n).astype(np.float32)  # never speech
    windows = cut(x, seed=3, largest=40_000, vad=False)
    np.testing.assert_array_equal(np.concatenate([w.audio for w in windows]), x)
    for a, b in itertools.pairwise(windows):
        assert b.first_sample == a.first_sample + len(a.audio)
        assert a.duration >= 30.0 - POLICY.cut_search_seconds - 0.04
    assert all(w.duration <= 30.0 for w in windows)
    assert len(windows) == 1 or n > MAX_FRAMES * F


def test_detector_off_still_cuts_where_the_map_is_least_speech_like() -> None:
    x = planted((27.0, 0.9), (0.5, 0.05), (20.0, 0.9))
    first, second = cut(x, vad=False)[:2]
    assert first.end == pytest.approx(27.12, abs=0.04)
    assert second.start == first.end  # tiling


# --- memory stays bounded on long input ---------------------------------------------------

PEAK_BOUND_MB = 100  # a whole hour at 16 kHz float32 alone is 220 MiB

MEASURE = """
import json, resource, sys
import numpy as np, torch
sys.path.insert(0, "tests")
from test_windows import DETECTOR
from whisper_cli.options import Policy
from whisper_cli.windows import cut_windows

def peak_mib():  # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20

def blocks(seconds):  # 8 s of speech, 4 s of pause, over and over, 30 s blocks
    one = np.concatenate([np.full(8 * 16000, 0.9, np.float32), np.zeros(4 * 16000, np.float32)])
    tile = np.tile(one, 5)[: 30 * 16000]
    for _ in range(seconds // 30):
        yield tile

def run(seconds, vad):
    return [len(w.audio) for w in cut_windows(blocks(seconds), DETECTOR, Policy(), vad=vad)]

run(60, True); run(60, False)  # warm up
baseline = peak_mib()
on, off = run(3600, True), run(3600, False)
print(json.dumps({"extra_peak_mib": peak_mib() - baseline, "on": on, "off": off}))
"""


def test_one_hour_streams_in_bounded_memory() -> None:
    pytest.importorskip("resource")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(result.stdout)
    assert sum(report["off"]) == 3600 * SR  # detector off: every sample, once
    assert max(report["on"] + report["off"]) <= 30 * SR
    # Detector on: all the speech (2/3 of the input), not the pauses between windows.
    assert 2 / 3 * 3600 * SR < sum(report["on"]) < 0.95 * 3600 * SR
    assert report["extra_peak_mib"] < PEAK_BOUND_MB, report["extra_peak_mib"]
