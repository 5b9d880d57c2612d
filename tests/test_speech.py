"""The speech detector and the speech map: parity with Silero's own model, offline loading,
threads, and what the map decides on real speech and generated non-speech."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from test_longform import BASIC, clip, english, split_licence, wer
from typer.testing import CliRunner
from util import REPO, real_model, shared_clip

from whisper_cli.audio import SAMPLE_RATE, load_audio
from whisper_cli.cli import app
from whisper_cli.options import Policy
from whisper_cli.speech import (
    FRAME_SAMPLES,
    LevelGain,
    QuietSection,
    SpeechStream,
    dft_window,
    load_detector,
    silero_archive_path,
)
from whisper_cli.windows import level_gain, speech_stream

RATE = SAMPLE_RATE
JFK = (
    "And so my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country."
)


def dbfs(level: float) -> float:
    return 10 ** (level / 20)


def white(seconds: float, level_dbfs: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (dbfs(level_dbfs) * rng.standard_normal(round(seconds * RATE))).astype(np.float32)


def brown(seconds: float, level_dbfs: float, seed: int = 1) -> np.ndarray:
    """Brown (1/f^2) noise: integrated white noise, high-passed at 20 Hz against drift."""
    x = np.cumsum(np.random.default_rng(seed).standard_normal(round(seconds * RATE)))
    x -= np.convolve(x, np.ones(800) / 800, mode="same")
    return (x / np.sqrt(np.mean(x**2)) * dbfs(level_dbfs)).astype(np.float32)


def tones(seconds: float, freqs: tuple[float, ...], level: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    x = sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs)
    return (level * x).astype(np.float32)


def music(seconds: float) -> np.ndarray:
    """Chords of a few harmonics, changing every half second, with soft attacks."""
    chords = [(261.6, 329.6, 392.0), (220.0, 277.2, 329.6), (196.0, 246.9, 293.7)]
    beat = round(0.5 * RATE)
    parts = []
    for i in range(round(seconds / 0.5)):
        t = np.arange(beat) / RATE
        chord = chords[i % len(chords)]
        x = sum(np.sin(2 * np.pi * f * k * t) / k for f in chord for k in (1, 2, 3))
        parts.append(x * np.minimum(1.0, t / 0.02) * np.exp(-2 * t))
    x = np.concatenate(parts)
    return (0.2 * x / np.abs(x).max()).astype(np.float32)


# --- the detector ---------------------------------------------------------------------------


def test_detector_matches_silero_per_frame_whatever_the_blocks() -> None:
    """Our module over the wheel's weights equals the wheel's own (TorchScript) model."""
    audio = np.concatenate([load_audio(shared_clip("jfk.flac")), white(3.0, -30), music(3.0)])
    threads = torch.get_num_threads()
    silero = torch.jit.load(str(silero_archive_path()), map_location="cpu")
    silero.reset_states()
    reference = []
    for i in range(0, len(audio), FRAME_SAMPLES):
        frame = torch.from_numpy(audio[i : i + FRAME_SAMPLES])
        frame = torch.nn.functional.pad(frame, (0, FRAME_SAMPLES - len(frame)))
        reference.append(silero(frame[None], RATE).item())
    stream = SpeechStream(load_detector())
    rng, i = np.random.default_rng(0), 0
    while i < len(audio):
        n = int(rng.integers(1, 50_000))
        stream.push(audio[i : i + n])
        i += n
    stream.finish()
    ours = stream.map()
    assert len(ours) == len(reference) == -(-len(audio) // FRAME_SAMPLES)
    assert np.abs(ours - np.array(reference)).max() <= 1e-4
    jfk_frames = 11 * RATE // FRAME_SAMPLES
    assert (ours[:jfk_frames] > 0.5).mean() > 0.5  # the speech is heard
    assert (ours[jfk_frames + 10 :] < 0.5).mean() > 0.95  # the noise and music are not
    assert torch.get_num_threads() == threads


def test_the_detectors_gain_lifts_only_what_has_been_quiet() -> None:
    """LevelGain: 1 for frames of an input that has held the target level; a quiet one
    brought up to it, by at most the maximum; a click (one loud frame) neither sets the
    gain of what follows nor is itself lifted past the target; digital silence at the
    maximum (it stays zeros)."""
    target, most = dbfs(-30), dbfs(50)
    gain = LevelGain(target, most)
    loud = gain.of(np.array([0.5, 0.4, 0.3, 0.01, 0.001], np.float32))
    # Frames 0-1 have no held level yet: their own peak (above the target) gives 1.
    assert loud.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    quiet = LevelGain(target, most)
    g = quiet.of(np.full(6, dbfs(-60), np.float32))
    np.testing.assert_allclose(g, dbfs(30), rtol=1e-5)  # -60 dBFS brought to -30
    click = quiet.of(np.array([0.9, dbfs(-60), dbfs(-60)], np.float32))
    assert click[0] == pytest.approx(1.0)  # its own peak is above the target: not lifted
    np.testing.assert_allclose(click[1:], dbfs(30), rtol=1e-5)  # the click held no level
    held = quiet.of(np.full(4, dbfs(-40), np.float32))
    np.testing.assert_allclose(held[2:], dbfs(10), rtol=1e-5)  # -40 held 3 frames: -30
    np.testing.assert_allclose(quiet.of(np.full(2, dbfs(-60), np.float32)), dbfs(10), rtol=1e-5)
    silent = LevelGain(target, most).of(np.zeros(4, np.float32))
    np.testing.assert_allclose(silent, most, rtol=1e-6)
    deep = LevelGain(target, most).of(np.full(4, dbfs(-90), np.float32))
    np.testing.assert_allclose(deep, most, rtol=1e-6)  # capped: -90 brought to -40 only


def map_in_blocks(stream: SpeechStream, audio: np.ndarray, blocks: int | None) -> np.ndarray:
    """The stream's map of `audio` pushed whole (None) or in random blocks under `blocks`."""
    rng, i = np.random.default_rng(0), 0
    while i < len(audio):
        n = len(audio) if blocks is None else int(rng.integers(1, blocks))
        stream.push(audio[i : i + n])
        i += n
    stream.finish()
    return stream.map()


def test_a_quiet_inputs_map_is_its_loud_copys_whatever_the_blocks() -> None:
    """With the policy's gain, jfk.flac 40 dB down maps nearly as it does at its own level
    (the frames called speech by 0.5: nine in ten of its own found, few more added; the
    detector's scores move with the level even above the target), and the map is the same
    in any blocks. Without the gain, the quiet copy's speech is mostly missed."""
    policy = Policy()
    detector = load_detector()
    jfk = load_audio(shared_clip("jfk.flac"))
    quiet = (jfk * dbfs(-40)).astype(np.float32)

    def mapped(audio: np.ndarray, gain: bool, blocks: int | None = None) -> np.ndarray:
        stream = SpeechStream(detector, level_gain(policy) if gain else None)
        return map_in_blocks(stream, audio, blocks)

    own, lifted = mapped(jfk, True) >= 0.5, mapped(quiet, True) >= 0.5
    assert (own & lifted).sum() >= 0.9 * own.sum(), (own.sum(), lifted.sum())
    assert (lifted & ~own).sum() <= 0.05 * own.sum(), (own.sum(), lifted.sum())
    # The gains are the same in any blocks; the detector's own sums are to 1e-7 (as above).
    assert np.abs(mapped(quiet, True, blocks=20_000) - mapped(quiet, True)).max() <= 1e-5
    unlifted = mapped(quiet, False) >= 0.5
    assert unlifted.sum() < 0.5 * own.sum()


def test_a_quiet_section_opens_only_at_a_sound_far_below_the_loudest_after_a_while() -> None:
    """QuietSection (20 dB, 4 frames, 10 dB over the room): loud frames, then a pause of
    room noise opens nothing (not over the room), nor does speech at the loud level after
    it; a sound 30 dB under the loudest after the hold opens a section, once, which
    closes where the input is within 20 dB of its loudest again."""
    quiet = QuietSection.from_db(20.0, 4 * FRAME_SAMPLES / RATE, 10.0)
    loud, room, soft = dbfs(-3), dbfs(-70), dbfs(-33)
    inside, opens = quiet.of(np.array([loud] * 5 + [room] * 8 + [loud] * 4, np.float32))
    assert not inside.any() and not opens.any()
    inside, opens = quiet.of(np.array([room] * 8 + [soft] * 6 + [loud] * 4, np.float32))
    # The soft sound is held from its third frame (a level lasts SUSTAIN_FRAMES frames).
    assert np.flatnonzero(opens).tolist() == [10]
    assert inside.tolist() == [False] * 10 + [True] * 4 + [True] * 2 + [False] * 2
    # A soft sound too soon after the loud level (under the hold) opens nothing.
    fresh = QuietSection.from_db(20.0, 4 * FRAME_SAMPLES / RATE, 10.0)
    inside, _ = fresh.of(np.array([loud] * 5 + [soft] * 4, np.float32))
    assert not inside.any()


def chord_then(speech: np.ndarray, lead: np.ndarray | None = None) -> np.ndarray:
    """6 s of a chord at -1 dBFS (or `lead` brought there), 1 s of silence, then speech."""
    lead = tones(6.0, (261.6, 329.6, 392.0, 523.3)) if lead is None else lead
    lead = lead / np.abs(lead).max() * dbfs(-1)
    return np.concatenate([lead, np.zeros(RATE, np.float32), speech]).astype(np.float32)


def test_quiet_speech_after_a_loud_chord_is_mapped_as_alone_whatever_the_blocks() -> None:
    """jfk.flac at -45 dBFS 1 s after a chord at -1 dBFS: the policy's map finds nine in
    ten of the speech frames it finds in jfk alone at that level, as it does in any
    blocks; without the quiet section heard again, fewer than one in ten (the detector's
    state remembers the chord, and the gain follows it). jfk alone maps as before."""
    policy = Policy()
    detector = load_detector()
    jfk = load_audio(shared_clip("jfk.flac"))
    quiet = (jfk / np.abs(jfk).max() * dbfs(-45)).astype(np.float32)
    after = chord_then(quiet)

    def mapped(audio: np.ndarray, again: bool = True, blocks: int | None = None) -> np.ndarray:
        stream = speech_stream(detector, policy)
        if not again:
            stream.quiet = None
        return map_in_blocks(stream, audio, blocks)

    alone = mapped(quiet) >= 0.5
    found = mapped(after)[-len(alone) :] >= 0.5
    assert (alone & found).sum() >= 0.9 * alone.sum(), (alone.sum(), found.sum())
    assert (found & ~alone).sum() <= 0.05 * alone.sum(), (alone.sum(), found.sum())
    assert np.abs(mapped(after, blocks=20_000) - mapped(after)).max() <= 1e-5
    missed = mapped(after, again=False)[-len(alone) :] >= 0.5
    assert (alone & missed).sum() < 0.1 * alone.sum()
    np.testing.assert_array_equal(mapped(quiet), mapped(quiet, again=False))


def test_the_stft_runs_as_an_fft_only_where_the_filters_are_a_windowed_dft() -> None:
    """The wheel's STFT filters are a periodic-Hann-windowed DFT, so the detector takes
    their magnitudes by FFT; its speech probabilities are the filters' GEMM's to 1e-5 on
    speech, noise and music. Filters that are not one keep the GEMM."""
    detector = load_detector()
    window = detector.dft_window
    assert window is not None
    torch.testing.assert_close(window, torch.hann_window(256), rtol=0, atol=1e-6)
    audio = np.concatenate([load_audio(shared_clip("jfk.flac")), white(3.0, -30), music(3.0)])
    fft = SpeechStream(detector)
    fft.push(audio)
    fft.finish()
    detector.dft_window = None
    gemm = SpeechStream(detector)
    gemm.push(audio)
    gemm.finish()
    assert np.abs(fft.map() - gemm.map()).max() <= 1e-5
    filters = detector.stft_conv.weight.clone()
    filters[5, 0, 17] += 1e-3  # one coefficient off
    assert dft_window(filters) is None
    assert dft_window(filters[:200]) is None  # not 2 x (256 / 2 + 1) filters


def test_detector_loads_offline_from_the_wheel_without_changing_threads(tmp_path) -> None:
    """In a fresh process with no network: silero_vad is never imported (it would set
    torch's threads to 1), and a whole run leaves the thread count as it was."""
    path = tmp_path / "jfk.wav"
    sf.write(path, load_audio(shared_clip("jfk.flac")), RATE)
    code = f"""
import json, sys, torch
torch.set_num_threads(2)
from whisper_cli.dtypes import resolve_policy
from whisper_cli.loading import load_model
from whisper_cli.pipeline import TranscribeOptions, Transcriber
t = Transcriber(load_model({str(real_model("tiny.en"))!r}, resolve_policy("f32", "cpu")),
                TranscribeOptions())
text = t.transcribe({str(path)!r}).text
print(json.dumps({{"threads": torch.get_num_threads(), "text": text,
                  "silero_imported": "silero_vad" in sys.modules}}))
"""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "HTTPS_PROXY": "http://127.0.0.1:9",  # any network use fails at once
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert (report["threads"], report["silero_imported"]) == (2, False)
    # The run transcribed the speech: its text against what was said.
    assert wer(JFK, report["text"]) <= 0.1, report["text"]


# --- non-speech gives no text -----------------------------------------------------------------

NON_SPEECH = {
    "silence": lambda: np.zeros(60 * RATE, np.float32),
    "white noise -30 dBFS": lambda: white(60.0, -30),
    "brown noise -26 dBFS": lambda: brown(60.0, -26),
    "440 Hz tone": lambda: tones(60.0, (440.0,)),
    "chord": lambda: tones(60.0, (261.6, 329.6, 392.0, 523.3)),
    # Quiet ones, which the detector hears brought up by its gain (LevelGain):
    "white noise -70 dBFS": lambda: white(60.0, -70),
    "chord 50 dB down": lambda: tones(60.0, (261.6, 329.6, 392.0, 523.3), 0.3 * dbfs(-50)),
    "music 40 dB down": lambda: music(60.0) * dbfs(-40),
    "16-bit silence, dithered": lambda: dithered_silence(60.0),
}


def dithered_silence(seconds: float, seed: int = 2) -> np.ndarray:
    """What a 16-bit export of silence holds: triangular dither of +-1 step."""
    rng = np.random.default_rng(seed)
    n = round(seconds * RATE)
    return ((rng.integers(0, 2, n) - rng.integers(0, 2, n)) / 32767).astype(np.float32)


@pytest.mark.usefixtures("cached_cli_models")
@pytest.mark.parametrize("model", ["tiny.en", "base"])
@pytest.mark.parametrize("kind", list(NON_SPEECH))
def test_non_speech_gives_no_text(tmp_path, kind: str, model: str) -> None:
    path = tmp_path / "signal.wav"
    sf.write(path, NON_SPEECH[kind](), RATE, subtype="FLOAT")
    args = ["transcribe", str(path), "--model", str(real_model(model)), "-f", "json", "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    data = json.loads(result.stdout)
    assert data["text"] == "" and data["segments"] == [], data["segments"]
    assert data["duration"] == pytest.approx(60.0)


# --- speech behind noise and after silence ----------------------------------------------------


def onset(audio: np.ndarray) -> float:
    """Seconds to the first 20 ms frame within 20 dB of the clip's loud level (energy only,
    independent of the detector)."""
    hop = RATE // 50
    power = np.mean(audio[: len(audio) // hop * hop].reshape(-1, hop) ** 2, axis=1)
    level = 10 * np.log10(power + 1e-12)
    return float(np.flatnonzero(level > np.percentile(level, 95) - 20)[0] * hop / RATE)


@pytest.mark.parametrize("model", ["tiny_en", "base_model"])
def test_speech_behind_noise_and_after_silence_is_timed_and_nothing_invented(
    model: str, tmp_path, transcriber, request
) -> None:
    jfk = load_audio(shared_clip("jfk.flac"))
    audio = np.concatenate([white(30.0, -30), jfk, np.zeros(20 * RATE, np.float32), jfk])
    path = tmp_path / "noise_jfk_silence_jfk.wav"
    sf.write(path, audio, RATE, subtype="FLOAT")
    loaded = request.getfixturevalue(model)
    on, off = transcriber(loaded), transcriber(loaded, vad=False)
    result = on.transcribe(str(path))
    print({s.start: s.text for s in result.segments})
    assert wer(JFK + " " + JFK, result.text) <= 0.1
    assert english(result.text).count("ask not what your country") == 2
    second = 30.0 + len(jfk) / RATE + 20.0
    for speech_start in (30.0 + onset(jfk), second + onset(jfk)):
        first = min(
            (s for s in result.segments if s.start >= speech_start - 1.5), key=lambda s: s.start
        )
        assert abs(first.start - speech_start) <= 0.7, (first.start, speech_start)
    off.transcribe(str(path))
    assert on.engine.counters.encoded_rows < off.engine.counters.encoded_rows


# --- language from speech, not from what comes first -------------------------------------------


def test_music_intro_does_not_decide_the_language(tmp_path, transcriber, base_model) -> None:
    audio = load_audio(shared_clip("multilingual.mp3"))
    german = audio[round(29.5 * RATE) :]
    path = tmp_path / "music_then_german.wav"
    sf.write(path, np.concatenate([music(20.0), german]), RATE, subtype="FLOAT")
    result = transcriber(base_model).transcribe(str(path))
    assert result.language == "de"
    german_ref = split_licence(clip("multilingual.mp3")["reference"])[1]
    assert wer(german_ref, result.text, BASIC) <= 0.5


@pytest.mark.slow
def test_every_stretch_of_speech_has_text(transcriber, base_model) -> None:
    """multilingual.mp3, language detected once (English): the German half still gets text
    wherever the map hears speech; no stretch of 10 s of speech is left empty."""
    from whisper_cli.options import Policy
    from whisper_cli.windows import WindowCutter

    path = shared_clip("multilingual.mp3")
    result = transcriber(base_model).transcribe(str(path))
    assert result.language == "en"
    cutter = WindowCutter(load_detector(), Policy())
    list(cutter.cut([load_audio(path)]))
    speech = cutter.speech_map >= Policy().vad_threshold
    frame = FRAME_SAMPLES / RATE
    for start in np.arange(0.0, result.duration - 10.0, 5.0):
        a, b = round(start / frame), round((start + 10.0) / frame)
        if speech[a:b].mean() < 0.5:
            continue
        covered = [s for s in result.segments if s.end > start and s.start < start + 10.0]
        assert any(s.text.strip() for s in covered), f"no text in {start:.0f}-{start + 10:.0f} s"
