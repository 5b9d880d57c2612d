"""Tests for the audio front end (whisper_cli.audio): decoding, mixing, resampling, errors."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import soxr
from util import REPO, shared_clip

from whisper_cli import audio
from whisper_cli.audio import SAMPLE_RATE, AudioInfo, load_audio, open_audio
from whisper_cli.errors import DecoderMessage, InputError, WhisperCliError, WhisperCliWarning

# --- helpers ------------------------------------------------------------------------------


def tone(seconds: float, rate: int, channels: int = 1, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * freq * t)
    return np.stack([x * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def encode_with_av(samples: np.ndarray, rate: int, path: Path, codec: str, out_rate: int) -> Path:
    """Encode (frames, channels) float samples with FFmpeg, e.g. AAC in .m4a or Opus in .webm."""
    layout = "stereo" if samples.shape[1] == 2 else "mono"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=out_rate, layout=layout)
        to_codec = av.AudioResampler(stream.codec_context.format.name, layout, out_rate)
        frames = []
        for start in range(0, len(samples), 4096):
            block = np.ascontiguousarray(samples[start : start + 4096].T)
            frame = av.AudioFrame.from_ndarray(block, format="fltp", layout=layout)
            frame.sample_rate = rate
            frames += to_codec.resample(frame)
        frames += to_codec.resample(None)
        for frame in [*frames, None]:
            container.mux(stream.encode(frame))
    return path


def aligned_correlation(a: np.ndarray, b: np.ndarray, max_lag: int = 3200) -> float:
    """Pearson correlation of a and b at the lag that best aligns them (codec delays)."""
    n = min(len(a), len(b))
    a, b = a[:n] - a[:n].mean(), b[:n] - b[:n].mean()
    size = 1 << (2 * n - 1).bit_length()
    xcorr = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)
    lags = np.r_[0 : max_lag + 1, -max_lag:0]
    lag = int(lags[np.argmax(xcorr[lags])])
    a, b = (a[lag:], b[: n - lag]) if lag >= 0 else (a[: n + lag], b[-lag:])
    return float(np.corrcoef(a, b)[0, 1])


def decode_all(source: audio.AudioSource, block_seconds: float = 30.0) -> np.ndarray:
    return np.concatenate(list(source.blocks(block_seconds)))


# --- decoding the real clips --------------------------------------------------------------


def test_flac_44k_stereo_24bit_becomes_16k_mono() -> None:
    source = open_audio(shared_clip("jfk.flac"))
    assert source.backend == "soundfile"
    assert source.info == AudioInfo(str(shared_clip("jfk.flac")), 11.0, 44100, 2)
    x = load_audio(shared_clip("jfk.flac"))
    assert x.dtype == np.float32 and x.ndim == 1
    assert len(x) == 11 * SAMPLE_RATE
    assert 0.05 < np.abs(x).max() <= 1.0  # speech, in range
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.info.duration = 1.0  # type: ignore[misc]


def test_stereo_channels_are_selected_or_mixed() -> None:
    path = shared_clip("stereo_diarization.wav")
    left, right, mixed = (load_audio(path, c) for c in ("left", "right", None))
    native, rate = sf.read(path, dtype="float32")
    assert rate == SAMPLE_RATE  # no resampling: samples come through untouched
    np.testing.assert_array_equal(left, native[:, 0])
    np.testing.assert_array_equal(right, native[:, 1])
    np.testing.assert_allclose(mixed, (left + right) / 2, atol=1e-7)
    assert abs(np.corrcoef(left, right)[0, 1]) < 0.3  # a different speaker on each side
    np.testing.assert_array_equal(load_audio(path, 0), left)
    np.testing.assert_array_equal(load_audio(path, "1"), right)


@pytest.mark.parametrize(("name", "rate", "seconds"), [("multilingual.mp3", 24000, 59.9)])
def test_mp3_decodes_through_soundfile(name: str, rate: int, seconds: float) -> None:
    source = open_audio(shared_clip(name))
    assert source.backend == "soundfile"
    assert (source.info.sample_rate, source.info.channels) == (rate, 1)
    assert source.info.duration == pytest.approx(seconds, abs=0.05)
    x = decode_all(source)
    assert len(x) / SAMPLE_RATE == pytest.approx(seconds, abs=0.05)


def test_stereo_mp3_is_mixed_down() -> None:
    source = open_audio(shared_clip("hotwords.mp3"))
    assert (source.backend, source.info.sample_rate, source.info.channels) == (
        "soundfile",
        44100,
        2,
    )
    assert len(decode_all(source)) / SAMPLE_RATE == pytest.approx(4.0, abs=0.05)


@pytest.mark.parametrize("subtype", ["VORBIS", "OPUS"])
def test_ogg_decodes_through_soundfile(tmp_path: Path, subtype: str) -> None:
    samples, rate = sf.read(shared_clip("stereo_diarization.wav"), dtype="float32")
    path = tmp_path / f"clip_{subtype.lower()}.ogg"
    sf.write(path, samples, rate, format="OGG", subtype=subtype)
    source = open_audio(path)
    assert (source.backend, source.info.channels, source.info.duration) == ("soundfile", 2, 5.0)
    x = decode_all(source)
    assert len(x) == 5 * SAMPLE_RATE
    assert aligned_correlation(x, samples.mean(axis=1)) > 0.95


def test_blocks_have_the_requested_size_and_equal_one_whole_resample() -> None:
    path = shared_clip("jfk.flac")
    blocks = list(open_audio(path).blocks(block_seconds=0.77))
    size = round(0.77 * SAMPLE_RATE)
    assert all(len(b) == size for b in blocks[:-1]) and 0 < len(blocks[-1]) <= size
    native, rate = sf.read(path, dtype="float32")
    whole = soxr.resample(native.mean(axis=1, dtype=np.float32), rate, SAMPLE_RATE, "HQ")
    np.testing.assert_allclose(np.concatenate(blocks), whole, atol=1e-6, rtol=0)


def test_streamed_resampling_is_seamless_across_read_blocks(tmp_path: Path) -> None:
    # A 12 s chirp at 44.1 kHz spans three internal 5 s reads; any discontinuity or state
    # reset at a read boundary would show as a difference from the one-shot resample.
    rate = 44100
    t = np.arange(12 * rate) / rate
    chirp = (0.5 * np.sin(2 * np.pi * (100 + 300 * t) * t)).astype(np.float32)
    path = tmp_path / "chirp.wav"
    sf.write(path, chirp, rate, subtype="FLOAT")
    streamed = decode_all(open_audio(path), block_seconds=1.3)
    whole = soxr.resample(chirp, rate, SAMPLE_RATE, "HQ")
    assert len(streamed) == len(whole) == 12 * SAMPLE_RATE
    np.testing.assert_allclose(streamed, whole, atol=1e-6, rtol=0)


def test_blocks_can_be_read_again() -> None:
    source = open_audio(shared_clip("stereo_diarization.wav"))
    np.testing.assert_array_equal(decode_all(source), decode_all(source, 2.0))


# --- formats only FFmpeg reads ------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "codec", "rate"), [(".m4a", "aac", 44100), (".webm", "libopus", 48000)]
)
def test_av_formats_decode_like_soundfile(tmp_path: Path, suffix: str, codec: str, rate: int):
    samples, native_rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    path = encode_with_av(samples, native_rate, tmp_path / f"jfk{suffix}", codec, rate)
    with pytest.raises(sf.LibsndfileError):
        sf.info(path)  # so this really is the FFmpeg path
    source = open_audio(path)
    assert source.backend == "av"
    assert (source.info.sample_rate, source.info.channels) == (rate, 2)
    assert source.info.duration == pytest.approx(11.0, abs=0.1)
    x = decode_all(source)
    assert x.dtype == np.float32 and len(x) / SAMPLE_RATE == pytest.approx(11.0, abs=0.1)
    assert aligned_correlation(x, load_audio(shared_clip("jfk.flac"))) > 0.95
    left = decode_all(open_audio(path, "left"))
    assert aligned_correlation(left, load_audio(shared_clip("jfk.flac"), "left")) > 0.95


def test_av_is_imported_only_when_needed(tmp_path: Path) -> None:
    path = tmp_path / "tone.flac"
    sf.write(path, tone(1.0, 22050), 22050)
    code = (
        "import sys; from whisper_cli.audio import load_audio; "
        f"assert len(load_audio({str(path)!r})) == 16000; "
        "assert 'av' not in sys.modules, 'PyAV was imported for a FLAC file'"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# --- stdin and pipes ----------------------------------------------------------------------


def test_stdin_whole_file_format() -> None:
    data = shared_clip("jfk.flac").read_bytes()
    source = open_audio("-", stdin=io.BytesIO(data))
    assert (source.info.path, source.backend, source.info.duration) == ("-", "soundfile", 11.0)
    np.testing.assert_array_equal(decode_all(source), load_audio(shared_clip("jfk.flac")))


def test_stdin_ffmpeg_format(tmp_path: Path) -> None:
    samples, rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    path = encode_with_av(samples, rate, tmp_path / "jfk.webm", "libopus", 48000)
    source = open_audio("-", stdin=io.BytesIO(path.read_bytes()))
    assert (source.info.path, source.backend) == ("-", "av")
    np.testing.assert_array_equal(decode_all(source), load_audio(path))


def test_stdin_defaults_to_the_process_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    data = shared_clip("stereo_diarization.wav").read_bytes()
    # Text-mode like the real sys.stdin: open_audio must read the bytes of .buffer.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert open_audio("-").info.duration == 5.0
    wrapper = io.TextIOWrapper(io.BytesIO(data))
    assert open_audio("-", stdin=wrapper).info.duration == 5.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need POSIX")
def test_named_pipe_is_read_like_stdin(tmp_path: Path) -> None:
    wav = tmp_path / "tone.wav"
    sf.write(wav, tone(1.0, 16000), 16000)
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(wav.read_bytes()), daemon=True)
    writer.start()
    source = open_audio(fifo)
    writer.join(timeout=10)
    np.testing.assert_array_equal(decode_all(source), load_audio(wav))


# --- errors: each problem is an InputError with a short, clear text -----------------------


def expect_input_error(path: str | Path, problem: str, **kwargs) -> InputError:
    with pytest.raises(InputError) as caught:
        open_audio(path, **kwargs)
    assert caught.value.path == str(path)
    assert caught.value.problem.startswith(problem), caught.value.problem
    assert caught.value.exit_code == 1
    return caught.value


def test_missing_file(tmp_path: Path) -> None:
    expect_input_error(tmp_path / "nope.wav", "no such file")


def test_directory(tmp_path: Path) -> None:
    expect_input_error(tmp_path, "is a directory")


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked.wav"
    sf.write(path, tone(1.0, 16000), 16000)
    path.chmod(0)
    if getattr(os, "geteuid", lambda: -1)() == 0:
        # root reads mode-000 files anyway; make audio's own open() fail as it would for a user.
        def denied(file, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(file))

        monkeypatch.setattr(audio, "open", denied, raising=False)
    expect_input_error(path, "permission denied")


def test_text_file_named_wav(tmp_path: Path) -> None:
    path = tmp_path / "notes.wav"
    path.write_text("these are meeting notes, not a recording\n" * 20)
    expect_input_error(path, "not an audio file (format not recognised)")


def test_flac_cut_inside_its_header_is_an_error(tmp_path: Path) -> None:
    whole = tmp_path / "whole.flac"
    sf.write(whole, tone(3.0, 44100, channels=2), 44100)
    data = whole.read_bytes()
    path = tmp_path / "cut.flac"
    path.write_bytes(data[: int(len(data) * 0.002)])  # nothing readable
    expect_input_error(path, "corrupt or truncated audio (")


def _cut_copies(tmp_path: Path) -> dict[str, tuple[Path, float]]:
    """Each format cut at half its bytes, with the seconds the whole file holds."""
    samples = tone(8.0, 44100, channels=2)
    whole = {
        "wav": tmp_path / "whole.wav",
        "flac": tmp_path / "whole.flac",
        "mp3": tmp_path / "whole.mp3",
    }
    for path in whole.values():
        sf.write(path, samples, 44100)
    # AAC with its index (moov) first, as streaming encoders and faststart write it.
    plain = encode_with_av(samples, 44100, tmp_path / "plain.m4a", "aac", 44100)
    whole["m4a"] = tmp_path / "whole.m4a"
    with (
        av.open(str(plain)) as src,
        av.open(str(whole["m4a"]), "w", options={"movflags": "faststart"}) as dst,
    ):
        stream = dst.add_stream_from_template(src.streams.audio[0])
        for packet in src.demux(src.streams.audio[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    cut = {}
    for fmt, path in whole.items():
        data = path.read_bytes()
        cut[fmt] = (tmp_path / f"cut.{fmt}", 8.0)
        cut[fmt][0].write_bytes(data[: len(data) // 2])
    return cut


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "m4a"])
def test_truncated_file_is_decoded_as_far_as_it_goes_with_one_warning(
    tmp_path: Path, fmt: str
) -> None:
    path, whole_seconds = _cut_copies(tmp_path)[fmt]
    with pytest.warns(WhisperCliWarning) as caught:
        x = load_audio(path)
    ours = [w for w in caught if not issubclass(w.category, DecoderMessage)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert message.startswith(f"{path}: truncated: the audio ends at ")
    assert f"of the {whole_seconds:.1f} s its header announces" in message
    # About half the audio is there (the cut is at half the bytes), and it is the tone.
    assert 0.35 * whole_seconds < len(x) / SAMPLE_RATE < 0.65 * whole_seconds
    assert np.abs(x[SAMPLE_RATE : 2 * SAMPLE_RATE]).max() > 0.2


def test_whole_files_give_no_truncation_warning(tmp_path: Path) -> None:
    paths = [p.with_name(p.name.replace("cut", "whole")) for p, _ in _cut_copies(tmp_path).values()]
    paths += [shared_clip(n) for n in ("jfk.flac", "hotwords.mp3", "multilingual.mp3")]
    for path in paths:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_audio(path)
        assert [w for w in caught if "truncated" in str(w.message)] == [], path


def test_m4a_without_its_index_is_damaged_audio_not_a_non_audio_file(tmp_path: Path) -> None:
    path = encode_with_av(tone(3.0, 44100, channels=2), 44100, tmp_path / "a.m4a", "aac", 44100)
    data = path.read_bytes()
    assert data.find(b"moov") > len(data) // 2  # FFmpeg writes the index last
    path.write_bytes(data[: len(data) // 2])
    expect_input_error(path, "corrupt or truncated audio (")


def test_non_finite_samples_become_silence_with_one_warning(tmp_path: Path) -> None:
    samples = tone(3.0, 44100, channels=2)
    samples[44100, 0] = np.nan  # one sample of one channel
    samples[2 * 44100 : 2 * 44100 + 100] = np.inf  # a run of 100 frames
    path = tmp_path / "damaged.wav"
    sf.write(path, samples, 44100, subtype="FLOAT")
    with pytest.warns(WhisperCliWarning) as caught:
        x = load_audio(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: 101 non-finite samples (NaN or infinite) replaced by silence (2 ms of 3.0 s)"
    ]
    assert np.isfinite(x).all()
    clean = samples.copy()
    clean[~np.isfinite(clean)] = 0.0
    sf.write(tmp_path / "clean.wav", clean, 44100, subtype="FLOAT")
    np.testing.assert_array_equal(x, load_audio(tmp_path / "clean.wav"))


def test_input_with_no_finite_sample_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "nan.wav"
    sf.write(path, np.full((16000, 1), np.nan, np.float32), 16000, subtype="FLOAT")
    with pytest.raises(InputError, match="has no finite sample"):
        load_audio(path)


def test_decoder_chatter_on_fd_2_is_captured_and_kept_as_a_message(capfd) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = load_audio(shared_clip("multilingual.mp3"))
    assert len(x) == pytest.approx(59.9 * SAMPLE_RATE, abs=SAMPLE_RATE)
    assert capfd.readouterr().err == ""  # libmpg123 wrote nothing to the real stderr
    said = [w for w in caught if issubclass(w.category, DecoderMessage)]
    assert len(said) == 1 and "part2_3_length" in str(said[0].message)
    assert len(caught) == 1


def test_corruption_found_mid_stream_raises_input_error_from_blocks(tmp_path: Path) -> None:
    path = tmp_path / "damaged.flac"
    rng = np.random.default_rng(0)
    sf.write(path, (tone(12.0, 16000)[:, 0] + 0.01 * rng.standard_normal(12 * 16000)), 16000)
    data = bytearray(path.read_bytes())
    data[len(data) * 6 // 10 : len(data) * 7 // 10] = bytes(
        len(data) * 7 // 10 - len(data) * 6 // 10
    )
    path.write_bytes(bytes(data))
    source = open_audio(path)  # head and tail are intact, so it opens
    with pytest.raises(InputError, match=r"corrupt or truncated audio \(.* after \d+\.\d s\)"):
        decode_all(source)


def test_header_only_wav(tmp_path: Path) -> None:
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), 16000, subtype="PCM_16")
    assert path.stat().st_size == 44
    expect_input_error(path, "contains no audio")


def test_zero_byte_file_and_empty_stdin(tmp_path: Path) -> None:
    path = tmp_path / "zero.mp3"
    path.touch()
    expect_input_error(path, "contains no audio")
    expect_input_error("-", "contains no audio", stdin=io.BytesIO(b""))


def test_too_short(tmp_path: Path) -> None:
    path = tmp_path / "blip.wav"
    sf.write(path, tone(0.05, 16000), 16000)
    error = expect_input_error(path, "audio is too short")
    assert error.problem == "audio is too short (0.05 s; at least 0.1 s needed)"
    sf.write(path, tone(0.1, 16000), 16000)
    assert len(load_audio(path)) == 1600  # exactly the minimum is fine


def test_too_short_through_av(tmp_path: Path) -> None:
    path = encode_with_av(tone(0.04, 48000), 48000, tmp_path / "blip.webm", "libopus", 48000)
    expect_input_error(path, "audio is too short (")


def test_video_without_audio_stream(tmp_path: Path) -> None:
    path = tmp_path / "silent_film.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        black = np.zeros((48, 64, 3), np.uint8)
        for _ in range(10):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(black, format="rgb24")))
        container.mux(stream.encode(None))
    expect_input_error(path, "has no audio stream")


def test_channel_out_of_range(tmp_path: Path) -> None:
    mono = tmp_path / "mono.wav"
    sf.write(mono, tone(1.0, 16000), 16000)
    expect_input_error(mono, "has no right channel (mono audio)", channel="right")
    stereo = tmp_path / "stereo.wav"
    sf.write(stereo, tone(1.0, 16000, channels=2), 16000)
    expect_input_error(stereo, "has no channel 2 (it has 2 channels)", channel=2)


@pytest.mark.parametrize("channel", ["middle", -1, True, 1.5])
def test_invalid_channel_is_a_usage_error(tmp_path: Path, channel) -> None:
    path = tmp_path / "mono.wav"
    sf.write(path, tone(1.0, 16000), 16000)
    with pytest.raises(WhisperCliError, match="invalid channel") as caught:
        open_audio(path, channel=channel)
    assert not isinstance(caught.value, InputError)


def test_bad_block_size(tmp_path: Path) -> None:
    path = tmp_path / "mono.wav"
    sf.write(path, tone(1.0, 16000), 16000)
    with pytest.raises(ValueError, match="block_seconds"):
        next(open_audio(path).blocks(0))
