"""Transcription options, the policy (every threshold of a run, with its provenance) and
the defaults a run takes when the user names none (the model per device, compile auto).

Values marked "Silero", "openai-whisper" or "faster-whisper" are those projects' own
defaults, kept because users compare with them and because they were tuned on far more
audio than we hold. Values of our own say what they were measured on; none was fitted to
the clips the tests assert on.
"""

from __future__ import annotations

from dataclasses import dataclass


def default_model(device_type: str) -> str:
    """The model of a run that names none: turbo on CUDA, base otherwise.

    The one place this is decided: transcribe, batch, bench and eval all ask here.
    """
    return "turbo" if device_type == "cuda" else "base"


COMPILE_CHOICES = ("auto", "on", "off")


def use_compile(choice: str, device_type: str) -> bool:
    """`--compile auto|on|off` on a device: auto compiles the decode step on CUDA only."""
    return choice == "on" or (choice == "auto" and device_type == "cuda")


@dataclass(frozen=True)
class Policy:
    """Every threshold of a transcription (library: `TranscribeOptions(policy=Policy(...))`)."""

    # --- the speech map (Silero VAD 6.2, 32 ms frames) --------------------------------------
    # A frame starts speech at P >= vad_threshold and speech goes on while P stays at or
    # above vad_neg_threshold (hysteresis). Silero's defaults (0.5, and threshold - 0.15).
    vad_threshold: float = 0.5
    vad_neg_threshold: float = 0.35
    # Speech shorter than this is a click or a breath, not a word: Silero's default
    # min_speech_duration_ms (250). Also the least speech "left in a window" that keeps a
    # decode from ending (see decoding's no-end rule).
    min_speech_seconds: float = 0.25
    # Pauses shorter than this stay inside the audio Whisper sees (it was trained on
    # natural pauses); longer ones are cut out, leaving speech_pad_seconds either side.
    # faster-whisper's VadOptions default (2000 ms).
    min_silence_seconds: float = 2.0
    # Audio kept before and after each stretch of speech: Silero's onsets can lag a soft
    # first consonant by 100-200 ms, and Whisper's first timestamp of a window is at most
    # 1 s in, so a window opens at most this long before its first speech.
    # faster-whisper's speech_pad_ms default (400).
    speech_pad_seconds: float = 0.4
    # A stretch of speech longer than a window is cut at its least speech-like frame in
    # the last this-many seconds before the 30 s limit (a pause between words or phrases).
    cut_search_seconds: float = 6.0
    # A segment whose time span holds less than this share of speech frames lies over
    # non-speech (a pause inside a window) and is dropped. Measured with
    # scripts/calibrate_speech.py (the shared clips in white and brown noise at 0-20 dB
    # SNR, between noise and silence; no test asserts on these mixtures): every segment
    # of real speech held at least 0.40 (tiny.en, 96 segments) and 0.45 (base, 75), the
    # lowest being two-word segments at a window's edge; 0.3 leaves a margin below them.
    segment_min_speech: float = 0.3
    # The language of an input is detected from its probabilities pooled over up to this
    # much speech at its start (openai-whisper detects on the first 30 s).
    language_seconds: float = 30.0

    # --- decoding guards: openai-whisper's defaults -------------------------------------------
    # A window is "no speech" when P(no speech) > no_speech_threshold and its average
    # log-prob < logprob_threshold; it gives no text and never falls back.
    no_speech_threshold: float = 0.6
    logprob_threshold: float = -1.0
    # A window's text compressing above this (gzip) is repetitive: it falls back.
    compression_ratio_threshold: float = 2.4
    # Temperatures tried in turn on a window that fails the checks above (or loops).
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    seed: int = 0  # sampling at temperature > 0 is seeded: the same run gives the same text

    # --- the repetition guard (on the device, during the decode) -------------------------------
    # Every loop_check_every steps, a row whose last max(min_loop_span, 3 * period) tokens
    # repeat with a period up to max_loop_period is stopped (and falls back). A loop of 32
    # tokens is longer than any run of one word or phrase in speech.
    loop_check_every: int = 8
    max_loop_period: int = 16
    min_loop_span: int = 32

    def __post_init__(self) -> None:
        if not 0.0 < self.vad_neg_threshold <= self.vad_threshold < 1.0:
            raise ValueError("need 0 < vad_neg_threshold <= vad_threshold < 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be a non-empty list of values >= 0")
        for name in ("min_speech_seconds", "min_silence_seconds", "speech_pad_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: detect per input (or per window if multilingual)
    multilingual: bool = False  # detect the language of every window
    task: str = "transcribe"
    timestamps: bool = True
    batch_size: int = 16
    max_new_tokens: int = 224
    initial_prompt: str | None = None
    channel: str | int | None = None
    compile: bool = False
    # The speech map decides where speech is (windows, early ends, hallucinations,
    # language). Off: every window of the input is decoded, as plain Whisper does.
    vad: bool = True
    policy: Policy = Policy()
    word_timestamps: bool = False  # words with times (one alignment pass per batch)
