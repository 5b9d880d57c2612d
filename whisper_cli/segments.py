"""Turn the tokens decoded for one window into timed segments."""

from __future__ import annotations

import zlib

from whisper_cli.results import Segment
from whisper_cli.tokenizer import TIME_PRECISION, Tokenizer


def compression_ratio(text: str) -> float:
    """How well the text compresses: looping, repeated text compresses far above 2.4."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def window_segments(
    tokens: tuple[int, ...],
    tokenizer: Tokenizer,
    *,
    offset: float,
    duration: float,
    avg_logprob: float,
    no_speech_prob: float,
    language: str | None,
) -> list[Segment]:
    """Segments of one window, times offset by the window's start and kept inside it.

    In timestamp mode the tokens read `<|t0|> text <|t1|><|t1'|> text <|t2|> ...`:
    a segment closes at each pair of consecutive timestamps. Text after the last
    timestamp (a row stopped by max_new_tokens) is kept up to the window's end, so no
    word is lost: windows are independent, there is no seek to re-decode it from.
    """
    ts_begin = tokenizer.special.timestamp_begin
    pieces: list[tuple[float, float, list[int]]] = []
    start: float | None = None
    current: list[int] = []
    for token in tokens:
        if token >= ts_begin:
            t = (token - ts_begin) * TIME_PRECISION
            if start is None:
                start = t  # opening timestamp
            else:
                if current:
                    pieces.append((start, t, current))
                start, current = None, []
                # The closing timestamp may be followed by the next segment's opening one.
        else:
            if start is None:
                start = pieces[-1][1] if pieces else 0.0
            current.append(token)
    if current:
        pieces.append((start if start is not None else 0.0, duration, current))

    segments = []
    for seg_start, seg_end, seg_tokens in pieces:
        text = tokenizer.decode(seg_tokens)
        if not text.strip():
            continue
        seg_start = min(max(seg_start, 0.0), duration)
        seg_end = min(max(seg_end, seg_start), duration)
        segments.append(
            Segment(
                start=round(offset + seg_start, 3),
                end=round(offset + seg_end, 3),
                text=text,
                tokens=tuple(seg_tokens),
                avg_logprob=avg_logprob,
                no_speech_prob=no_speech_prob,
                compression_ratio=compression_ratio(text),
                language=language,
            )
        )
    return segments
