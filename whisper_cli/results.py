"""Frozen result types that flow from the pipeline to the output writers."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Text the run's limits or guards cut (--max-new-tokens, the repetition and
    # compression-ratio guards), one sentence each; empty when nothing was cut.
    notes: tuple[str, ...] = ()
