"""Audio front end: any input file (or stdin) to mono 16 kHz float32 blocks.

Decoding goes through soundfile (libsndfile: wav, flac, ogg, mp3, ...) and falls back to
PyAV (FFmpeg: m4a, aac, opus/webm, mp4, ...) only when libsndfile cannot open the input;
PyAV is imported lazily because most inputs never need it.

Everything streams: the input is read a few seconds at a time, mixed (or one channel
picked), resampled with a *streaming* soxr resampler and re-cut into fixed-size blocks, so
memory stays bounded however long the input is. ``open_audio`` validates the input before
any real work and turns every problem into an ``InputError`` that names the file.

A pipe on stdin is *live*: a thread drains it as the bytes arrive, and
FFmpeg decodes it as it comes, so text can come out while the input still flows. Inputs
FFmpeg cannot read from the front alone (an mp4 whose index is at its end) are read to
their end first and opened like a file; so is a pipe that is not a stream of bytes.

Damaged inputs, one policy for every format: a file whose data ends before the length
its header announces (a recording cut short, a partial download) is decoded as far as it
goes, with one warning that says where it ends; a file damaged in the middle, or with
nothing readable, is an InputError. Samples that are NaN or infinite are replaced by
silence with one warning (an input with no finite sample at all is an InputError).
Those warnings are the source's ``warnings`` (TranscriptWarning, read by the pipeline into
the transcript) once a pass of ``blocks`` has ended; ``load_audio`` also raises them as
Python ``WhisperCliWarning``s. What C decoders print to the process's stderr (libmpg123,
FFmpeg) is captured at the file-descriptor level and reported as a ``DecoderMessage``
Python warning (a debugging aid, not a fault of the input), or inside the InputError when
the read fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import soundfile as sf
import soxr

from whisper_cli.errors import DecoderMessage, InputError, WhisperCliError, WhisperCliWarning
from whisper_cli.results import TranscriptWarning

if TYPE_CHECKING:  # PyAV is imported lazily at run time
    import av

SAMPLE_RATE = 16000
MIN_DURATION = 0.1  # seconds; anything shorter cannot hold a word
STDIN_PATH = "-"

# Inputs are read this many seconds (at their own rate) at a time; it bounds memory for
# any block size the caller asks for, and keeps the per-call Python overhead negligible.
_READ_SECONDS = 5.0
# Frames read from the start and end of a libsndfile input when validating it: seeking to
# the end is cheap and is what exposes a truncated FLAC before any decoding work is done.
# Also the read size when salvaging what precedes the end of a truncated file.
_PROBE_FRAMES = 4096
_CHANNEL_NAMES = {"left": 0, "right": 1}
# What FFmpeg reads of a live pipe before its first frame: up to ~100 KB (3 s of 16 kHz
# 16-bit wav, less for compressed formats), so its probe waits for that much first.
_LIVE_PROBE_BYTES = 1 << 17
# A decode shorter than the header's length by more than this is reported as truncated:
# MP3 (Xing) and AAC lengths are off by encoder delay and padding (a few frames, under
# 0.1 s) and by up to 1% where the encoder estimated them.
_LENGTH_SLACK_SECONDS = 0.1
_LENGTH_SLACK_FRACTION = 0.01
# libsndfile's log of a WAV/AIFF whose data chunk is shorter than its header says, e.g.
# "data : 1940400 (should be 970178)"; a size of 0 or ~4 GiB is a stream's "unknown".
_SHORT_CHUNK = re.compile(r"^(?:data|SSND) : (\d+) \(should be (\d+)\)", re.M)
_UNKNOWN_CHUNK_SIZES = (0, 0xFFFFFFFF)
# File signatures of audio containers: data that starts with one and that no decoder can
# open is damaged audio, not "not an audio file".
_AUDIO_SIGNATURES = ((4, b"ftyp"), (0, b"RIFF"), (0, b"fLaC"), (0, b"OggS"), (0, b"FORM"))

Opener = Callable[[], BinaryIO]


@dataclass(frozen=True)
class AudioInfo:
    """What is known about an input before decoding it."""

    path: str  # as the user named it ("-" for stdin)
    duration: float | None  # seconds; None when the container does not say
    sample_rate: int  # the input's own rate (blocks are always SAMPLE_RATE)
    channels: int  # the input's own channel count (blocks are always mono)


class _DecodeError(Exception):
    """A decoder failed mid-stream; ``blocks`` turns it into an InputError."""


class _Chatter:
    """What C libraries write straight to file descriptor 2 while a decoder call runs.

    libmpg123 prints "[src/libmpg123/layer3.c:...] error: part2_3_length ..." for frames
    it then decodes fine, and "Warning: Xing stream size off ..." for cut files; Python's
    sys.stderr never sees it, so fd 2 itself points at a scratch file during each call
    (one file for the process, emptied after each call: thousands of open inputs must not
    hold a file descriptor each).
    """

    _scratch = None  # the process's scratch file, created at the first capture
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reported = 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with _Chatter._lock, _interrupts_held():
            try:
                saved = os.dup(2)
            except OSError:  # no fd 2 (stderr closed): nothing to capture
                yield
                return
            if _Chatter._scratch is None:
                _Chatter._scratch = tempfile.TemporaryFile()  # noqa: SIM115 - kept open
            scratch = _Chatter._scratch
            with contextlib.suppress(ValueError, OSError):  # our own buffered text first
                sys.stderr.flush()
            os.dup2(scratch.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                scratch.seek(0)
                self._text.append(scratch.read().decode("utf-8", "replace"))
                scratch.seek(0)
                scratch.truncate()

    def lines(self, since_report: bool = False) -> list[str]:
        """Distinct lines captured (in order), with a repeat count when seen more than once."""
        counts: dict[str, int] = {}
        for chunk in self._text[self._reported if since_report else 0 :]:
            for line in chunk.splitlines():
                if line.strip():
                    counts[line.strip()] = counts.get(line.strip(), 0) + 1
        return [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]

    def mark_reported(self) -> None:
        self._reported = len(self._text)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C's Python handler held off while fd 2 is swapped, and run right after.

    A KeyboardInterrupt raised between the swap and its undoing would leave fd 2 pointing
    at the scratch file: every later message (the "interrupted" line too) would vanish.
    Each capture is one decoder call (a few seconds of audio), so the delay is short.
    """
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    held: list[tuple[int, object]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            handler(*held[0])


@dataclass
class _Tally:
    """What one decode pass found, to be reported when it ends."""

    frames: int = 0  # frames decoded, at the input's rate
    nonfinite: int = 0  # frames with a NaN or infinite sample in any channel
    ended_early: bool = False  # a decoder error ended a file that was cut short


class AudioSource:
    """An opened, validated input. ``blocks`` may be called more than once."""

    def __init__(
        self,
        info: AudioInfo,
        backend: str,
        opener: Opener,
        channel: int | None,
        *,
        announced: float | None = None,
        chatter: _Chatter | None = None,
        pipe: _PipeTap | None = None,
    ):
        self.info = info
        self.backend = backend  # "soundfile" or "av": which decoder reads this input
        self._opener = opener
        self._channel = channel  # None: mean of all channels
        # The length the header announces where the data may end before it (see _probe).
        self._announced = announced
        self._chatter = chatter if chatter is not None else _Chatter()
        # Bytes still arriving (a pipe): decoded as they come, its length unknown.
        self._pipe = pipe
        self.live = pipe is not None
        # What the latest complete pass of `blocks` found (truncated, non_finite).
        self.warnings: tuple[TranscriptWarning, ...] = ()

    def __repr__(self) -> str:
        return f"AudioSource({self.info!r}, backend={self.backend!r})"

    def waited(self) -> bool:
        """Whether reading it has waited for bytes to arrive since the last call: a live
        input being read as fast as it comes (never, for a file)."""
        if self._pipe is None:
            return False
        waited, self._pipe.starved = self._pipe.starved, False
        return waited

    def blocks(self, block_seconds: float = 30.0) -> Iterator[np.ndarray]:
        """Yield the audio as float32 mono 16 kHz blocks of ``block_seconds`` (the last shorter).

        Raises InputError if the input turns out to be damaged part way through, or has
        no finite sample; once the pass ends, `warnings` says whether it ended before its
        header says or held NaN/infinite samples (replaced by silence).
        """
        block_size = round(block_seconds * SAMPLE_RATE)
        if block_size < 1:
            raise ValueError(f"block_seconds must be positive, got {block_seconds}")
        read_seconds = min(_READ_SECONDS, block_seconds)  # a small block is read as soon
        read_frames = max(1, round(read_seconds * self.info.sample_rate))
        tally = _Tally()
        if self.backend == "soundfile":
            native = _decode_soundfile(
                self._opener, read_frames, self._chatter, tally, self._announced is not None
            )
        else:
            native = _decode_av(self._opener, read_frames, self._chatter, tally)
        try:
            mono = (_to_mono(block, self._channel) for block in _finite(native, tally))
            yield from _rechunk(_resample(mono, self.info.sample_rate), block_size)
        except _DecodeError as e:
            said = self._chatter.lines(since_report=True)
            detail = f"; the decoder said: {said[-1]}" if said else ""
            raise InputError(self.info.path, f"corrupt or truncated audio ({e}{detail})") from e
        except OSError as e:  # the file changed or vanished since open_audio checked it
            raise InputError(self.info.path, f"cannot be read ({e.strerror or e})") from e
        self._report(tally)

    def _report(self, tally: _Tally) -> None:
        path, rate = self.info.path, self.info.sample_rate
        decoded = tally.frames / rate
        if tally.frames and tally.nonfinite == tally.frames:
            raise InputError(path, "has no finite sample (all are NaN or infinite)")
        found = []
        if tally.nonfinite:
            n = tally.nonfinite
            found.append(
                TranscriptWarning(
                    "non_finite",
                    f"{n} non-finite sample{'s' * (n > 1)} (NaN or infinite) replaced by "
                    f"silence ({_span(n / rate)} of {_span(decoded)})",
                )
            )
        announced = self._announced if self._announced is not None else self.info.duration
        slack = _LENGTH_SLACK_SECONDS + _LENGTH_SLACK_FRACTION * (announced or 0.0)
        if tally.ended_early or (announced and decoded < announced - slack):
            length = f" of the {_span(announced)} its header announces" if announced else ""
            found.append(
                TranscriptWarning(
                    "truncated",
                    f"truncated: the audio ends at {_span(decoded)}{length}; "
                    "transcribed what is there",
                )
            )
        self.warnings = tuple(found)
        said = self._chatter.lines(since_report=True)
        self._chatter.mark_reported()
        if said:
            warnings.warn(
                f"{path}: the decoder said: {' | '.join(said)}", DecoderMessage, stacklevel=2
            )


def open_audio(
    path: str | Path, channel: str | int | None = None, stdin: BinaryIO | None = None
) -> AudioSource:
    """Open and validate one input; ``"-"`` reads stdin (``stdin``, or the process's own).

    ``channel`` is None (mix all channels), ``"left"``, ``"right"`` or a 0-based index.
    Raises InputError for anything wrong with the input, before any decoding work.
    """
    channel_index = parse_channel(channel)
    name = str(path)
    opener = _stdin_opener(stdin) if name == STDIN_PATH else _file_opener(name)
    chatter = _Chatter()
    live = tap = None
    if isinstance(opener, _PipeTap):
        tap = opener
        live = _probe_live(name, tap, chatter)
        opener = tap.reader if live is not None else _whole(name, tap)
    if live is not None:
        info, backend, announced = live, "av", None
    else:
        info, backend, announced = _probe(name, opener, chatter)
    if channel_index is not None and channel_index >= info.channels:
        raise InputError(name, _missing_channel(channel, info.channels))
    return AudioSource(
        info,
        backend,
        opener,
        channel_index,
        announced=announced,
        chatter=chatter,
        pipe=tap if live is not None else None,
    )


def load_audio(path: str | Path, channel: str | int | None = None) -> np.ndarray:
    """Decode a whole input to one float32 mono 16 kHz array (convenience; not streaming);
    the source's warnings are raised as WhisperCliWarning."""
    source = open_audio(path, channel)
    blocks = list(source.blocks())
    for found in source.warnings:
        warnings.warn(f"{source.info.path}: {found.message}", WhisperCliWarning, stacklevel=2)
    return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)


# --- opening ---------------------------------------------------------------------------


def parse_channel(channel: str | int | None) -> int | None:
    """The 0-based channel index of a --channel value (None: mix); a usage error if invalid."""
    if channel is None:
        return None
    if isinstance(channel, str):
        key = channel.strip().lower()
        if key in _CHANNEL_NAMES:
            return _CHANNEL_NAMES[key]
        if key.isdigit():
            return int(key)
    elif isinstance(channel, int) and not isinstance(channel, bool) and channel >= 0:
        return channel
    raise WhisperCliError(f"invalid channel {channel!r}: use 'left', 'right' or a 0-based index")


def _missing_channel(channel: str | int | None, channels: int) -> str:
    named = isinstance(channel, str) and channel.strip().lower() in _CHANNEL_NAMES
    what = f"{channel.strip().lower()} channel" if named else f"channel {channel}"
    have = "mono audio" if channels == 1 else f"it has {channels} channels"
    return f"has no {what} ({have})"


def _stdin_opener(stdin: BinaryIO | None) -> Opener | _PipeTap:
    # Pipes cannot seek, and libsndfile and FFmpeg's probes of some formats need to: what
    # is read is held in memory (the price of reading from a pipe), and a pipe is decoded
    # live where FFmpeg can (see the module doc).
    stream = stdin if stdin is not None else sys.stdin.buffer
    stream = getattr(stream, "buffer", stream)  # a text-mode stdin still has bytes below
    if _is_pipe(stream):
        return _PipeTap(STDIN_PATH, stream)
    try:
        data = stream.read()
    except OSError as e:
        raise InputError(STDIN_PATH, f"cannot be read ({e.strerror or e})") from None
    if not data:
        raise InputError(STDIN_PATH, "contains no audio")
    return lambda: io.BytesIO(data)


def _is_pipe(stream: BinaryIO) -> bool:
    """A FIFO or socket (a shell pipe, a named pipe): bytes that arrive over time."""
    import stat

    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, io.UnsupportedOperation, AttributeError):
        return False  # an in-memory stream (a library caller's BytesIO): read at once
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class _PipeTap:
    """Every byte read from a pipe so far, read by a thread as it arrives.

    Readers (`reader()`) start at byte 0 and block until the bytes they ask for have
    arrived (or the pipe has ended), so the input can be decoded more than once, as a
    file can. The bytes are held, as a pipe read to its end would be.
    """

    _CHUNK = 1 << 16

    def __init__(self, name: str, stream: BinaryIO) -> None:
        self.name = name
        self._data = bytearray()
        self._ended = False
        self.starved = False  # a reader waited for bytes (cleared by AudioSource.waited)
        self._error: OSError | None = None
        self._cond = threading.Condition()
        self._stream = stream
        threading.Thread(target=self._drain, name="whisper-cli-pipe", daemon=True).start()

    def _drain(self) -> None:
        read = getattr(self._stream, "read1", self._stream.read)
        try:
            while chunk := read(self._CHUNK):
                with self._cond:
                    self._data += chunk
                    self._cond.notify_all()
        except OSError as e:
            self._error = e
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, size: int) -> int:
        """Block until `size` bytes have arrived or the pipe has ended; the bytes there."""
        with self._cond:
            if not (self._ended or len(self._data) >= size):
                self.starved = True
                self._cond.wait_for(lambda: self._ended or len(self._data) >= size)
            if self._error is not None and len(self._data) < size:
                raise InputError(
                    self.name, f"cannot be read ({self._error.strerror or self._error})"
                )
            return len(self._data)

    def slice(self, start: int, size: int) -> bytes:
        with self._cond:
            return bytes(self._data[start : start + size])

    def whole(self) -> bytes:
        """Every byte of the pipe, once it has ended."""
        self.wait(1 << 62)
        return self.slice(0, len(self._data))

    def reader(self) -> _TapReader:
        return _TapReader(self)


class _TapReader:
    """A forward-only reader of a _PipeTap (no `seek`: FFmpeg then reads it as a stream)."""

    # Bytes that must have arrived past the position before a decoder call: the call then
    # rarely waits on the pipe while fd 2 is captured and Ctrl-C held (see _Chatter).
    AHEAD = 1 << 13

    def __init__(self, tap: _PipeTap) -> None:
        self.tap = tap
        self.pos = 0

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes, as soon as any have arrived; all the rest if size < 0."""
        if size is None or size < 0:
            got = self.tap.wait(1 << 62)  # to the pipe's end
            size = got - self.pos
        got = self.tap.wait(self.pos + 1)
        chunk = self.tap.slice(self.pos, min(size, got - self.pos))
        self.pos += len(chunk)
        return chunk

    def prefetch(self) -> None:
        self.tap.wait(self.pos + self.AHEAD)

    def __enter__(self) -> _TapReader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _probe_live(name: str, tap: _PipeTap, chatter: _Chatter) -> AudioInfo | None:
    """The input's rate and channels if FFmpeg decodes it from the front as it arrives;
    None if it cannot (it is then read whole and probed like a file)."""
    if tap.wait(1) == 0:
        raise InputError(name, "contains no audio")
    import av

    reader = tap.reader()
    tap.wait(_LIVE_PROBE_BYTES)  # outside the capture: Ctrl-C is not held while it waits
    try:
        with _open_av(reader, chatter) as container:
            if not container.streams.audio:
                return None
            with chatter.capture():
                rate, channels = _first_frames(name, container, container.streams.audio[0])
    except (av.FFmpegError, InputError):
        return None
    return AudioInfo(name, None, rate, channels)


def _whole(name: str, tap: _PipeTap) -> Opener:
    data = tap.whole()
    if not data:
        raise InputError(name, "contains no audio")
    return lambda: io.BytesIO(data)


def _file_opener(name: str) -> Opener:
    if os.path.isdir(name):
        raise InputError(name, "is a directory")
    try:
        f = open(name, "rb")  # noqa: SIM115 - closed below, or kept only to read a pipe
    except FileNotFoundError:
        raise InputError(name, "no such file") from None
    except IsADirectoryError:
        raise InputError(name, "is a directory") from None
    except PermissionError:
        raise InputError(name, "permission denied") from None
    except OSError as e:
        raise InputError(name, f"cannot be read ({e.strerror or e})") from None
    with f:
        if not f.seekable():  # a named pipe or /dev/stdin: read it once, like stdin
            data = f.read()
            if not data:
                raise InputError(name, "contains no audio")
            return lambda: io.BytesIO(data)
        if os.fstat(f.fileno()).st_size == 0:
            raise InputError(name, "contains no audio")
    return lambda: open(name, "rb")


@dataclass(frozen=True)
class _Rejected:
    """Why a decoder could not open an input."""

    reason: str
    recognised: bool  # the decoder knew the format, so the data must be damaged


def _probe(name: str, opener: Opener, chatter: _Chatter) -> tuple[AudioInfo, str, float | None]:
    """Find a decoder for the input and check it decodes; raise InputError if none does.

    Also returns the length the header announces when the data is known to end before
    it (None otherwise), so that the decode can say the file was truncated.
    """
    with chatter.capture():
        first = _probe_soundfile(name, opener)
    if isinstance(first, tuple):
        return first[0], "soundfile", first[1]
    with chatter.capture():
        second = _probe_av(name, opener)
    if isinstance(second, AudioInfo):
        return second, "av", None
    said = chatter.lines()
    detail = f"; the decoder said: {said[-1]}" if said else ""
    # libsndfile knows its formats' headers well: when it recognised the format but could
    # not read it (and FFmpeg could not either), the file is damaged, not something else.
    for rejected in (first, second):
        if rejected.recognised:
            raise InputError(name, f"corrupt or truncated audio ({rejected.reason}{detail})")
    if _has_audio_signature(opener):
        reason = "no decoder can read it: its index or data is missing or damaged"
        raise InputError(name, f"corrupt or truncated audio ({reason}{detail})")
    raise InputError(name, f"not an audio file ({second.reason})")


def _has_audio_signature(opener: Opener) -> bool:
    with opener() as fobj:
        head = fobj.read(12)
    return any(head[at : at + len(magic)] == magic for at, magic in _AUDIO_SIGNATURES)


def _probe_soundfile(name: str, opener: Opener) -> tuple[AudioInfo, float | None] | _Rejected:
    with opener() as fobj:
        try:
            f = sf.SoundFile(fobj)
        except sf.SoundFileError as e:
            return _Rejected(*_soundfile_problem(e))
        with f:
            _check_length(name, f.frames, f.samplerate)
            tail_readable = _check_head_and_tail(name, f)
            info = AudioInfo(name, f.frames / f.samplerate, f.samplerate, f.channels)
            announced = None if tail_readable else info.duration
            short = _SHORT_CHUNK.search(f.extra_info)
            if short and int(short.group(1)) not in _UNKNOWN_CHUNK_SIZES:
                # libsndfile shortened a WAV/AIFF data chunk to what the file holds.
                announced = info.duration * int(short.group(1)) / max(int(short.group(2)), 1)
            return info, announced


def _check_head_and_tail(name: str, f: sf.SoundFile) -> bool:
    """Decode a little at both ends: cheap, and exposes a garbled or truncated file.

    A garbled head is an InputError; returns whether the tail could be read (a file
    whose tail cannot be reached was cut short: it is decoded as far as it goes).
    """
    n = min(f.frames, _PROBE_FRAMES)
    try:
        f.read(n, dtype="float32")
    except sf.SoundFileError as e:
        reason = _soundfile_problem(e)[0]
        raise InputError(name, f"corrupt or truncated audio ({reason})") from None
    # MP3 frame counts are estimates and its seeks are fuzzy, so its tail proves nothing.
    if f.frames <= 2 * n or f.format == "MP3":
        return True
    try:
        f.seek(f.frames - n)
        f.read(n, dtype="float32")
    except sf.SoundFileError:
        return False
    return True


def _soundfile_problem(e: sf.SoundFileError) -> tuple[str, bool]:
    """libsndfile's reason, cleaned up, and whether it recognised the format."""
    text = getattr(e, "error_string", None) or str(e)
    text = text.removeprefix("Error : ").strip().rstrip(".")
    if "Format not recognised" in text:
        return "format not recognised", False
    if "not a regular file" in text:  # what libsndfile says when a header parses, data not
        return "unreadable data", True
    return text[:1].lower() + text[1:], True


def _probe_av(name: str, opener: Opener) -> AudioInfo | _Rejected:
    import av  # lazily: only inputs libsndfile cannot read need FFmpeg

    with opener() as fobj:
        try:
            # Undecodable tags must not reject audio that decodes fine.
            container = av.open(fobj, mode="r", metadata_errors="ignore")
        except av.FFmpegError as e:
            if isinstance(e, av.InvalidDataError):  # no demuxer recognised the data
                return _Rejected("format not recognised", False)
            return _Rejected(_av_problem(e), True)
        with container:
            if not container.streams.audio:
                return _no_audio_stream(name, container)
            stream = container.streams.audio[0]
            try:
                rate, channels = _first_frames(name, container, stream)
            except av.FFmpegError as e:
                raise InputError(name, f"corrupt or truncated audio ({_av_problem(e)})") from None
            return AudioInfo(name, _av_duration(container, stream), rate, channels)


def _no_audio_stream(name: str, container: av.container.InputContainer) -> _Rejected:
    fmt = container.format.name
    if fmt.endswith("_pipe") or fmt == "image2":  # FFmpeg opens pictures as 1-frame video
        return _Rejected("an image", False)
    if not container.streams:
        return _Rejected(f"no streams in the {fmt} data", False)
    raise InputError(name, "has no audio stream")


def _first_frames(
    name: str, container: av.container.InputContainer, stream: av.AudioStream
) -> tuple[int, int]:
    """Decode the first MIN_DURATION of audio: proves it decodes; gives rate and channels.

    Taken from decoded frames, not the header, which some containers leave incomplete.
    """
    rate = channels = decoded = 0
    for frame in container.decode(stream):
        if not rate:
            rate, channels = frame.sample_rate, frame.layout.nb_channels
        decoded += frame.samples
        if decoded >= MIN_DURATION * rate:
            return rate, channels
    _check_length(name, decoded, rate or 1)
    return rate, channels


def _av_duration(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # container durations are in AV_TIME_BASE
    return None


def _av_problem(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e)
    return text[:1].lower() + text[1:]


def _check_length(name: str, frames: int, rate: int) -> None:
    if frames <= 0:
        raise InputError(name, "contains no audio")
    seconds = frames / rate
    if seconds < MIN_DURATION:
        raise InputError(
            name, f"audio is too short ({seconds:.2f} s; at least {MIN_DURATION:g} s needed)"
        )


def _span(seconds: float) -> str:
    """A length as people read it: 0.06 ms, 12 ms, 3.5 s, 11.0 s."""
    if seconds < 0.001:
        return f"{seconds * 1000:.2f} ms"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s"


# --- decoding: each yields float32 arrays of shape (frames, channels) at the input's rate ---


def _decode_soundfile(
    opener: Opener, read_frames: int, chatter: _Chatter, tally: _Tally, truncated: bool
) -> Iterator[np.ndarray]:
    """``truncated``: the probe found the data ends before the header says; a decoder
    error there is that end (what precedes it is salvaged), anywhere else it is damage."""
    done = 0  # frames decoded, to say where a damaged file breaks
    rate = 1
    try:
        with opener() as fobj, _open_soundfile(fobj, chatter) as f:
            rate = f.samplerate
            for block in _soundfile_blocks(f, read_frames, chatter):
                done += len(block)
                yield block
            return
    except sf.SoundFileError as e:
        if not truncated:
            raise _DecodeError(f"{_soundfile_problem(e)[0]} after {done / rate:.1f} s") from e
    # The failed read lost up to read_frames before the end: read them again, in small steps.
    with opener() as fobj, _open_soundfile(fobj, chatter) as f:
        f.seek(done)
        with contextlib.suppress(sf.SoundFileError):
            yield from _soundfile_blocks(f, _PROBE_FRAMES, chatter)
    tally.ended_early = True


def _open_soundfile(fobj: BinaryIO, chatter: _Chatter) -> sf.SoundFile:
    with chatter.capture():  # libmpg123 speaks when it reads the header
        return sf.SoundFile(fobj)


def _soundfile_blocks(f: sf.SoundFile, frames: int, chatter: _Chatter) -> Iterator[np.ndarray]:
    """Blocks of up to ``frames`` frames from where ``f`` is to its end (what the
    decoder says while reading goes to ``chatter``)."""
    while True:
        with chatter.capture():
            block = f.read(frames, dtype="float32", always_2d=True)
        if not len(block):
            return
        yield block


def _decode_av(
    opener: Opener, read_frames: int, chatter: _Chatter, tally: _Tally
) -> Iterator[np.ndarray]:
    import av

    done = 0.0  # seconds decoded, to say where a damaged file breaks
    pending: list[np.ndarray] = []
    try:
        with opener() as fobj, _open_av(fobj, chatter) as container:
            converter: av.AudioResampler | None = None
            count = 0
            frames = container.decode(container.streams.audio[0])
            while True:
                if isinstance(fobj, _TapReader):
                    fobj.prefetch()  # wait for the pipe outside the capture
                with chatter.capture():
                    frame = next(frames, None)
                if frame is None:
                    break
                if converter is None:
                    # Planar float at the first frame's rate and layout: a mid-stream change
                    # of layout or rate is converted back, so every block has the same shape.
                    converter = av.AudioResampler("fltp", frame.layout, frame.sample_rate)
                for out in converter.resample(frame):
                    pending.append(out.to_ndarray())
                    count += out.samples
                if count >= read_frames:
                    yield _join_planar(pending)
                    done += count / frame.sample_rate
                    pending, count = [], 0
            if converter is not None:
                pending.extend(out.to_ndarray() for out in converter.resample(None))
    except av.FFmpegError as e:
        # FFmpeg skips damaged packets on its own; an error that reaches here means the
        # stream cannot go on (data cut short, index pointing past the end): its end.
        if not pending and not done:
            raise _DecodeError(f"{_av_problem(e)} after {done:.1f} s") from e
        tally.ended_early = True
    if pending:
        yield _join_planar(pending)


def _open_av(fobj: BinaryIO, chatter: _Chatter) -> av.container.InputContainer:
    import av

    with chatter.capture():
        return av.open(fobj, mode="r", metadata_errors="ignore")


def _join_planar(planes: list[np.ndarray]) -> np.ndarray:
    # fltp frames are (channels, samples); the rest of the pipeline wants (frames, channels).
    return np.concatenate(planes, axis=1).T


# --- sanitising, mixing, resampling, re-blocking ------------------------------------------


def _finite(blocks: Iterable[np.ndarray], tally: _Tally) -> Iterator[np.ndarray]:
    """Blocks with NaN and infinite samples replaced by silence (counted in ``tally``).

    Resampling would spread one such sample over its whole neighbourhood, and the
    log-mel of a window holding one is NaN: the whole window would be lost.
    """
    for block in blocks:  # (frames, channels)
        tally.frames += len(block)
        bad = ~np.isfinite(block)
        if bad.any():
            tally.nonfinite += int(bad.any(axis=1).sum())
            block = np.where(bad, np.float32(0.0), block)
        yield block


def _to_mono(block: np.ndarray, channel: int | None) -> np.ndarray:
    if channel is not None:
        return np.ascontiguousarray(block[:, channel], dtype=np.float32)
    if block.shape[1] == 1:
        return np.ascontiguousarray(block[:, 0], dtype=np.float32)
    return block.mean(axis=1, dtype=np.float32)


def _resample(blocks: Iterable[np.ndarray], rate: int) -> Iterator[np.ndarray]:
    if rate == SAMPLE_RATE:
        yield from blocks
        return
    # One stream for the whole input: its filter state carries across blocks, so the output
    # is identical to resampling the whole signal at once (no clicks at block edges).
    stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
    for block in blocks:
        out = stream.resample_chunk(block, last=False)
        if len(out):
            yield out
    tail = stream.resample_chunk(np.zeros(0, np.float32), last=True)
    if len(tail):
        yield tail


def _rechunk(blocks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """Re-cut a stream of 1-D arrays into arrays of exactly ``size`` samples (last shorter)."""
    pending: list[np.ndarray] = []
    count = 0
    for block in blocks:
        pending.append(block)
        count += len(block)
        if count < size:
            continue
        joined = np.concatenate(pending)
        whole = len(joined) - len(joined) % size
        for start in range(0, whole, size):
            yield joined[start : start + size].copy()  # a copy frees `joined` when done
        pending = [joined[whole:].copy()]
        count = len(pending[0])
    if count:
        yield np.concatenate(pending)
