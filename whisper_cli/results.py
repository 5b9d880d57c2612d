"""Frozen result types that flow from the pipeline to the output writers."""

from __future__ import annotations

from dataclasses import dataclass, field

# What a TranscriptWarning's code says (stable names: scripts filter on them).
WARNING_CODES = (
    "truncated",  # the audio ends before its header says; what is there was transcribed
    "non_finite",  # NaN or infinite samples were replaced by silence
    "text_cut",  # windows reached --max-new-tokens before their end
    "looped",  # windows looped at every temperature and were cut by the repetition guard
    "repetitive",  # segments dropped above --compression-ratio-threshold
    "echo",  # words a window wrote past a cut, said again by the next window, kept once
    "no_speech",  # no text at all: no speech found
)


@dataclass(frozen=True)
class TranscriptWarning:
    """Something the reader of a transcript should know that did not stop it.

    Made once where it is found (audio.py for the input, the pipeline for the decode);
    the CLI's stderr lines, json/jsonl and batch's summary.jsonl all read it from here.
    """

    code: str  # one of WARNING_CODES
    message: str  # one sentence, without the input's name


@dataclass(frozen=True)
class Word:
    """One word with its time in seconds from the start of the input (--word-timestamps).

    `word` keeps its leading space, as decoded, so joining a segment's words gives its text.
    """

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class Segment:
    """One timed piece of a transcript; times in seconds from the start of the input."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    language: str | None = None
    words: tuple[Word, ...] = ()  # empty unless word timestamps were asked for


@dataclass(frozen=True)
class Transcript:
    """The transcript of one input."""

    path: str  # as the user named it ("-" for stdin)
    text: str
    language: str | None
    segments: tuple[Segment, ...]
    duration: float  # seconds of audio
    language_probability: float | None = None
    model: str = ""
    dtype: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    # What the input or the decode lost or could not give, in the order it was found.
    warnings: tuple[TranscriptWarning, ...] = ()
