"""Reliability: bad inputs, run-level errors, internal errors, the silence guard, Ctrl-C.

The CLI runs as a real subprocess (``python -m whisper_cli``) wherever exit codes, the
stdout/stderr split or the absence of a traceback is what is tested. The bad files are made
here; the real speech comes from ../shared/audio and is only read (or copied to tmp dirs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
from util import REPO, real_model, shared_clip

from whisper_cli.audio import load_audio
from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import FORMATS

RATE = 16000
JFK_WORDS = (
    "and so my fellow americans ask not what your country can do for you "
    "ask what you can do for your country"
)


# --- helpers ------------------------------------------------------------------------------


def run_cli(
    *args: str | Path, prefix: tuple[str, ...] = (), code: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; ``code`` (Python run first) patches the library in that process."""
    if code is None:
        cmd = [*prefix, sys.executable, "-m", "whisper_cli", *map(str, args)]
    else:
        boot = "import sys\nsys.argv = ['whisper-cli', *sys.argv[1:]]\n"
        boot += code + "\nfrom whisper_cli.cli import main\nmain()\n"
        cmd = [*prefix, sys.executable, "-c", boot, *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("whisper-cli: error: ")]


def assert_clean(result: subprocess.CompletedProcess, code: int) -> None:
    """Exit code as expected, and no Python traceback anywhere."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


def words(text: str) -> str:
    kept = "".join(ch.lower() if ch.isalnum() or ch.isspace() else " " for ch in text)
    return " ".join(kept.split())


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, subtype: str = "FLOAT") -> Path:
    sf.write(path, samples, rate, subtype=subtype)
    return path


def video_only_mp4(path: Path) -> Path:
    """One second of video and no audio stream."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(10):
            image = np.full((48, 64, 3), i * 20, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def drop_file_access_prefix(probe: Path) -> tuple[str, ...] | None:
    """A command prefix under which a mode-000 file is unreadable, or None if impossible.

    Tests run as root, which reads any file; dropping CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from the bounding set (setpriv) makes root obey file modes, while
    everything else (root-owned, normal modes) stays readable.
    """
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = (setpriv, "--bounding-set", "-dac_override,-dac_read_search")
    check = subprocess.run([*prefix, "cat", str(probe)], capture_output=True, check=False)
    return prefix if check.returncode != 0 else None


def tiny() -> Path:
    return real_model("tiny.en")


# --- per-input errors: one run, every kind of bad input, the good ones still written --------


class BadRun:
    """One CLI run over good and bad inputs; the tests below each check one bad input."""

    def __init__(self, tmp: Path) -> None:
        jfk = shared_clip("jfk.flac")
        stereo = shared_clip("stereo_diarization.wav")
        self.out = tmp / "out"
        bad = tmp / "bad"
        bad.mkdir()
        (tmp / "no_audio_dir").mkdir()
        (tmp / "no_audio_dir" / "notes.txt").write_text("not audio\n")
        (bad / "notes.wav").write_text("these are notes, not a RIFF file\n")
        data = jfk.read_bytes()
        # Cut short: not a bad input any more; what is there is transcribed, with a warning.
        self.truncated = tmp / "truncated.flac"
        self.truncated.write_bytes(data[: len(data) // 4])
        garbled = bytearray(data)  # header and tail intact, the middle is noise
        rng = np.random.default_rng(1)
        garbled[200_000:600_000] = rng.integers(0, 256, 400_000, dtype=np.uint8).tobytes()
        (bad / "garbled.flac").write_bytes(bytes(garbled))
        (bad / "empty.wav").write_bytes(b"")
        write_wav(bad / "header_only.wav", np.zeros(0, np.int16), subtype="PCM_16")
        write_wav(bad / "short.wav", np.full(800, 0.1, np.float32))  # 0.05 s
        video_only_mp4(bad / "video_only.mp4")
        unreadable = write_wav(bad / "unreadable.wav", np.full(RATE, 0.1, np.float32))
        unreadable.chmod(0)
        prefix = drop_file_access_prefix(unreadable)
        self.cases = {
            "missing": (str(tmp / "missing.wav"), "no such file"),
            "dir": (str(tmp / "no_audio_dir"), "directory contains no audio files"),
            "not_audio": (str(bad / "notes.wav"), "not an audio file"),
            "garbled": (str(bad / "garbled.flac"), "corrupt or truncated audio"),
            "empty": (str(bad / "empty.wav"), "contains no audio"),
            "header_only": (str(bad / "header_only.wav"), "contains no audio"),
            "short": (str(bad / "short.wav"), "audio is too short (0.05 s"),
            "video_only": (str(bad / "video_only.mp4"), "has no audio stream"),
        }
        if prefix is not None:
            self.cases["unreadable"] = (str(unreadable), "permission denied")
        self.unreadable_skip = None if prefix is not None else "setpriv cannot drop root's access"
        paths = [p for p, _ in self.cases.values()]
        # Good inputs first, in the middle and last: failures must not stop the others.
        args = [str(jfk), *paths[:4], str(stereo), *paths[4:], str(self.truncated)]
        started = time.perf_counter()
        self.result = run_cli(
            "transcribe", *args, "--model", tiny(), "-o", self.out, "--format", "all",
            prefix=prefix or (),
        )  # fmt: skip
        self.seconds = time.perf_counter() - started


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory) -> BadRun:
    return BadRun(tmp_path_factory.mktemp("bad_inputs"))


def test_bad_inputs_exit_1_and_good_inputs_are_written(bad_run: BadRun) -> None:
    assert_clean(bad_run.result, 1)
    assert len(error_lines(bad_run.result.stderr)) == len(bad_run.cases)
    assert sorted(p.name for p in bad_run.out.iterdir()) == sorted(
        f"{stem}.{fmt}" for stem in ("jfk", "stereo_diarization", "truncated") for fmt in FORMATS
    )
    assert words((bad_run.out / "jfk.txt").read_text()) == JFK_WORDS
    assert "curtain on the left" in (bad_run.out / "stereo_diarization.txt").read_text()
    assert json.loads((bad_run.out / "jfk.json").read_text())["segments"]
    assert bad_run.result.stdout == ""  # everything went to --output-dir


def test_truncated_input_is_transcribed_as_far_as_it_goes_with_a_warning(bad_run) -> None:
    path = bad_run.truncated
    assert f"whisper-cli: warning: {path}: truncated: the audio ends at " in bad_run.result.stderr
    assert "fellow americans" in words((bad_run.out / "truncated.txt").read_text())  # 2.6 s


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "dir",
        "not_audio",
        "garbled",
        "empty",
        "header_only",
        "short",
        "unreadable",
        "video_only",
    ],
)
def test_bad_input_is_named_on_one_line(bad_run: BadRun, case: str) -> None:
    if case == "unreadable" and bad_run.unreadable_skip:
        pytest.skip(bad_run.unreadable_skip)
    path, problem = bad_run.cases[case]
    lines = [line for line in error_lines(bad_run.result.stderr) if path + ":" in line]
    assert len(lines) == 1, bad_run.result.stderr
    assert lines[0].startswith(f"whisper-cli: error: {path}: {problem}"), lines[0]
    assert_clean(bad_run.result, 1)


# --- run-level errors: exit 2 before any work ------------------------------------------------


def model_copy(tmp: Path, without: str = "", config: str | None = None) -> Path:
    """tiny.en with one file left out, or with config.json replaced (links, no copies)."""
    src = tiny()
    dst = tmp / f"model_without_{without or 'none'}"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != without and not (config is not None and f.name == "config.json"):
            (dst / f.name).symlink_to(f)
    if config is not None:
        (dst / "config.json").write_text(config)
    return dst


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("no_tokenizer", "has no tokenizer.json"),
        ("no_weights", "is missing model weights"),
        ("bad_weights", "cannot read the weights"),
        ("malformed_config", "malformed"),
        ("config_not_whisper", "not a Whisper model"),
        ("unknown_alias", "unknown model 'tiny.xx'"),
        ("bad_language", "unknown language 'klingon'"),
        ("language_for_english_only", "English-only model"),
        ("cuda_missing", "no CUDA device is available"),
        ("out_dir_is_file", "exists and is not a directory"),
    ],
)
def test_run_level_error_exits_2_before_work(tmp_path: Path, kind: str, message: str) -> None:
    if kind == "cuda_missing":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    model, extra = str(tiny()), []
    out = tmp_path / "out"
    if kind == "no_tokenizer":
        model = model_copy(tmp_path, without="tokenizer.json")
    elif kind == "no_weights":
        model = model_copy(tmp_path, without="model.safetensors")
    elif kind == "bad_weights":
        model = model_copy(tmp_path, without="model.safetensors")
        (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif kind == "malformed_config":
        model = model_copy(tmp_path, config='{"d_model": 384,')
    elif kind == "config_not_whisper":
        model = model_copy(tmp_path, config='{"model_type": "bert"}')
    elif kind == "unknown_alias":
        model = "tiny.xx"
    elif kind == "bad_language":
        model, extra = str(real_model("base")), ["--language", "klingon"]
    elif kind == "language_for_english_only":
        extra = ["--language", "de"]
    elif kind == "cuda_missing":
        extra = ["--device", "cuda"]
    elif kind == "out_dir_is_file":
        out.write_text("a file where the output directory should be\n")
    clip = shared_clip("stereo_diarization.wav")
    result = run_cli("transcribe", clip, "--model", model, "-o", out, *extra)
    assert_clean(result, 2)
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("whisper-cli: error: ") and message in lines[-1], result.stderr
    assert len(error_lines(result.stderr)) == 1
    assert not out.is_dir()  # nothing was transcribed


def test_unwritable_output_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x\n")
    out = blocker / "sub"  # its parent is a file: creating it fails at the first write
    quiet = write_wav(tmp_path / "quiet.wav", np.zeros(RATE, np.float32))  # nothing to decode
    result = run_cli("transcribe", quiet, "-m", tiny(), "-o", out)
    assert_clean(result, 2)
    assert error_lines(result.stderr) == [
        f"whisper-cli: error: cannot create output directory {out}: Not a directory"
    ]
    assert "whisper-cli: model" not in result.stderr  # found before the model loads


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch) -> None:
    import torch

    from whisper_cli.dtypes import resolve_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(WhisperCliError) as info:
        resolve_policy("bf16", "cuda")
    assert info.value.exit_code == 2
    assert "bf16" in info.value.message and "Tesla T4" in info.value.message
    assert "\n" not in info.value.message
    # auto picks what the GPU can run; an explicit f16 is accepted as asked.
    assert resolve_policy("auto", "cuda").dtype == torch.float16
    assert resolve_policy("f16", "cuda").dtype == torch.float16


def test_debug_shows_the_traceback_of_a_run_level_error() -> None:
    clip = shared_clip("stereo_diarization.wav")
    plain = run_cli("transcribe", clip, "--model", "tiny.xx")
    debug = run_cli("transcribe", clip, "--model", "tiny.xx", "--debug")
    assert_clean(plain, 2)
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr
    assert "resolve_model" in debug.stderr  # where it was raised
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]


BOOM = """
import whisper_cli.inputs as inputs

def boom(*args, **kwargs):
    raise RuntimeError("something broke\\nsecond line of detail")

inputs.expand_inputs = boom
"""


def test_internal_error_is_one_line_without_debug() -> None:
    clip = shared_clip("stereo_diarization.wav")
    result = run_cli("transcribe", clip, "-m", tiny(), "-q", code=BOOM)
    assert_clean(result, 2)
    assert result.stderr.strip().splitlines() == [
        "whisper-cli: internal error: RuntimeError: something broke "
        "(run with --debug for the traceback)"
    ]
    debug = run_cli("transcribe", clip, "-m", tiny(), "-q", "--debug", code=BOOM)
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr
    assert "in boom" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("whisper-cli: internal error:")


# --- silence is not an error; the silence guard drops nothing but non-speech ----------------


def test_silent_file_is_an_empty_transcript(tmp_path: Path) -> None:
    silent = write_wav(tmp_path / "silent.wav", np.zeros(30 * RATE, np.float32))
    result = run_cli("transcribe", silent, "-m", tiny(), "--format", "json", "-q")
    assert_clean(result, 0)
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["text"] == "" and data["segments"] == []
    assert data["duration"] == 30.0


@pytest.fixture
def default_transcriber(request):
    """`default_transcriber(name, **options)` over the session's real model (conftest)."""
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    def make(name: str, **options):
        loaded = request.getfixturevalue("tiny_en" if name == "tiny.en" else "base_model")
        return Transcriber(loaded, TranscribeOptions(**options))

    return make


def guard_spy(monkeypatch, t) -> list[tuple[float, float, bool]]:
    """Record (no_speech_prob, avg_logprob, judged silent) for every decoded window."""
    from whisper_cli import pipeline

    seen: list[tuple[float, float, bool]] = []
    real = pipeline.judge

    def spy(window, attempts, *args, **kwargs):
        verdict = real(window, attempts, *args, **kwargs)
        if verdict.final:
            row = verdict.row
            seen.append((round(row.no_speech_prob, 3), round(row.avg_logprob, 3), verdict.silent))
        return verdict

    monkeypatch.setattr(pipeline, "judge", spy)
    return seen


def non_speech(kind: str) -> np.ndarray:
    n = 30 * RATE
    if kind == "silence":
        return np.zeros(n, np.float32)
    if kind == "noise":  # white noise, standard deviation 0.003 (peaks about 0.015)
        return (np.random.default_rng(0).standard_normal(n) * 0.003).astype(np.float32)
    if kind == "tone":
        return (0.3 * np.sin(2 * np.pi * 440.0 * np.arange(n) / RATE)).astype(np.float32)
    raise ValueError(kind)


# Digital silence is left out: plain Whisper writes " you" for it at an average log-prob of
# -0.7 (tiny.en), which the guard keeps; with the map on it is never decoded.
@pytest.mark.parametrize("kind", ["noise", "tone"])
@pytest.mark.parametrize("model", ["tiny.en", "base"])
def test_silence_guard_with_the_detector_off(
    tmp_path, monkeypatch, default_transcriber, model: str, kind: str
) -> None:
    """With --no-vad every window is decoded: the model's own no-speech guard still gives
    no text for non-speech (with the map on, such audio is never decoded at all)."""
    path = write_wav(tmp_path / f"{kind}.wav", non_speech(kind))
    t = default_transcriber(model, vad=False)
    seen = guard_spy(monkeypatch, t)
    result = t.transcribe(str(path))
    print(f"{model} {kind}: (no_speech_prob, avg_logprob, silent) per window: {seen}")
    assert result.text == "" and result.segments == (), result.segments
    assert result.duration == 30.0
    assert seen and all(silent for _, _, silent in seen)  # decoded, and judged silent


@pytest.mark.parametrize("model", ["tiny.en", "base"])
def test_speech_then_silence_gives_only_the_speech(tmp_path, default_transcriber, model) -> None:
    samples, rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    padded = np.concatenate([samples.mean(axis=1), np.zeros(20 * rate, np.float32)])
    path = write_wav(tmp_path / "jfk_then_silence.wav", padded, rate=rate)
    t = default_transcriber(model)
    result = t.transcribe(str(path))
    assert words(result.text) == JFK_WORDS
    assert result.segments[-1].end <= len(samples) / rate + 0.5
    assert result.duration == pytest.approx(len(padded) / rate, abs=0.01)


@pytest.mark.parametrize("model", ["tiny.en", "base"])
@pytest.mark.parametrize("peak_dbfs", [-45, -55])
def test_a_quiet_recording_keeps_every_word(tmp_path, default_transcriber, model, peak_dbfs):
    """jfk.flac recorded far quieter, as a 16-bit file holds it: every word is written.
    The detector scores it at its gain (speech.LevelGain); heard as it is, it found 24%
    of jfk's speech frames at -45 dBFS and none at -55, and the text lost its words. At
    -55 the 16-bit steps are loud beside the speech and the decoder hears a word or two
    otherwise ("America", "asked"): each word is there, in its place."""
    samples = load_audio(shared_clip("jfk.flac"))
    quiet = samples / np.abs(samples).max() * 10 ** (peak_dbfs / 20)
    path = write_wav(tmp_path / "jfk_quiet.wav", quiet, subtype="PCM_16")
    result = default_transcriber(model).transcribe(str(path))
    said, heard = JFK_WORDS.split(), words(result.text).split()
    if peak_dbfs > -50:
        assert heard == said, result.text
    assert len(heard) == len(said), result.text
    assert sum(a == b for a, b in zip(said, heard, strict=True)) >= len(said) - 3, result.text


def loud_then(quiet: np.ndarray, lead: str) -> np.ndarray:
    """6 s of something at -1 dBFS (a chord, or stereo_diarization's right channel, a
    near voice), 1 s of silence, then `quiet`."""
    if lead == "chord":
        t = np.arange(6 * RATE) / RATE
        sound = sum(np.sin(2 * np.pi * f * t) for f in (261.6, 329.6, 392.0, 523.3))
    else:
        sound = load_audio(shared_clip("stereo_diarization.wav"), channel="right")
    sound = sound / np.abs(sound).max() * 10 ** (-1 / 20)
    return np.concatenate([sound, np.zeros(RATE), quiet]).astype(np.float32)


@pytest.mark.parametrize("model", ["tiny.en", "base"])
@pytest.mark.parametrize("lead", ["chord", "near voice"])
def test_quiet_speech_after_a_loud_sound_keeps_every_word(
    tmp_path, default_transcriber, model, lead
):
    """jfk.flac at -45 dBFS, 1 s after 6 s of a chord or of a near voice at -1 dBFS, as a
    16-bit file holds it: every word is written. The detector's state remembers the loud
    level and its gain follows the loudest level so far: before the quiet section was
    heard again (speech.QuietSection) none of jfk's words were written after either."""
    samples = load_audio(shared_clip("jfk.flac"))
    quiet = samples / np.abs(samples).max() * 10 ** (-45 / 20)
    path = write_wav(tmp_path / "loud_then_quiet.wav", loud_then(quiet, lead), subtype="PCM_16")
    result = default_transcriber(model).transcribe(str(path))
    heard = words(result.text)
    if lead == "near voice":
        assert heard.startswith("the horizon seems extremely distant "), result.text
        heard = heard.removeprefix("the horizon seems extremely distant ")
    said, heard = JFK_WORDS.split(), heard.split()
    assert len(heard) == len(said), result.text
    assert sum(a == b for a, b in zip(said, heard, strict=True)) >= len(said) - 2, result.text


@pytest.mark.parametrize("model", ["tiny.en", "base"])
@pytest.mark.parametrize("kind", ["white noise -70 dBFS", "music 40 dB down", "dithered silence"])
def test_quiet_non_speech_after_a_near_voice_gives_no_text(
    tmp_path, default_transcriber, model, kind
):
    """A near voice at -1 dBFS, then 20 s of quiet non-speech, which the quiet section is
    heard again at its own gain: only the voice's words are written."""
    rng = np.random.default_rng(3)
    n = 20 * RATE
    if kind == "white noise -70 dBFS":
        after = rng.standard_normal(n) * 10 ** (-70 / 20) / 4
    elif kind == "music 40 dB down":  # a note every 250 ms, 40 dB under the voice
        notes = 220.0 * 2 ** (rng.integers(0, 12, n // (RATE // 4) + 1) / 12)
        pitch = np.repeat(notes, RATE // 4)[:n]
        after = 0.3 * np.sin(2 * np.pi * np.cumsum(pitch) / RATE) * 10 ** (-40 / 20)
    else:
        after = (rng.integers(0, 2, n) - rng.integers(0, 2, n)) / 32767
    audio = loud_then(after.astype(np.float32), "near voice")
    path = write_wav(tmp_path / "voice_then_quiet.wav", audio, subtype="PCM_16")
    result = default_transcriber(model).transcribe(str(path))
    assert words(result.text) == "the horizon seems extremely distant", result.text


def check_speech_kept(monkeypatch, t, model: str, clip: str, expect: str) -> None:
    seen = guard_spy(monkeypatch, t)
    result = t.transcribe(str(shared_clip(clip)))
    print(f"{model} {clip}: (no_speech_prob, avg_logprob, silent) per window: {seen}")
    windows = -(-result.duration // 30)
    assert len(seen) >= windows  # every window was decoded (none gated as digital silence)
    assert not any(silent for _, _, silent in seen)
    assert expect in words(result.text), result.text


@pytest.mark.parametrize(
    ("clip", "expect"),
    [
        ("jfk.flac", JFK_WORDS),
        ("stereo_diarization.wav", "behind the curtain on the left"),
        ("hotwords.mp3", "folder again"),
    ],
)
@pytest.mark.parametrize("model", ["tiny.en", "base"])
def test_silence_guard_keeps_real_speech(
    monkeypatch, default_transcriber, model: str, clip: str, expect: str
) -> None:
    check_speech_kept(monkeypatch, default_transcriber(model), model, clip, expect)


@pytest.mark.slow
def test_silence_guard_keeps_long_multilingual_speech(monkeypatch, default_transcriber) -> None:
    t = default_transcriber("base")
    check_speech_kept(monkeypatch, t, "base", "multilingual.mp3", "permission is hereby granted")


# --- interruption and resumption --------------------------------------------------------------


def check_complete(path: Path) -> None:
    """An output file parses as a whole file of its format."""
    text = path.read_text(encoding="utf-8")
    fmt = path.suffix[1:]
    if fmt == "json":
        assert "text" in json.loads(text)
    elif fmt == "jsonl":
        assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    elif fmt == "vtt":
        assert text.startswith("WEBVTT\n") and text.endswith("\n")
    elif fmt == "tsv":
        assert text.startswith("start\tend\ttext\n") and text.endswith("\n")
    elif fmt == "srt":
        assert text.startswith("1\n") and text.endswith("\n") and " --> " in text
    else:
        assert text.endswith("\n")


def output_state(out: Path) -> dict[str, dict[str, int]]:
    """{stem: {file name: mtime_ns}}, every file checked complete; no temp file left."""
    state: dict[str, dict[str, int]] = {}
    for entry in os.listdir(out):  # listdir: hidden ".name.tmp" files included
        path = out / entry
        assert not entry.endswith(".tmp"), f"partial file left: {entry}"
        check_complete(path)
        state.setdefault(path.stem, {})[entry] = path.stat().st_mtime_ns
    return state


@pytest.mark.slow  # two CLI runs over 7 inputs: 45-85 s on the shared 2-core machine
def test_sigint_mid_run_then_skip_existing_finishes(tmp_path: Path) -> None:
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for i in range(6):
        shutil.copy(shared_clip("jfk.flac"), inputs / f"jfk{i}.flac")
    shutil.copy(shared_clip("stereo_diarization.wav"), inputs / "stereo.wav")
    args = ["transcribe", str(inputs), "-m", str(tiny()), "--batch-size", "1"]
    args += ["-o", str(out), "--format", "all"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "whisper_cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    # Formats are written in FORMATS order: a .tsv means one input is wholly written.
    while not (out.is_dir() and any(p.suffix == ".tsv" for p in out.iterdir())):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no output appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stdout == ""  # everything went to --output-dir
    assert stderr.strip().splitlines()[-1].startswith("whisper-cli: interrupted")
    first = output_state(out)
    done = {stem: files for stem, files in first.items() if len(files) == len(FORMATS)}
    assert 1 <= len(done) < 7, sorted(first)

    second = run_cli(*args, "--skip-existing")
    assert_clean(second, 0)
    assert f"skipping {len(done)} input(s)" in second.stderr
    final = output_state(out)
    assert sorted(final) == sorted([*(f"jfk{i}" for i in range(6)), "stereo"])
    assert all(len(files) == len(FORMATS) for files in final.values())
    for stem, files in done.items():
        assert final[stem] == files, f"{stem} was redone"
    for i in range(6):
        assert words((out / f"jfk{i}.txt").read_text()) == JFK_WORDS


@pytest.mark.parametrize(("batch_size", "refill"), [(1, False), (2, False), (1, True)])
def test_each_input_is_handed_over_as_soon_as_it_is_decoded(
    monkeypatch, tiny_en, batch_size, refill
):
    """Outputs appear input by input (what makes Ctrl-C lose only unfinished work): as
    each batch ends, or with refills as each run (RUN_BATCHES batches' windows) ends."""
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    t = Transcriber(tiny_en, TranscribeOptions(batch_size=batch_size, refill=refill))
    events: list[str] = []
    real = t.engine.run

    def run(rows, *args, **kwargs):
        events.append(f"decode {len(rows)}")
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(t.engine, "run", run)
    clip = str(shared_clip("stereo_diarization.wav"))
    t.run([clip] * 3, lambda r: events.append("result"), pytest.fail)
    expected = {
        (1, False): ["decode 1", "result"] * 3,
        (2, False): ["decode 2", "result", "result", "decode 1", "result"],
        (1, True): ["decode 3", "result", "result", "result"],  # one run, one row at a time
    }
    assert events == expected[batch_size, refill]


SIGINT_AT = {
    # The signal arrives while the checkpoint is being read.
    "load": """
import os, signal
import whisper_cli.loading as loading
real = loading.read_checkpoint
def read_checkpoint(path):
    os.kill(os.getpid(), signal.SIGINT)
    return real(path)
loading.read_checkpoint = read_checkpoint
""",
    # The signal arrives inside a libsndfile read callback (cffi swallows exceptions there)
    # while the audio is decoded: the run must still stop, without writing the transcript.
    "read": """
import io, os, signal
import whisper_cli.audio as audio
class Interrupting(io.FileIO):
    calls = 0
    def tell(self):
        Interrupting.calls += 1
        if Interrupting.calls == 100:  # about 20 calls open the file, 270 decode it
            os.kill(os.getpid(), signal.SIGINT)
        return super().tell()
real = audio._file_opener
def _file_opener(name):
    real(name)
    return lambda: Interrupting(name, "rb")
audio._file_opener = _file_opener
""",
    # The signal arrives at the third token step of the first batch (after the prompt pass).
    "decode": """
import os, signal
import whisper_cli.engine as engine
real = engine.Engine.run
def decode(self, *args, **kwargs):
    decoder = self.model.decoder
    forward, calls = decoder.forward, []
    def counted(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return forward(*a, **k)
    decoder.forward = counted
    return real(self, *args, **kwargs)
engine.Engine.run = decode
""",
}


@pytest.mark.parametrize("when", ["load", "read", "decode"])
def test_sigint_during_load_or_decode_exits_130(tmp_path: Path, when: str) -> None:
    out = tmp_path / "out"
    clip = shared_clip("jfk.flac")
    result = run_cli("transcribe", clip, "-m", tiny(), "-o", out, "-q", code=SIGINT_AT[when])
    assert_clean(result, 130)
    assert result.stderr.strip().splitlines() == [
        "whisper-cli: interrupted; finished outputs are complete, no partial file left"
    ]
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.parametrize("refill", [False, True])
def test_out_of_memory_retries_with_a_smaller_batch(tiny_en, monkeypatch, refill):
    """A batch that runs out of (GPU) memory is decoded again in halves, with a warning;
    with refills, the rows decoded at once are halved (the run's windows with them)."""
    import torch

    from whisper_cli.decoding import DecodedRow
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    paths = [str(shared_clip("jfk.flac")), str(shared_clip("stereo_diarization.wav"))] * 2
    expected = {}
    reference = Transcriber(tiny_en, TranscribeOptions(batch_size=4))
    reference.run(paths, lambda t: expected.setdefault(t.path, t.text), pytest.fail)
    transcriber = Transcriber(tiny_en, TranscribeOptions(batch_size=4, refill=refill))
    real_run = transcriber.engine.run
    sizes = []
    looped = DecodedRow((), -5.0, (), 0.0, "en", looped=True)

    def run(rows, *args, **kwargs):
        width = min(len(rows), kwargs.get("slots") or len(rows))  # rows decoded at once
        sizes.append(width)
        if width > 1:
            # Refilled, rows are judged as they finish: one judged (and retried) before
            # memory runs out is judged anew when the batch is decoded again.
            if kwargs.get("on_finish") is not None:
                assert kwargs["on_finish"](0, looped, 0)  # its next attempt
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(rows, *args, **kwargs)

    monkeypatch.setattr(transcriber.engine, "run", run)
    got = {}
    with pytest.warns(
        RuntimeWarning, match="out of memory at batch size 4; retrying with batch size 2"
    ):
        transcriber.run(paths, lambda t: got.setdefault(t.path, t.text), pytest.fail)
    assert got == expected
    assert transcriber.counters.fallbacks == reference.counters.fallbacks
    # Refilled, the one run at one row takes all four windows; else a batch of one each.
    assert sizes[:3] == [4, 2, 1] and set(sizes[3:]) == (set() if refill else {1})
