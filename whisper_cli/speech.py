"""Where speech is: the Silero VAD network, and a per-input speech map (probability per frame).

The network is our own small module over the weights of the MIT-licensed `silero-vad`
wheel's default model, read from the installed package and never from a hub. The package
itself is not imported: `import silero_vad` calls `torch.set_num_threads(1)`, which would
halve the CPU path of the whole run.

Silero scores 32 ms frames (512 samples at 16 kHz), each seen with the 64 samples before
it, through a small conv front end and an LSTM whose state runs through the input. Here
the front end (its learned STFT taken by FFT where its filters are a windowed DFT, as
the shipped model's are) runs over every frame of a block at once and the LSTM over the whole
block as one sequence (one fused kernel call), with the context and LSTM state carried
from block to block, so the map of an input of any length is computed as it streams.
It runs in float32 whatever the run's dtype (a listed exception in dtypes.py). A quiet
input is scored at a gain (LevelGain) that brings it to the level Silero scores well, and
a quiet stretch after a loud one is heard again from a fresh state (QuietSection).
"""

from __future__ import annotations

import importlib.metadata
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from whisper_cli.archive import read_tensors
from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.errors import WhisperCliError

FRAME_SAMPLES = 512  # one speech-map frame: 32 ms
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
CONTEXT_SAMPLES = 64  # each frame is scored with the 64 samples before it
# A level the input holds this many frames (96 ms) sets the detector's gain (LevelGain).
SUSTAIN_FRAMES = 3
# The room's level: the least frame peak over this many frames (3 s) (QuietSection).
ROOM_FRAMES = 94
# The release whose weights and thresholds the policy was calibrated with (pinned in
# pyproject.toml: Silero's thresholds change between major versions).
SILERO_PACKAGE = "silero-vad"
# The package's default model (what `load_silero_vad()` returns). Its weights are read
# from the TorchScript archive: the wheel's silero_vad_16k.safetensors holds other weights
# (only the STFT basis is the same) and does not reproduce the default model.
SILERO_ARCHIVE = "silero_vad/data/silero_vad.jit"
# Archive names (16 kHz model) -> ours.
_NAMES = {
    "_model.stft.forward_basis_buffer": "stft_conv.weight",
    **{
        f"_model.encoder.{i}.reparam_conv.{w}": f"conv{i + 1}.{w}"
        for i in range(4)
        for w in ("weight", "bias")
    },
    **{
        f"_model.decoder.rnn.{w}": f"lstm.{w}_l0"
        for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    },
    "_model.decoder.decoder.2.weight": "final_conv.weight",
    "_model.decoder.decoder.2.bias": "final_conv.bias",
}


class SileroVAD(nn.Module):
    """Silero VAD v5/v6 (16 kHz): frames of 512 samples (+64 of context) -> P(speech)."""

    def __init__(self) -> None:
        super().__init__()
        # A learned STFT: 129 real and 129 imaginary filters of 256 samples, hop 128.
        self.stft_conv = nn.Conv1d(1, 258, kernel_size=256, stride=128, bias=False)
        self.conv1 = nn.Conv1d(129, 128, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, kernel_size=3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, kernel_size=3, padding=1)
        self.lstm = nn.LSTM(128, 128, batch_first=True)
        self.final_conv = nn.Conv1d(128, 1, kernel_size=1)
        # The window when the STFT filters are a windowed DFT (set by load_detector).
        self.dft_window: torch.Tensor | None = None

    def forward(
        self, frames: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """frames (N, 576): consecutive frames with their context -> (N,) probs, new state.

        Each frame's convolutions see only 4, 2 and 1 time steps, where Conv1d's per-call
        overhead dominates: they run as one matmul each over the unfolded taps (3x faster
        on CPU), with the checkpoint's Conv1d weights.
        """
        n = frames.shape[0]
        x = F.pad(frames, (0, 64), mode="reflect")  # (N, 640)
        if self.dft_window is not None:
            # The same magnitudes by FFT: a 256-point real FFT per tap instead of a GEMM
            # against 258 filters and four passes over their outputs (hypot of the parts
            # in one pass: complex abs() took 58 ms over 10 min of frames, hypot 32).
            spectrum = torch.view_as_real(torch.fft.rfft(x.unfold(1, 256, 128) * self.dft_window))
            x = torch.hypot(spectrum[..., 0], spectrum[..., 1])  # (N, 4, 129)
        else:
            # The overlapping taps copied out as (4N, 256) rows, for one GEMM: over the
            # strided (N, 4, 256) view, matmul runs a batched GEMM with a copy per frame.
            taps = x.unfold(1, 256, 128).reshape(-1, 256)  # (4N, 256)
            x = (taps @ self.stft_conv.weight[:, 0].T).view(n, 4, -1)  # (N, 4, 258)
            x = (x[..., :129] ** 2 + x[..., 129:] ** 2).sqrt()  # magnitudes (N, 4, 129)
        x = _conv(x, self.conv1, stride=1)  # (N, 4, 128)
        x = _conv(x, self.conv2, stride=2)  # (N, 2, 64)
        x = _conv(x, self.conv3, stride=2)  # (N, 1, 64)
        x = _conv(x, self.conv4, stride=1)[:, 0]  # (N, 128)
        h, state = self.lstm(x[None], state)  # the frames as one sequence: (1, N, 128)
        p = torch.sigmoid(F.relu(h[0]) @ self.final_conv.weight[:, :, 0].T + self.final_conv.bias)
        return p[:, 0], state


def _conv(x: torch.Tensor, conv: nn.Conv1d, stride: int) -> torch.Tensor:
    """ReLU(conv(x)) for a kernel-3, padding-1 Conv1d, time-major: (N, T, C) -> (N, T', C')."""
    taps = F.pad(x, (0, 0, 1, 1)).unfold(1, 3, stride)  # (N, T', C, 3)
    w = conv.weight.reshape(conv.out_channels, -1)  # (C', C * 3), same (C, tap) order
    return F.relu(taps.flatten(2) @ w.T + conv.bias)


def dft_window(filters: torch.Tensor) -> torch.Tensor | None:
    """The window w when the STFT's (258, 1, 256) filters are cos(2 pi k n / 256) w[n] and
    -sin(2 pi k n / 256) w[n], k = 0..128, to float32 rounding (Silero v5/v6: a periodic
    Hann window); None otherwise. w is the first filter (k = 0), as the checkpoint holds it."""
    f = filters[:, 0].double()  # (258, 256)
    size = f.shape[1]
    if f.shape[0] != 2 * (size // 2 + 1):
        return None
    window = f[0]
    k, t = torch.arange(size // 2 + 1, dtype=torch.float64), torch.arange(size, dtype=torch.float64)
    angle = 2 * torch.pi * torch.outer(k, t) / size
    dft = torch.cat([torch.cos(angle), -torch.sin(angle)]) * window
    return filters[0, 0].detach().clone() if torch.allclose(f, dft, rtol=0, atol=1e-6) else None


def silero_archive_path() -> Path:
    """The default model's file in the installed silero-vad wheel (no import, no hub)."""
    try:
        dist = importlib.metadata.distribution(SILERO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise WhisperCliError(
            "the speech detector needs the silero-vad package (pip install silero-vad), "
            "or run with --no-vad"
        ) from None
    path = Path(str(dist.locate_file(SILERO_ARCHIVE)))
    if not path.is_file():
        raise WhisperCliError(f"silero-vad {dist.version} has no {SILERO_ARCHIVE}")
    return path


def load_detector(path: Path | None = None) -> SileroVAD:
    """The detector in float32 on the CPU, strictly loaded from the wheel's default model
    (its weights read from the archive without TorchScript: archive.py)."""
    weights = read_tensors(path or silero_archive_path(), tuple(_NAMES))
    state = {ours: weights[theirs] for theirs, ours in _NAMES.items()}
    model = SileroVAD()
    model.load_state_dict(state, strict=True)
    model.dft_window = dft_window(model.stft_conv.weight)
    return model.eval().requires_grad_(False)


@dataclass
class HeldLevel:
    """The level an input holds: `now`, the least peak of its last SUSTAIN_FRAMES frames
    (0 until it has that many), and `loudest`, the highest `now` so far. A click (one
    loud frame) is not held; a syllable is."""

    now: float = 0.0
    loudest: float = 0.0
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=SUSTAIN_FRAMES))

    def push(self, peak: float) -> None:
        self._recent.append(peak)
        self.now = min(self._recent) if len(self._recent) == SUSTAIN_FRAMES else 0.0
        self.loudest = max(self.loudest, self.now)


@dataclass
class LevelGain:
    """The gain a frame is scored at, from it and the frames before it (causal, so the
    map is the same whatever blocks the audio arrives in, and waits for nothing):
    `target` over the loudest level the input has held so far, at least 1 and at most
    `max_gain`, and never more than brings the frame's own peak to `target`.

    A level is "held" where it lasts SUSTAIN_FRAMES frames (the least peak among them):
    a click does not set the gain of the rest of the input, a syllable does. With an
    input at an ordinary level the gain is 1 once its first sound has been heard; frames
    before it are brought up to at most `target`, as a louder recording of the same room
    would be.
    """

    target: float
    max_gain: float
    _level: HeldLevel = field(default_factory=lambda: HeldLevel())

    @classmethod
    def from_dbfs(cls, target_dbfs: float, max_gain_db: float) -> LevelGain:
        return cls(10 ** (target_dbfs / 20), 10 ** (max_gain_db / 20))

    def of(self, peaks: np.ndarray) -> np.ndarray:
        """(N,) float32 gains of the next N frames, given their peaks; advances the state."""
        gains = np.empty(len(peaks), np.float32)
        for i, peak in enumerate(peaks.tolist()):
            self._level.push(peak)
            level = max(self._level.loudest, peak)
            gains[i] = min(self.max_gain, max(1.0, self.target / level)) if level else self.max_gain
        return gains


@dataclass
class QuietSection:
    """Where an input has fallen far below its loudest level: a quiet voice after loud
    music or after a near voice. Silero's state remembers a loud level for seconds
    (jfk.flac 19 dB under a chord that ends 1 s before it: none of its speech found; at
    the chord's level, or heard with a fresh state, all of it), and LevelGain, which
    follows the loudest level so far, does not lift it. So such a section is heard a
    second time, by a detector state started fresh at the section's own gain
    (SpeechStream), and what that second hearing calls speech is added to the map.

    A section opens at a sound (a level held SUSTAIN_FRAMES frames, at least `above_room`
    over the room: the least frame peak of the last ROOM_FRAMES) once the input has been
    `drop` or more below its loudest level for `hold_frames`; it closes where the input
    comes back within `drop` of its loudest. A pause inside speech at one level opens
    nothing (what follows it is not far below the loudest), nor does the room in a pause
    (not above itself). Causal and per frame, as LevelGain.
    """

    drop: float  # a factor > 1
    hold_frames: int
    above_room: float  # a factor >= 1
    _level: HeldLevel = field(default_factory=lambda: HeldLevel())
    _quiet: int = 0  # frames since the input was last within `drop` of its loudest
    _open: bool = False
    _room: deque[float] = field(default_factory=lambda: deque(maxlen=ROOM_FRAMES))

    @classmethod
    def from_db(cls, drop_db: float, hold_seconds: float, above_room_db: float) -> QuietSection:
        return cls(
            drop=10 ** (drop_db / 20),
            hold_frames=round(hold_seconds / FRAME_SECONDS),
            above_room=10 ** (above_room_db / 20),
        )

    def of(self, peaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N,) bool frames inside a section and (N,) bool frames that open one, for the
        next N frames, given their peaks; advances the state."""
        inside = np.zeros(len(peaks), bool)
        opens = np.zeros(len(peaks), bool)
        for i, peak in enumerate(peaks.tolist()):
            self._level.push(peak)
            self._room.append(peak)
            now = self._level.now
            if now * self.drop > self._level.loudest:
                self._quiet, self._open = 0, False
            else:
                self._quiet += 1
                waited = not self._open and self._quiet >= self.hold_frames and now > 0
                # A sound, not the room (whose least peak is looked up only then).
                if waited and now >= min(self._room) * self.above_room:
                    self._open = opens[i] = True
            inside[i] = self._open
        return inside, opens


@dataclass
class SpeechStream:
    """The speech map of one input, computed block by block as its audio streams.

    `push` takes 16 kHz mono samples and returns the probabilities of the frames they
    complete; `finish` scores the last partial frame (zero-padded, as Silero does).
    `probs` holds every frame's probability so far (4 bytes per 32 ms: 450 KB an hour).

    The detector hears a quiet input at a level it was trained on: Silero's speech
    probability falls with the level (jfk.flac's speech frames: 68% at its own peak of
    -2 dBFS, 41% at -40, none at -50), while Whisper still writes every word at -70. So a
    frame is scored at `level_gain` (see there): 1 wherever the input has been loud
    enough, more where all of it so far has been quiet. None: the input as it is.

    Inside a `quiet` section (see QuietSection) the frames are also scored by a second
    detector state, started fresh where the section opens, at a gain of the section's
    own (a fresh copy of `level_gain`); where it calls `min_run` frames running speech
    (at `threshold`), those frames take the higher of the two probabilities. So it adds
    speech, never removes any, and a breath or a click (shorter) adds nothing. None: no
    second hearing.
    """

    detector: SileroVAD
    level_gain: LevelGain | None = None
    quiet: QuietSection | None = None
    threshold: float = 0.5
    min_run: int = 8
    probs: list[np.ndarray] = field(default_factory=list)
    _pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    _context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT_SAMPLES, np.float32))
    _state: tuple[torch.Tensor, torch.Tensor] | None = None
    _quiet_state: tuple[torch.Tensor, torch.Tensor] | None = None
    _quiet_gain: LevelGain | None = None
    _quiet_run: int = 0  # frames the second hearing has called speech, running
    samples: int = 0  # samples pushed
    seconds: float = 0.0  # wall time spent scoring

    def push(self, audio: np.ndarray) -> np.ndarray:
        self.samples += len(audio)
        data = np.concatenate([self._pending, audio.astype(np.float32, copy=False)])
        n = len(data) // FRAME_SAMPLES
        self._pending = data[n * FRAME_SAMPLES :]
        return self._score(data[: n * FRAME_SAMPLES])

    def finish(self) -> np.ndarray:
        if not len(self._pending):
            return np.zeros(0, np.float32)
        tail = np.zeros(FRAME_SAMPLES, np.float32)
        tail[: len(self._pending)] = self._pending
        self._pending = np.zeros(0, np.float32)
        return self._score(tail)

    def _score(self, data: np.ndarray) -> np.ndarray:
        n = len(data) // FRAME_SAMPLES
        if n == 0:
            return np.zeros(0, np.float32)
        with_context = np.concatenate([self._context, data])
        # Frame i with its context: samples [i*512, i*512 + 576) of with_context.
        frames = np.lib.stride_tricks.sliding_window_view(
            with_context, FRAME_SAMPLES + CONTEXT_SAMPLES
        )[::FRAME_SAMPLES]
        self._context = with_context[-CONTEXT_SAMPLES:].copy()
        started = time.perf_counter()
        with torch.inference_mode():
            x = torch.from_numpy(frames.copy())  # (N, 576), a writable copy of the strided view
            peaks = np.abs(data.reshape(n, FRAME_SAMPLES)).max(axis=1)
            scored = x
            if self.level_gain is not None:
                scored = x * torch.from_numpy(self.level_gain.of(peaks))[:, None]
            probs, self._state = self.detector(scored, self._state)
            if self.quiet is not None:
                self._hear_quiet(x, peaks, probs)
        self.seconds += time.perf_counter() - started
        out = probs.numpy().astype(np.float32)
        self.probs.append(out)
        return out

    def _hear_quiet(self, x: torch.Tensor, peaks: np.ndarray, probs: torch.Tensor) -> None:
        """Score the frames inside a quiet section again (see the class doc) and raise
        `probs` (N,) where that hearing has run speech for `min_run` frames."""
        inside, opens = self.quiet.of(peaks)
        if not inside.any():
            self._quiet_run = 0
            return
        again = np.zeros(len(peaks), np.float32)
        # Spans of frames inside, each cut where a section opens (a section opens only
        # after the one before has closed, so a span is one section's).
        edges = np.flatnonzero(np.diff(np.concatenate([[0], inside.astype(np.int8), [0]])))
        for first, end in zip(edges[::2], edges[1::2], strict=True):
            if opens[first]:
                self._quiet_state = None
                self._quiet_gain = None
                if self.level_gain is not None:
                    self._quiet_gain = LevelGain(self.level_gain.target, self.level_gain.max_gain)
            part = x[first:end]
            if self._quiet_gain is not None:
                part = part * torch.from_numpy(self._quiet_gain.of(peaks[first:end]))[:, None]
            heard, self._quiet_state = self.detector(part, self._quiet_state)
            again[first:end] = heard.numpy()
        for i in range(len(peaks)):
            self._quiet_run = self._quiet_run + 1 if inside[i] and again[i] >= self.threshold else 0
            if self._quiet_run >= self.min_run:
                # The run's frames in this block when it reaches min_run, then each one.
                first = max(0, i + 1 - self.min_run) if self._quiet_run == self.min_run else i
                probs[first : i + 1] = torch.maximum(
                    probs[first : i + 1], torch.from_numpy(again[first : i + 1])
                )

    def map(self) -> np.ndarray:
        """(frames,) float32 speech probability of every frame scored so far."""
        return np.concatenate(self.probs) if self.probs else np.zeros(0, np.float32)
