"""What a decoded window keeps: pure functions of (window, attempts, policy).

The judge decides, for one window, whether its latest attempt must be decoded again at
the next temperature (openai-whisper's fallback), which attempt is kept when none
passes, whether the window is silent, and which of its segments are kept. It reads no
model and no device: a window, the rows decoded for it, the policy and the tokenizer.

The speech map is evidence here, never a gate that alone deletes words: a segment is
dropped as text over non-speech only when (almost) no speech lies under it *and* the
decoder itself doubts it (its tokens are unlikely, or the window is probably silent).
Where the two disagree the text is kept: an invented "Thank you" costs less than a lost
sentence, and audio with no speech at all is never decoded in the first place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from whisper_cli.decoding import DecodedRow
from whisper_cli.options import Policy
from whisper_cli.results import Segment, Word
from whisper_cli.segments import compression_ratio, piece_segment, text_pieces
from whisper_cli.tokenizer import Tokenizer
from whisper_cli.windows import Window


@dataclass(frozen=True)
class Judgement:
    """The judge's word on one window after an attempt."""

    final: bool  # False: decode the window again at its next temperature
    row: DecodedRow | None = None  # the attempt kept (final only)
    segments: tuple[Segment, ...] = ()  # kept, in input time
    silent: bool = False  # judged no speech: no text, and its cuts are not the user's concern
    repetitive: int = 0  # dropped: above the compression-ratio threshold, or repeats_too_fast
    over_non_speech: int = 0  # segments dropped: no speech under them, the decoder unsure


def row_text(row: DecodedRow, tokenizer: Tokenizer) -> str:
    """The row's text, timestamps left out."""
    ts_begin = tokenizer.special.timestamp_begin
    return tokenizer.decode([t for t in row.tokens if t < ts_begin])


def is_silent(row: DecodedRow, text: str, policy: Policy) -> bool:
    """openai-whisper's rule: likely no speech, and the text is not confidently decoded.

    A confident decode overrides the no-speech probability only when it holds words: text
    of punctuation or symbols alone (" . . .", music notes) under a high no-speech
    probability is what the model writes for noise and tones, not speech.
    """
    if row.no_speech_prob <= policy.no_speech_threshold:
        return False
    if row.avg_logprob < policy.logprob_threshold:
        return True
    return not any(ch.isalnum() for ch in text)


def is_repetitive(row: DecodedRow, text: str, policy: Policy) -> bool:
    """Cut by the repetition guard, or compressing like a loop (its gzip ratio above the
    policy's)."""
    return row.looped or compression_ratio(text) > policy.compression_ratio_threshold


def needs_fallback(row: DecodedRow, text: str, policy: Policy) -> bool:
    """openai-whisper's rule: too repetitive or too unsure (silence is judged before it,
    on the first attempt: see judge)."""
    return is_repetitive(row, text, policy) or row.avg_logprob < policy.logprob_threshold


def best(
    window: Window,
    attempts: list[DecodedRow],
    texts: list[str],
    policy: Policy,
    timestamp_begin: int,
) -> DecodedRow:
    """The last attempt where it passed, unless policy.repeat_min_attempts attempts or more
    repeat what was heard (see `repeats_speech`): then the best average log-prob among
    them and it. Where every attempt failed, the best among those that repeat what was
    heard, or else, as faster-whisper, among those that are not too repetitive (or among
    all, if none is).

    When every attempt fails, each has failed one way: a confident one by repeating itself
    (sampling until the repeats give way is what fallback is for), the others by being
    unsure. But speech that itself repeats (a phrase said again, a word list, a refrain)
    compresses like a loop at every temperature, and then the sampled draws are the only
    "fine" attempts: faster-whisper's rule kept base's draw at T=1.0 (avg log-prob -2.8:
    "asked which you can do", "is poucia keep i couldator ...") over five confident
    attempts (-0.16 to -0.42) that agreed on the words. A confident repetitive attempt
    every piece of which lies over speech is the better evidence of what was said.

    So it is where the last draw passes, too: a draw is less likely by construction, and
    one way to stop repeating is to leave out what was said twice. tiny.en in bf16 with
    int8 weights held to AVX2 (compare_cpu's 10 min, a window of 20.7 s of speech that
    says two sentences twice) wrote all 71 words at T=0 to 0.8 (avg log-prob -0.22 to
    -0.42, each failing on its gzip ratio alone), and at T=1.0 passed with 34 (-0.55): its
    first 13 dated over the 22.5 s that held 37 more, which were lost. (How many attempts
    must repeat before a draw is set aside: policy.repeat_min_attempts, with its
    measurements.)

    Speech that repeats itself repeats at the lowest temperature first: the greedy
    attempt (the first) loops on it or fails on its gzip ratio. Where the greedy attempt
    failed on its log-prob alone, a repetition that only a draw shows is the draw's own,
    and no attempt is taken for repeating what was heard. base on an eSpeak word list at
    -20 dB in noise (words 3 s apart) kept a draw at T=0.6 (-0.72, gzip ratio 5.5) that
    wrote "an elite" over and over across 26 s of eight other words, against a greedy
    attempt (-1.27) that wrote a word or two for each ("Yes, Arlin, Nero, Erlip and
    Urm-Date, Airboat, Microwave."): 40 words invented. Over scripts/calibrate_speech.py's
    corpus, its repeated, long and doubled readings and its non-speech (tiny.en and base,
    f32, map on) no window's choice differs with this, nor did any other in 24 such word
    lists (2 voices, pauses of 1.5-6 s, 0 and -20 dB, clean and in noise).
    """
    last = attempts[-1]
    if len(attempts) == 1:
        return last
    heard = []
    if is_repetitive(attempts[0], texts[0], policy):
        heard = [a for a in attempts if repeats_speech(window, a, policy, timestamp_begin)]
    if not needs_fallback(last, texts[-1], policy):
        repeated = [a for a in heard if a is not last]
        if len(repeated) < policy.repeat_min_attempts:
            return last
        return max([*repeated, last], key=lambda a: a.avg_logprob)
    fine = [
        a for a, text in zip(attempts, texts, strict=True) if not is_repetitive(a, text, policy)
    ]
    return max(heard or fine or attempts, key=lambda a: a.avg_logprob)


def repeats_speech(window: Window, row: DecodedRow, policy: Policy, timestamp_begin: int) -> bool:
    """Whether an attempt's repetition is plausibly the audio's own: it is confident, ended
    by itself (neither the repetition guard nor max_new_tokens stopped it: a loop the guard
    misses, of a period above its longest, runs on to the limit), and speech lies under
    every one of its timed pieces (as `speech_under` reads it for text over non-speech)."""
    if row.looped or row.hit_max_tokens or row.avg_logprob < policy.logprob_threshold:
        return False
    pieces = text_pieces(row.tokens, timestamp_begin, window.duration)
    return bool(pieces) and all(speech_under(window, p.start, p.end, policy) for p in pieces)


def speech_under(window: Window, start: float, end: float, policy: Policy) -> bool:
    """Whether the map holds speech under [start, end) seconds of the window, its timing
    margin included (the decoder's timestamps are that far off)."""
    margin = policy.text_speech_margin_seconds
    speech = window.speech_seconds_between(start - margin, end + margin)
    return speech >= policy.text_min_speech_seconds


def over_non_speech(
    window: Window, start: float, end: float, logprob: float, row: DecodedRow, policy: Policy
) -> bool:
    """Whether text at [start, end) seconds of the window lies over non-speech: the map
    holds (almost) no speech under it, its timing margin included, and the decoder
    doubts it (its own tokens are unlikely, or the window is probably silent)."""
    if speech_under(window, start, end, policy):
        return False
    return logprob < policy.logprob_threshold or row.no_speech_prob > policy.no_speech_threshold


def repeats_too_fast(
    segment: Segment,
    earlier: list[Segment],
    policy: Policy,
    took: Callable[[Segment], float],
) -> bool:
    """Whether the segment says the words of an earlier stretch of kept segments again
    (one segment, or consecutive ones: the decoder splits a sentence where it likes), in
    a span under policy.repeat_min_span_fraction of the time those segments took to say
    (`took` of each, summed: a pause between them, or inside one's span, is no time spent
    saying the words). "The words again" allows policy.repeat_max_changed_share of the
    segment's words changed, added or left out (a decoder's copy of a sentence is not
    always word for word: base wrote jfk's "ask not" as "asked not" in its third copy)."""
    words = _words(segment.text)
    changes = int(policy.repeat_max_changed_share * len(words))
    span = segment.end - segment.start
    for first in range(len(earlier)):
        said: list[str] = []
        seconds = 0.0
        for e in earlier[first:]:
            said += _words(e.text)
            seconds += took(e)
            if len(said) > len(words) + changes:  # more segments only add words
                break
            if (
                len(said) >= len(words) - changes
                and _within_changes(said, words, changes)
                and span < policy.repeat_min_span_fraction * seconds
            ):
                return True
    return False


def _within_changes(a: list[str], b: list[str], limit: int) -> bool:
    """Whether a becomes b by at most `limit` words changed, added or left out (the
    edit distance over words, computed in the band |i - j| <= limit it can lie in)."""
    if abs(len(a) - len(b)) > limit:
        return False
    if limit == 0:
        return a == b
    over = limit + 1  # any distance past the limit
    # previous[j]: the distance between a[:i] and b[:j], for j within the band of row i.
    previous = {j: j for j in range(min(len(b), limit) + 1)}
    for i in range(1, len(a) + 1):
        current = {}
        for j in range(max(0, i - limit), min(len(b), i + limit) + 1):
            if j == 0:
                current[j] = i
                continue
            current[j] = min(
                previous.get(j - 1, over) + (a[i - 1] != b[j - 1]),
                previous.get(j, over) + 1,
                current.get(j - 1, over) + 1,
            )
        previous = current
    return previous.get(len(b), over) <= limit


def _words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def may_echo(last: Segment, following: Sequence[Segment], policy: Policy) -> bool:
    """Whether the last segment of a window cut inside speech ends with at least
    policy.echo_min_words words that the next window's segments begin with (text alone:
    the check that decides whether `echoed_words` needs word times)."""
    mine = _words(last.text)
    theirs = _words("".join(s.text for s in following))[: len(mine)]
    n = _overlap(mine, theirs)
    return n >= policy.echo_min_words


def echoed_words(
    last: Segment,
    window: Window,
    following: Sequence[Segment],
    after: Window,
    policy: Policy,
    *,
    use_map: bool = True,
) -> int:
    """How many of the last words (Word entries) of `last`, the last segment of `window`,
    repeat the words `after` (the input's next window, cut from it inside speech) begins
    with, written once too often: 0 to keep them all.

    At a cut the decoder may go on past its window's audio with what it expects to
    follow (base with int8 weights wrote "ask not what your country can do for you." at
    a cut after "ask not", having heard the sentence earlier in the window), and the next
    window then says those words again, from its own audio. The evidence is
    repeats_too_fast's, across the cut: the longest run of whole words (at least
    policy.echo_min_words) that ends `last` and begins `after`'s text is dropped from
    `last` when its words lie over less than policy.repeat_min_span_fraction of the speech
    under them in `after` (the map's; their spans where it is not used). Words the window
    heard, said again after the cut, lie over as much speech as their repeat and stay.
    Both segments need their word times (`Segment.words`)."""
    mine = [(w, _words(w.word)) for w in last.words]
    mine = [(w, n) for w, n in mine if n]
    theirs = [(w, _words(w.word)) for s in following for w in s.words]
    theirs = [(w, n) for w, n in theirs if n]
    flat_mine = [x for _, n in mine for x in n]
    flat_theirs = [x for _, n in theirs for x in n][: len(flat_mine)]
    count = _overlap(flat_mine, flat_theirs)
    if count < policy.echo_min_words:
        return 0
    # The overlap in whole Word entries on both sides (a word of several pieces, "can't",
    # counts once); none when it starts inside a word.
    taken, k = 0, 0
    while taken < count and k < len(mine):
        k += 1
        taken += len(mine[-k][1])
    taken_theirs, j = 0, 0
    while taken_theirs < count and j < len(theirs):
        taken_theirs += len(theirs[j][1])
        j += 1
    if taken != count or taken_theirs != count:
        return 0
    said = _speech_of(window, mine[-k][0], mine[-1][0], use_map)
    again = _speech_of(after, theirs[0][0], theirs[j - 1][0], use_map)
    if said < policy.repeat_min_span_fraction * again:
        return _entries(last.words, k)
    return 0


def _entries(words: Sequence[Word], k: int) -> int:
    """How many trailing Word entries of `words` hold its last k entries with words
    (punctuation-only entries after them go too)."""
    seen = 0
    for i in range(len(words) - 1, -1, -1):
        if _words(words[i].word):
            seen += 1
            if seen == k:
                return len(words) - i
    return len(words)


def _speech_of(window: Window, first: Word, last: Word, use_map: bool) -> float:
    """Seconds of speech under words first..last (input times) in their window: the map's,
    or their span where it is not used."""
    if not use_map:
        return max(last.end - first.start, 0.0)
    return window.speech_seconds_between(first.start - window.start, last.end - window.start)


def _overlap(mine: list[str], theirs: list[str]) -> int:
    """The longest n with mine[-n:] == theirs[:n] (0: none)."""
    for n in range(min(len(mine), len(theirs)), 0, -1):
        if mine[-n:] == theirs[:n]:
            return n
    return 0


def judge(
    window: Window,
    attempts: list[DecodedRow],
    policy: Policy,
    tokenizer: Tokenizer,
    *,
    use_map: bool = True,
) -> Judgement:
    """The judgement of `window` after its attempts so far (in temperature order).

    use_map: the speech map may drop text (off with --no-vad: the detector is not
    trusted, so only the decoder's own guards decide).
    """
    texts = [row_text(a, tokenizer) for a in attempts]
    # Silence is the first attempt's word (greedy, at the lowest temperature): a sampled
    # attempt's tokens are less likely by construction, so its log-prob is no evidence of
    # silence. (openai-whisper asks it of every attempt: a window of speech that falls
    # back, for a loop, then meets the no-speech rule at a higher temperature and is
    # dropped whole: base, eSpeak French read fast, a window of 23.7 s of speech at
    # no-speech P 0.78. scripts/calibrate_speech.py: on its cuts' 28 readings base then lost
    # 337 words of 3632, 221 with this rule; on its text corpus (36 min, map on) every
    # segment kept is the same.) The no-speech probability is the same for every attempt:
    # it is read before the first token.
    if is_silent(attempts[0], texts[0], policy):
        return Judgement(final=True, row=attempts[0], silent=True)
    if needs_fallback(attempts[-1], texts[-1], policy) and len(attempts) < len(policy.temperatures):
        return Judgement(final=False)
    row = best(window, attempts, texts, policy, tokenizer.special.timestamp_begin)

    def took(segment: Segment) -> float:
        """The time a kept segment took to say: the speech under it (its span holds the
        pauses the model dates into it: base dated "on the left." 3.4 s over 0.8 s of
        speech, then the same three words, said again in 1.0 s, read as a repeat in under
        a third of that); its span where the map is not used."""
        if not use_map:
            return segment.end - segment.start
        return window.speech_seconds_between(
            segment.start - window.start, segment.end - window.start
        )

    kept: list[Segment] = []
    repetitive = dropped = 0
    for piece in text_pieces(row.tokens, tokenizer.special.timestamp_begin, window.duration):
        segment = piece_segment(
            piece,
            row.tokens,
            tokenizer,
            offset=window.start,
            duration=window.duration,
            avg_logprob=row.avg_logprob,
            no_speech_prob=row.no_speech_prob,
            language=row.language,
        )
        if segment is None:
            continue
        if segment.compression_ratio > policy.compression_ratio_threshold:
            repetitive += 1  # a loop that survived every temperature
            continue
        if repeats_too_fast(segment, kept, policy, took):
            repetitive += 1  # one repeat too many, squeezed into what time was left
            continue
        logprobs = row.token_logprobs[piece.tokens]
        logprob = sum(logprobs) / len(logprobs)
        start, end = segment.start - window.start, segment.end - window.start
        if use_map and over_non_speech(window, start, end, logprob, row, policy):
            dropped += 1
            continue
        kept.append(segment)
    return Judgement(
        final=True,
        row=row,
        segments=tuple(kept),
        repetitive=repetitive,
        over_non_speech=dropped,
    )
