"""Turn the tokens decoded for one window into timed segments."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

from whisper_cli.results import Segment, Word
from whisper_cli.timing import WindowWords
from whisper_cli.tokenizer import TIME_PRECISION, Tokenizer


def compression_ratio(text: str) -> float:
    """How well the text compresses: looping, repeated text compresses far above 2.4."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass(frozen=True)
class Piece:
    """The text between two timestamps of one window's tokens."""

    start: float  # seconds into the window, as decoded
    end: float  # seconds into the window (the window's end for text after the last timestamp)
    tokens: slice  # where its text tokens lie in the window's tokens


def text_pieces(tokens: tuple[int, ...], timestamp_begin: int, duration: float) -> list[Piece]:
    """The pieces of one window's tokens, in order.

    In timestamp mode the tokens read `<|t0|> text <|t1|><|t1'|> text <|t2|> ...`:
    a piece closes at each pair of consecutive timestamps. Text after the last
    timestamp (a row stopped by max_new_tokens) runs to the window's end, so no word is
    lost: windows are independent, there is no seek to re-decode it from.
    """
    pieces: list[Piece] = []
    start: float | None = None
    first: int | None = None  # index of the open piece's first text token
    for i, token in enumerate(tokens):
        if token >= timestamp_begin:
            t = (token - timestamp_begin) * TIME_PRECISION
            if start is None:
                start = t  # opening timestamp
            else:
                if first is not None:
                    pieces.append(Piece(start, t, slice(first, i)))
                start, first = None, None
                # The closing timestamp may be followed by the next piece's opening one.
        else:
            if start is None:
                start = pieces[-1].end if pieces else 0.0
            if first is None:
                first = i
    if first is not None:
        pieces.append(Piece(start if start is not None else 0.0, duration, slice(first, None)))
    return pieces


def piece_segment(
    piece: Piece,
    tokens: tuple[int, ...],
    tokenizer: Tokenizer,
    *,
    offset: float,
    duration: float,
    avg_logprob: float,
    no_speech_prob: float,
    language: str | None,
) -> Segment | None:
    """The piece as a segment in input time, kept inside its window; None if it has no text."""
    seg_tokens = tokens[piece.tokens]
    text = tokenizer.decode(list(seg_tokens))
    if not text.strip():
        return None
    start = min(max(piece.start, 0.0), duration)
    end = min(max(piece.end, start), duration)
    return Segment(
        start=round(offset + start, 3),
        end=round(offset + end, 3),
        text=text,
        tokens=tuple(seg_tokens),
        avg_logprob=avg_logprob,
        no_speech_prob=no_speech_prob,
        compression_ratio=compression_ratio(text),
        language=language,
    )


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
    """Segments of one window (see text_pieces), times offset by the window's start."""
    pieces = text_pieces(tokens, tokenizer.special.timestamp_begin, duration)
    segments = (
        piece_segment(
            p,
            tokens,
            tokenizer,
            offset=offset,
            duration=duration,
            avg_logprob=avg_logprob,
            no_speech_prob=no_speech_prob,
            language=language,
        )
        for p in pieces
    )
    return [s for s in segments if s is not None]


def without_last_words(segment: Segment, n: int, tokenizer: Tokenizer) -> Segment | None:
    """`segment` without its last n Word entries (its words are needed) and the text tokens
    that spell them; None if nothing is left. The segment unchanged where no token boundary
    spells them (a word sharing a token with the one before it)."""
    if n <= 0:
        return segment
    kept, dropped = segment.words[:-n], segment.words[-n:]
    spelt = "".join(w.word for w in dropped).strip()
    tokens = segment.tokens
    for i in range(len(tokens), -1, -1):
        tail = tokenizer.decode(list(tokens[i:])).strip()
        if tail == spelt:
            break
        if len(tail) > len(spelt):
            return segment
    else:
        return segment
    text = tokenizer.decode(list(tokens[:i]))
    if not text.strip():
        return None
    return replace(
        segment,
        end=kept[-1].end if kept else segment.end,
        text=text,
        tokens=tokens[:i],
        compression_ratio=compression_ratio(text),
        words=kept,
    )


def attach_words(
    segments: list[Segment],
    window: WindowWords,
    offset: float,
    last_speech: float,
) -> list[Segment]:
    """The window's segments with their words, start and end refined from them.

    openai-whisper's rules: the window's words are dealt to its segments in token order
    (each segment takes words until it has its tokens); after a pause (the first word
    ends over 4 median word durations after `last_speech`, the input's previous segment
    end), an overlong first word, or first two, are cut to twice the median duration.
    A first (last) word that runs over 0.5 s before (past) the decoded segment time is cut
    to it, but keeps at least the median word duration. The segment then spans its words,
    from its first word's start to its last word's end: openai-whisper keeps the decoded
    time where it cut a word, so a word kept at the median duration could end past its
    segment (or start before it), in every format that shows both.
    """
    median, longest = window.median_duration, window.max_duration
    timings = list(window.words)
    out: list[Segment] = []
    at = 0
    for segment in segments:
        taken, words = 0, []
        while at < len(timings) and taken < len(segment.tokens):
            timing = timings[at]
            if timing.word:
                words.append(
                    [timing.word, offset + timing.start, offset + timing.end, timing.probability]
                )
            taken += len(timing.tokens)
            at += 1
        start, end = segment.start, segment.end
        if words:
            first = words[0]
            if first[2] - last_speech > median * 4 and (
                first[2] - first[1] > longest
                or (len(words) > 1 and words[1][2] - first[1] > longest * 2)
            ):
                if len(words) > 1 and words[1][2] - words[1][1] > longest:
                    boundary = max(words[1][2] / 2, words[1][2] - longest)
                    first[2] = words[1][1] = boundary
                first[1] = max(0.0, first[2] - longest)
            if start < first[2] and start - 0.5 > first[1]:
                first[1] = max(0.0, min(first[2] - median, start))
            last = words[-1]
            if end > last[1] and end + 0.5 < last[2]:
                last[2] = max(last[1] + median, end)
            start, end = first[1], last[2]
            last_speech = end
        out.append(
            replace(
                segment,
                start=round(start, 3),
                end=round(end, 3),
                words=tuple(Word(w, round(s, 3), round(e, 3), p) for w, s, e, p in words),
            )
        )
    return out
