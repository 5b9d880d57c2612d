"""Log-mel spectrogram as Whisper's feature extractor computes it, in torch, batched.

Runs in float32 on the model's device (the listed front-end exception of the dtype
policy; torch has no half-precision STFT on CPU). The result is cast once at the
encoder's door by `dtypes.encoder_input`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from whisper_cli.audio import SAMPLE_RATE

N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30  # the audio the model hears at once: windows.py cuts inputs to it
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    mels = freq / f_sp
    log_region = freq >= min_log_hz
    mels[log_region] = min_log_mel + np.log(freq[log_region] / min_log_hz) / logstep
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    freqs = f_sp * mels
    log_region = mels >= min_log_mel
    freqs[log_region] = min_log_hz * np.exp(logstep * (mels[log_region] - min_log_mel))
    return freqs


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int) -> np.ndarray:
    """Slaney-normalised triangular filters, (n_mels, N_FFT // 2 + 1), as librosa makes them."""
    fft_freqs = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = np.array([0.0, SAMPLE_RATE / 2])
    mel_edges = _mel_to_hz(np.linspace(*_hz_to_mel(edges), n_mels + 2))
    widths = np.diff(mel_edges)
    ramps = mel_edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_edges[2:] - mel_edges[:-2]))[:, None]  # equal area per filter
    return weights.astype(np.float32)


def log_mel(audio: torch.Tensor, n_mels: int) -> torch.Tensor:
    """(B, samples<=N_SAMPLES) float32 16 kHz -> (B, n_mels, N_FRAMES) float32 log-mel.

    Each row is zero-padded to 30 s first, as the reference extractor does, so the
    dynamic-range floor (max - 8) is taken over the same frames.
    """
    audio = torch.nn.functional.pad(audio, (0, N_SAMPLES - audio.shape[-1]))
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # (B, n_freq, N_FRAMES): drop the extra centre frame
    filters = torch.from_numpy(mel_filters(n_mels)).to(audio.device)
    mel = filters @ power  # (B, n_mels, N_FRAMES)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0


def batch_log_mel(
    clips: list[np.ndarray], rows: int, n_mels: int, device: torch.device
) -> torch.Tensor:
    """Log-mel of up to `rows` clips (<= 30 s each), zero rows after them: (rows, n_mels, 3000).

    Extra rows pad a batch to a compiled step's fixed batch size. Computed MEL_ROWS rows at
    a time: the STFT's temporaries (~16 MB a row in float32: frames, complex spectrum,
    power) stay those of MEL_ROWS rows, not of the batch, and at one row a call every
    row's log-mel is its own, the same bytes whatever rows share its batch.
    """
    audio = np.zeros((rows, N_SAMPLES), dtype=np.float32)
    for row, clip in enumerate(clips):
        audio[row, : len(clip)] = clip
    audio_t = torch.from_numpy(audio).to(device)
    mel = torch.empty((rows, n_mels, N_FRAMES), dtype=torch.float32, device=device)
    for r in range(0, rows, MEL_ROWS):
        mel[r : r + MEL_ROWS] = log_mel(audio_t[r : r + MEL_ROWS], n_mels)
    return mel


# Rows per log_mel call in batch_log_mel. One: at batch 16 the call's memory grows by 53
# MiB (10 K page faults) against 294 MiB (72 K) for all 16 rows at once, in about the same
# time once freed memory is kept (allocator.py): 59-60 against 57-62 ms (AMD EPYC Zen 4).
# And a call over several rows need not give each row its own bytes: the mel projection
# over 9 rows differs from row by row by up to 3e-8 where MKL runs its AVX2 GEMM (held to
# it on an Intel Xeon with AMX; AVX-512's gives the same bytes).
MEL_ROWS = 1
