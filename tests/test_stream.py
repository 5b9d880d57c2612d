"""Streamed output and the latency bound: text as it is final, in order, the same text.

The unit tests pin each piece (renderers' pieces, the output stream, the scheduler's
settled windows, the cutter under a bound, a live pipe); the subprocess tests feed a
real recording through a pipe at four times real time, as `ffmpeg -re ... |` or a
recorder would, and read stdout as it comes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from test_formats import SAMPLE, assert_monotonic, parse_srt, parse_vtt
from test_windows import DETECTOR, SR, F, planted
from test_word_formats import CASES, TRANSCRIPT
from util import REPO, jsonl_records, real_model, shared_clip

from whisper_cli.audio import open_audio
from whisper_cli.errors import InputError
from whisper_cli.formats import FORMATS, render, render_chunks
from whisper_cli.options import Policy, parse_latency, run_latency
from whisper_cli.outputs import OutputPlan, OutputStream
from whisper_cli.results import Transcript
from whisper_cli.scheduler import Counters, Finished, Scheduler, Settled
from whisper_cli.windows import WindowCutter

# --- renderers: the pieces so far are a prefix of the whole ---------------------------------


def partial(transcript: Transcript, k: int) -> Transcript:
    return Transcript(transcript.path, "", None, transcript.segments[:k], 0.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("options", [None, *CASES], ids=repr)
@pytest.mark.parametrize("transcript", [SAMPLE, TRANSCRIPT], ids=["plain", "words"])
def test_pieces_so_far_are_a_prefix_of_the_whole(fmt, options, transcript) -> None:
    whole = render_chunks(transcript, fmt, options)
    assert "".join(whole) == render(transcript, fmt, options)
    grown = 0
    for k in range(len(transcript.segments) + 1):
        so_far = render_chunks(partial(transcript, k), fmt, options, final=False)
        assert whole[: len(so_far)] == so_far, f"after {k} segments"
        assert len(so_far) >= grown  # what was given is never taken back
        grown = len(so_far)
    if fmt != "json":
        assert grown > 0, "nothing streams before the end"
    cross_segment = options is not None and options.max_line_width and options.max_line_count
    if fmt in ("txt", "srt", "vtt", "tsv") and not cross_segment:
        # Cues that close with their segment stream with it: all of them before the end.
        everything = render_chunks(partial(transcript, len(transcript.segments)), fmt, options)
        assert so_far == everything


# --- the output stream ------------------------------------------------------------------------


def two_inputs() -> tuple[Transcript, Transcript]:
    a = dataclasses.replace(SAMPLE, path="a.wav")
    b = dataclasses.replace(TRANSCRIPT, path="b.wav")
    return a, b


def test_stdout_streams_each_input_in_the_order_given() -> None:
    a, b = two_inputs()
    plan = OutputPlan.make("txt", None, [], 2)
    writes: list[str] = []
    stream = OutputStream(plan, ["a.wav", "b.wav"], writes.append)
    stream.segments("b.wav", b.segments[:2])  # b is ahead of a: held
    assert writes == []
    stream.segments("a.wav", a.segments[:1])
    assert writes == ["==> a.wav <==\n" + a.segments[0].text.strip() + "\n"]
    stream.finish(b)
    assert len(writes) == 1  # b ended, but a has not: still held
    stream.segments("a.wav", a.segments[1:])
    stream.finish(a)
    assert "".join(writes) == (
        "==> a.wav <==\n" + render(a, "txt") + "==> b.wav <==\n" + render(b, "txt")
    )


def test_a_failed_input_lets_the_next_one_through() -> None:
    a, b = two_inputs()
    writes: list[str] = []
    stream = OutputStream(OutputPlan.make("jsonl", None, [], 2), ["a.wav", "b.wav"], writes.append)
    stream.segments("a.wav", a.segments[:1])
    stream.finish(b)
    stream.drop("a.wav")
    assert "".join(writes) == render_chunks(a, "jsonl")[0] + render(b, "jsonl")


def test_files_are_written_through_temp_files_renamed_at_the_end(tmp_path: Path) -> None:
    a, _ = two_inputs()
    plan = OutputPlan.make("all", tmp_path, [], 1)
    stream = OutputStream(plan, ["a.wav"], lambda text: pytest.fail("nothing goes to stdout"))
    stream.segments("a.wav", a.segments[:1])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == len(FORMATS) - 1  # json has nothing before the end
    written = stream.finish(a)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"a.{f}" for f in FORMATS)
    # Committed in FORMATS order although json's file opened last: within a run, an
    # input's last format on disk means its others are committed.
    assert written == [tmp_path / f"a.{f}" for f in FORMATS]
    for fmt in FORMATS:
        assert (tmp_path / f"a.{fmt}").read_text() == render(a, fmt)


def test_an_aborted_run_leaves_no_file(tmp_path: Path) -> None:
    a, _ = two_inputs()
    stream = OutputStream(OutputPlan.make("all", tmp_path, [], 1), ["a.wav"], print)
    stream.segments("a.wav", a.segments[:2])
    assert any(tmp_path.iterdir())
    stream.abort()
    assert list(tmp_path.iterdir()) == []


# --- the scheduler settles windows in order ---------------------------------------------------


class PlantedSource:
    """An input whose samples are its planted speech map (see test_windows)."""

    def __init__(self, signal: np.ndarray, path: str = "planted.wav") -> None:
        from whisper_cli.audio import AudioInfo

        self.signal = signal
        self.info = AudioInfo(path, len(signal) / SR, SR, 1)
        self.live = False

    def blocks(self, block_seconds: float = 30.0):
        size = round(block_seconds * SR)
        for start in range(0, len(self.signal), size):
            yield self.signal[start : start + size]

    def waited(self) -> bool:
        return False


def test_windows_settle_in_order_when_an_earlier_one_falls_back() -> None:
    # Four utterances of 20 s, 5 s apart: four windows (two do not fit in 30 s).
    utterance = ((5.0, 0.1), (20.0, 0.9))
    source = PlantedSource(planted(*(utterance * 4), (4.0, 0.1)))
    scheduler = Scheduler(
        [source], lambda i: WindowCutter(DETECTOR, Policy(), source=i), 2, 2, Counters()
    )
    batches = scheduler.batches()
    first = next(batches)
    assert [j.window.index for j in first] == [0, 1]
    scheduler.settle(first, [first[0]])  # window 0 is decoded again; 1 is final
    assert scheduler.events() == []  # 1 waits for 0
    second = next(batches)
    assert [j.window.index for j in second] == [0, 2]  # the retry first
    scheduler.settle(second, [])
    events = scheduler.events()
    assert all(isinstance(e, Settled) for e in events)
    assert [(e.first, e.stop) for e in events] == [(0, 2), (2, 3)]  # 0 and 1 at once, then 2
    third = next(batches)
    assert [j.window.index for j in third] == [3]
    scheduler.settle(third, [])
    settled, finished = scheduler.events()
    assert (settled.first, settled.stop) == (3, 4) and isinstance(finished, Finished)
    assert next(batches, None) is None


# --- the cutter under a latency bound ---------------------------------------------------------


def talk(rounds: int = 16) -> np.ndarray:
    """2 s of speech, 0.6 s pause (shorter than min_silence: one stretch without a bound)."""
    return planted((1.0, 0.1), *(((2.0, 0.9), (0.6, 0.1)) * rounds), (3.0, 0.1))


def live_cut(x: np.ndarray, latency: float | None, waited: bool = True, block: float = 0.5):
    """Windows of x fed as a live input: the clock is the audio read so far (real time)."""
    read = [0]
    cutter = WindowCutter(
        DETECTOR, Policy(), latency=latency, clock=lambda: read[0] / SR, waited=lambda: waited
    )

    def blocks():
        for start in range(0, len(x), round(block * SR)):
            read[0] = min(start + round(block * SR), len(x))
            yield x[start : read[0]]

    out = []
    for window in cutter.cut(blocks(), ticks=True):
        if window is not None:
            out.append((window, read[0] / SR))
    return out


def test_a_due_window_is_cut_at_a_pause_never_inside_speech() -> None:
    x = talk()
    unbounded = [w for w, _ in live_cut(x, None)]
    bounded = live_cut(x, 3.0)
    assert len(unbounded) == 2  # 42 s of one stretch: a split near 30 s
    assert len(bounded) > 6
    covered = np.zeros(len(x) // F, bool)
    for window, emitted_at in bounded:
        first, last = window.first_sample // F, (window.first_sample + len(window.audio)) // F
        # Cut where the map allows: the window begins and ends in a pause.
        assert x[window.first_sample] < 0.5 and x[window.first_sample + len(window.audio) - 1] < 0.5
        assert not covered[first:last].any(), "windows overlap"
        covered[first:last] = True
        # Out within the bound, plus the stretch being spoken then and its tail.
        assert emitted_at - window.ready <= 3.0 + 2.0 + Policy().speech_tail_seconds + 0.5
    speech = x[: len(covered) * F].reshape(-1, F).mean(axis=1) > 0.5
    assert covered[speech].all(), "a speech frame is in no window"


def test_input_that_does_not_make_the_reader_wait_is_cut_as_without_a_bound() -> None:
    x = talk()
    plain = [w for w, _ in live_cut(x, None)]
    fast = [w for w, _ in live_cut(x, 3.0, waited=False)]
    assert [(w.first_sample, len(w.audio)) for w in fast] == [
        (w.first_sample, len(w.audio)) for w in plain
    ]


def test_latency_option_values() -> None:
    assert parse_latency("auto") is None and parse_latency("off") == float("inf")
    assert parse_latency("2.5") == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(Exception, match="invalid --latency"):
            parse_latency(bad)
    assert run_latency(None, live=False) is None and run_latency(None, live=True) == 3.0
    assert run_latency(float("inf"), live=True) is None and run_latency(1.0, live=False) == 1.0


# --- a live pipe ---------------------------------------------------------------------------


def wav_bytes(audio: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, audio, SR, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def feed_pipe(data: bytes, seconds: float) -> int:
    """The read end of a pipe that receives `data` over `seconds`, from a thread."""
    read, write = os.pipe()

    def writer() -> None:
        step = max(1, len(data) // 50)
        with os.fdopen(write, "wb") as f:
            for start in range(0, len(data), step):
                f.write(data[start : start + step])
                f.flush()
                time.sleep(seconds / 50)

    threading.Thread(target=writer, daemon=True).start()
    return read


def test_a_pipe_is_decoded_as_it_arrives_to_the_same_samples() -> None:
    data = wav_bytes(next(open_audio(shared_clip("jfk.flac")).blocks()))
    expected = np.concatenate(list(open_audio("-", stdin=io.BytesIO(data)).blocks()))
    with os.fdopen(feed_pipe(data, 2.0), "rb") as pipe:
        started = time.monotonic()
        source = open_audio("-", stdin=pipe)
        assert source.live and source.info.duration is None
        blocks, arrived = [], []
        for block in source.blocks(0.5):
            blocks.append(block)
            arrived.append(time.monotonic() - started)
    np.testing.assert_array_equal(np.concatenate(blocks), expected)
    assert arrived[0] < 1.5 < arrived[-1], "blocks came only once the pipe had ended"


def test_a_pipe_no_decoder_can_stream_is_read_whole_with_the_same_errors() -> None:
    garbage = feed_pipe(b"this is not audio at all\n" * 100, 0.2)
    with os.fdopen(garbage, "rb") as pipe, pytest.raises(InputError, match="not an audio file"):
        open_audio("-", stdin=pipe)
    with os.fdopen(feed_pipe(b"", 0.0), "rb") as pipe, pytest.raises(InputError, match="no audio"):
        open_audio("-", stdin=pipe)


# --- through the command line -----------------------------------------------------------------

GAP_SECONDS = 3.0
CLIPS = ("jfk.flac", "hotwords.mp3", "stereo_diarization.wav")
SPEED = 4.0  # times real time


@pytest.fixture(scope="module")
def feed(tmp_path_factory) -> tuple[Path, list[tuple[float, float]]]:
    """~90 s of real speech (the shared clips three times, 3 s apart) as 16-bit wav, and
    each clip's (start, end) in it."""
    parts, spans, at = [], [], 0.0
    for _ in range(3):
        for name in CLIPS:
            clip = np.concatenate(list(open_audio(shared_clip(name)).blocks()))
            parts += [clip, np.zeros(round(GAP_SECONDS * SR), np.float32)]
            spans.append((at, at + len(clip) / SR))
            at += len(clip) / SR + GAP_SECONDS
    path = tmp_path_factory.mktemp("feed") / "feed.wav"
    sf.write(path, np.concatenate(parts), SR, subtype="PCM_16")
    return path, spans


def whisper_cli(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("whisper-cli")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "whisper_cli"]
    return [*command, "transcribe", *args, "-m", str(real_model("tiny.en"))]


@dataclasses.dataclass
class Fed:
    lines: list[tuple[float, str]]  # (seconds since start, line) as stdout gave them
    written: list[tuple[float, int]]  # (seconds since start, bytes written so far)
    stderr: str
    code: int

    def when_written(self, n_bytes: int) -> float:
        return next(t for t, n in self.written if n >= n_bytes)


def run_fed(path: Path, *args: str, speed: float = SPEED) -> Fed:
    """The CLI reading `path` from a pipe written at `speed` times real time."""
    data = path.read_bytes()
    proc = subprocess.Popen(
        whisper_cli("-", *args),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    started = time.monotonic()
    written: list[tuple[float, int]] = []
    lines: list[tuple[float, str]] = []
    err: list[bytes] = []

    def feeder() -> None:
        rate = 2 * SR * speed  # bytes a second (16-bit mono)
        step = 3200
        for start in range(0, len(data), step):
            proc.stdin.write(data[start : start + step])
            proc.stdin.flush()
            written.append((time.monotonic() - started, start + step))
            ahead = (start + step) / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
        proc.stdin.close()

    threads = [
        threading.Thread(target=feeder),
        threading.Thread(target=lambda: err.append(proc.stderr.read())),
    ]
    for thread in threads:
        thread.start()
    for raw in proc.stdout:
        lines.append((time.monotonic() - started, raw.decode()))
    code = proc.wait(timeout=600)
    for thread in threads:
        thread.join()
    return Fed(lines, written, err[0].decode(), code)


@pytest.mark.slow
def test_a_piped_feed_prints_text_while_it_flows_in_order_and_complete(feed) -> None:
    path, _ = feed
    fed = run_fed(path, "-f", "jsonl", "-q")
    assert fed.code == 0, fed.stderr
    size = path.stat().st_size
    two_thirds = fed.when_written(size * 2 // 3)
    first = fed.lines[0][0]
    assert first < two_thirds, (
        f"first line at {first:.1f} s, the feeder had written two thirds at {two_thirds:.1f} s"
    )
    assert len({round(t, 1) for t, _ in fed.lines}) > 2, "the lines came at once"
    text = "".join(line for _, line in fed.lines)
    (record,) = jsonl_records(text)
    segments = record["segments"]
    assert [s["id"] for s in segments] == list(range(len(segments)))
    assert [s["start"] for s in segments] == sorted(s["start"] for s in segments)
    # The streamed segments are the whole transcript: its text is theirs, in order.
    assert record["text"] == "".join(s["text"] for s in segments).strip()
    assert text.count("fellow Americans") >= 2  # every repeat of jfk is there


@pytest.mark.slow
def test_a_pipe_read_whole_gives_the_same_bytes_as_the_file(feed) -> None:
    path, _ = feed
    from_file = subprocess.run(whisper_cli(str(path), "-q"), capture_output=True, cwd=REPO)
    assert from_file.returncode == 0, from_file.stderr
    with path.open("rb") as f:  # a pipe that delivers it all at once: cut as the file
        piped = subprocess.run(
            f"cat {path} | " + " ".join(whisper_cli("-", "-q")),
            shell=True,
            stdin=f,
            capture_output=True,
            cwd=REPO,
        )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == from_file.stdout


def one_batch_seconds() -> float:
    """Wall time of one batch here: tiny.en decoding one 11 s window (jfk), warm."""
    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    transcriber = Transcriber(
        load_model(real_model("tiny.en"), resolve_policy("f32", "cpu")), TranscribeOptions()
    )
    transcriber.transcribe(str(shared_clip("jfk.flac")))
    started = time.perf_counter()
    transcriber.transcribe(str(shared_clip("jfk.flac")))
    return time.perf_counter() - started


@pytest.mark.slow
def test_latency_bounds_the_wait_from_speech_to_its_text(feed) -> None:
    path, spans = feed
    bound = 2.0
    fed = run_fed(path, "-f", "jsonl", "-q", "--latency", str(bound))
    assert fed.code == 0, fed.stderr
    decode = one_batch_seconds()
    segments = [
        (t, item) for t, line in fed.lines if (item := json.loads(line))["type"] == "segment"
    ]
    gaps = []
    for start, end in spans[1:]:  # the first waits on the start up (see the test above)
        # The clip's text: the segments that start inside it; out once the last of them is.
        shown = [t for t, s in segments if start - 1.0 <= s["start"] < end]
        assert shown, f"no text for the speech at {start:.1f}-{end:.1f} s"
        written = fed.when_written(int(44 + end * 2 * SR))
        gaps.append(max(shown) - written)
    # A stretch may wait for the decode under way when it is cut, then for its own; and
    # for the quiet that ends it (the tail, 0.4 s of audio) and the audio that arrived
    # during a decode to be read: 1 s for those.
    allowed = bound + 2 * decode + 1.0
    assert max(gaps) <= allowed, (
        f"speech to text took up to {max(gaps):.1f} s (each stretch: "
        f"{', '.join(f'{g:.1f}' for g in gaps)}); the bound is {bound} s and one batch "
        f"decodes here in {decode:.1f} s, so {allowed:.1f} s is allowed"
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt,parse", [("srt", parse_srt), ("vtt", parse_vtt)])
def test_streamed_subtitles_parse_whole(feed, fmt, parse) -> None:
    path, _ = feed
    fed = run_fed(path, "-f", fmt, "-q", "--latency", "1")
    assert fed.code == 0, fed.stderr
    content = "".join(line for _, line in fed.lines)
    cues = parse(content)
    assert len(cues) >= 9
    assert_monotonic(cues)
    assert len({round(t, 1) for t, _ in fed.lines}) > 1, "the cues came at once"


@pytest.mark.slow
def test_an_interrupted_run_leaves_no_partial_file_and_resumes(feed, tmp_path: Path) -> None:
    path, _ = feed
    out = tmp_path / "out"
    args = whisper_cli(str(path), "-o", str(out), "-f", "all", "--batch-size", "1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 300
    while not (out.exists() and any(p.name.endswith(".tmp") for p in out.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, "no output was streaming"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # mid-way: segments are in the temp files
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    # Not even the folder the run created is left (it would hold nothing).
    assert not out.exists() or list(out.iterdir()) == [], "a partial output was left"
    resumed = subprocess.run([*args, "--skip-existing"], capture_output=True, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"feed.{f}" for f in FORMATS)
    again = subprocess.run([*args, "--skip-existing"], capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 0 and "skipping 1 input(s)" in again.stderr
