"""The logit rules of a decode step, as pure functions of the logits and the decode state.

Suppressed tokens and openai-whisper's timestamp rules, vectorised over the batch, on
the device, with no host value: which rules apply at a step is read from the state's
tensors (the step index, the last tokens), so that one compiled step serves every step.
Only the first token's suppression is the caller's word (`first`): every row takes its
first token in its prompt's pass, never in a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from whisper_cli.dtypes import f32_logsumexp
from whisper_cli.loading import LoadedModel
from whisper_cli.speech import FRAME_SECONDS
from whisper_cli.tokenizer import TIME_PRECISION

NEG_INF = float("-inf")


# The bits of SpeechGrid.after: the decode may not end at timestamp t while its text is
# open (its last text token ends no sentence), or while it ends one.
HELD_OPEN, HELD_ENDED = 1, 2


@dataclass(frozen=True)
class SpeechGrid:
    """A batch's speech map on the timestamp grid (TIME_PRECISION steps), for the rules
    that keep a decode from passing over speech; (B, n_ts) each."""

    # uint8: HELD_OPEN | HELD_ENDED where speech the decode has not reached lies after
    # timestamp t, counted with the row's slack for open text, for text that ends a sentence
    after: torch.Tensor
    before: torch.Tensor  # int64: speech before timestamp t, in TIME_PRECISION steps

    @classmethod
    def from_maps(
        cls,
        maps: list[np.ndarray],
        n_timestamps: int,
        min_seconds: float,
        slack_seconds: list[tuple[float, float]],
        device: torch.device,
    ) -> SpeechGrid:
        """The grid of windows' speech maps (speech.FRAME_SECONDS frames, bool): see
        speech_after_timestamps (min_seconds, each row's slacks: for open text, for text
        that ends a sentence) and speech_before_timestamps."""
        after = np.zeros((len(maps), n_timestamps), dtype=np.uint8)
        before = np.zeros((len(maps), n_timestamps), dtype=np.int64)
        for r, (speech, slacks) in enumerate(zip(maps, slack_seconds, strict=True)):
            held = {
                s: speech_after_timestamps(speech, n_timestamps, min_seconds, s) for s in slacks
            }
            for bit, slack in zip((HELD_OPEN, HELD_ENDED), slacks, strict=True):
                after[r] |= np.where(held[slack], bit, 0).astype(np.uint8)
            before[r] = speech_before_timestamps(speech, n_timestamps)
        return cls(torch.from_numpy(after).to(device), torch.from_numpy(before).to(device))

    def padded(self, rows: int) -> SpeechGrid:
        """With `rows` rows of no speech after these (a compiled batch's padding)."""
        return SpeechGrid(
            *(torch.cat([t, t.new_zeros(rows, t.shape[1])]) for t in vars(self).values())
        )


@dataclass(frozen=True)
class SkipLimits:
    """How much speech (in TIME_PRECISION steps) a timestamp may pass over: a segment of
    n text tokens holds at most segment + per_token * n, and a gap between two segments
    at most gap (see options.Policy, where the seconds and their provenance are)."""

    segment: int
    per_token: int
    gap: int

    @classmethod
    def from_seconds(cls, segment: float, per_token: float, gap: float) -> SkipLimits:
        steps = lambda s: max(1, round(s / TIME_PRECISION))  # noqa: E731
        return cls(steps(segment), steps(per_token), steps(gap))


@dataclass(frozen=True)
class Rules:
    """What the rules of one run need, as device tensors made once."""

    # (K,) int64: the tokens never sampled; a step fills their K columns (88-91 in
    # tiny.en's and base's generation configs).
    never: torch.Tensor
    # (V,) bool: the tokens not sampled as a row's first token (the never ones among them).
    first_suppress: torch.Tensor
    ts_index: torch.Tensor  # (n_ts,) 0 .. n_ts - 1
    eot: int
    timestamp_begin: int
    timestamps: bool
    skip: SkipLimits | None  # None: timestamps may pass over any speech
    # (V,) uint8: the bit of SpeechGrid.after that holds a decode whose last text token is
    # this one: HELD_ENDED for the tokens that end a sentence (tokenizer.sentence_ends),
    # HELD_OPEN for every other
    held_bit: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors, which a compiled step reads beside the state and caches."""
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    @classmethod
    def build(
        cls,
        loaded: LoadedModel,
        timestamps: bool,
        skip: SkipLimits | None = None,
    ) -> Rules:
        special = loaded.tokenizer.special
        gen = loaded.generation
        device = loaded.model.device
        vocab = torch.arange(loaded.config.vocab_size, device=device)

        def mask(ids: tuple[int, ...]) -> torch.Tensor:
            m = torch.zeros_like(vocab, dtype=torch.bool)
            m[[i for i in ids if 0 <= i < m.shape[0]]] = True
            return m

        suppress = mask(gen.suppress_tokens)
        begin_suppress = mask(gen.begin_suppress_tokens) | suppress
        ts_begin = special.timestamp_begin
        if timestamps:
            suppress[special.no_timestamps] = True
            begin_suppress[special.no_timestamps] = True
            # First token: a timestamp no later than the checkpoint's initial limit.
            last_initial = ts_begin + gen.max_initial_timestamp_index
            begin_suppress |= (vocab < ts_begin) | (vocab > last_initial)
        held_bit = torch.full_like(vocab, HELD_OPEN, dtype=torch.uint8)
        if timestamps:
            held_bit[mask(tuple(loaded.tokenizer.sentence_ends()))] = HELD_ENDED
        return cls(
            never=suppress.nonzero()[:, 0],
            first_suppress=begin_suppress,
            ts_index=torch.arange(loaded.config.vocab_size - ts_begin, device=device),
            eot=special.eot,
            timestamp_begin=ts_begin,
            timestamps=timestamps,
            skip=skip,
            held_bit=held_bit,
        )


def apply_rules(
    rules: Rules,
    logits: torch.Tensor,
    index: torch.Tensor,
    last: torch.Tensor,
    penult: torch.Tensor,
    max_ts: torch.Tensor,
    speech_after: torch.Tensor | None,
    speech_before: torch.Tensor | None = None,
    text_run: torch.Tensor | None = None,
    first: bool = False,
) -> torch.Tensor:
    """(B, V) logits -> the same tensor with the rules applied, in place: the caller's own
    (a step's or a prompt pass's fresh logits, read by nothing else once the rules have
    run).

    index: (B,) int64, each row's step (0: its first sampled token); last, penult, max_ts:
    (B,) int64, the last two tokens (-1 before any) and the largest timestamp so far (-1).
    speech_after, speech_before: the rows' SpeechGrid (see there); while speech lies after
    a row's latest timestamp it may not end, and a timestamp may not pass over more
    speech than rules.skip allows. text_run (B,) int64: text tokens since the row's
    latest timestamp (needed with speech_before).
    first: every row chooses its first token (the prompt's pass); else none does (a step:
    a row's first token always comes from its prompt's pass).
    """
    if first:
        logits.masked_fill_(rules.first_suppress, NEG_INF)
    else:
        # Some 90 columns, where a (B, V) mask is a pass over every logit: 0.005
        # against 0.36 ms a step (f32, 16 rows of tiny.en's vocabulary, AMD EPYC Zen 4).
        logits.index_fill_(1, rules.never, NEG_INF)
    if not rules.timestamps:
        return logits
    # The rules fill slices of `logits` in place (text, end and timestamp tokens each see
    # only their own columns).
    ts_begin, eot = rules.timestamp_begin, rules.eot
    stamps = logits[:, ts_begin:]  # (B, n_ts) view
    last_ts = last >= ts_begin  # False at step 0 (last is -1)
    # openai-whisper: "penultimate was a timestamp" also holds while fewer than two tokens.
    penult_ts = (penult >= ts_begin) | (index < 2)
    # Timestamps come in pairs: after a pair, text; after a lone one, a timestamp or end.
    opened = last_ts & ~penult_ts
    stamps.masked_fill_((last_ts & penult_ts)[:, None], NEG_INF)
    fill_rows(logits[:, :eot], opened)
    # Timestamps never decrease, and a segment has a non-zero length (max_ts -1: no floor).
    floor = torch.where(opened, max_ts, max_ts + 1) - ts_begin
    stamps.masked_fill_(rules.ts_index < floor[:, None], NEG_INF)
    if speech_before is not None and rules.skip is not None:
        # The model sometimes closes a segment of a few words far past them, or opens the
        # next one far past the last, and the speech in between is never written: a
        # timestamp may pass over only as much speech as the text since the latest one can
        # hold (a gap between segments: a little, for the timestamps' own error).
        skip = rules.skip
        latest = (max_ts - ts_begin).clamp(min=0)
        passed = speech_before - speech_before.gather(1, latest[:, None])  # (B, n_ts)
        allowed = torch.where(opened, skip.gap, skip.segment + skip.per_token * text_run)
        too_far = (passed > allowed[:, None]) & (max_ts >= ts_begin)[:, None]
        stamps.masked_fill_(too_far, NEG_INF)
    stamps_lse = f32_logsumexp(stamps)  # (B,) the timestamps' mass, unnormalised
    # The best text token other than end-of-text, and end-of-text itself (a view).
    others = torch.maximum(logits[:, :eot].amax(dim=-1), logits[:, eot + 1 : ts_begin].amax(dim=-1))
    eot_logit = logits[:, eot]
    if speech_after is not None:
        # The model ends a window early when it takes the last utterance for one that
        # runs on past the window, and after a pause it often ends wrongly: while the
        # speech map holds speech after the row's latest timestamp it may not end, with
        # the slack of text that ends a sentence where its last text token (before the
        # closing timestamp: `opened`) does, else that of open text (SpeechGrid.after).
        latest = (max_ts - ts_begin).clamp(min=0)
        held = speech_after.gather(1, latest[:, None])[:, 0]  # (B,) uint8
        bit = torch.where(opened, rules.held_bit[penult.clamp(min=0)], HELD_OPEN)  # uint8
        speech_left = last_ts & (held & bit).bool()
        eot_logit.masked_fill_(speech_left, NEG_INF)
    # If the timestamps together are likelier than any text token, emit a timestamp:
    # log-sum-exp(timestamps) > max(text) in log-probs, the row's normaliser cancels.
    stamps_win = stamps_lse > torch.maximum(others, eot_logit)
    fill_rows(logits[:, :ts_begin], stamps_win)
    return logits


def fill_rows(view: torch.Tensor, rows: torch.Tensor) -> None:
    """Set the rows `rows` ((B,) bool) of a (B, N) view to -inf, in place.

    An add of 0 or -inf per row: on CPU masked_fill_ with a (B, 1) mask takes 3-15x as
    long over the vocabulary (tiny.en, 16 rows: 0.57 against 0.04 ms in f32, 0.38 against
    0.11 in bf16, AMD EPYC Zen 4), twice a step. The same values for any finite logit."""
    view.add_(view.new_zeros(rows.shape).masked_fill_(rows, NEG_INF)[:, None])


# --- the speech map on the timestamp grid ------------------------------------------------


def _timestamp_frames(n_timestamps: int, n_frames: int) -> np.ndarray:
    """(n_timestamps,) the first speech-map frame at or after each timestamp."""
    frames = np.ceil(np.arange(n_timestamps) * TIME_PRECISION / FRAME_SECONDS - 1e-9)
    return np.minimum(frames.astype(np.int64), n_frames)


def speech_before_timestamps(speech: np.ndarray, n_timestamps: int) -> np.ndarray:
    """(n_timestamps,) int64: the speech frames before each timestamp, in timestamp steps
    (TIME_PRECISION), the unit of rules.SkipLimits."""
    before = np.concatenate(([0], np.cumsum(speech, dtype=np.int64)))
    frames = before[_timestamp_frames(n_timestamps, len(speech))]
    return np.round(frames * (FRAME_SECONDS / TIME_PRECISION)).astype(np.int64)


def speech_after_timestamps(
    speech: np.ndarray, n_timestamps: int, min_seconds: float, slack_seconds: float = 0.0
) -> np.ndarray:
    """(n_timestamps,) bool: where a decode may not end, from the window's speech map.

    At least `min_seconds` of speech frames must lie after the timestamp (20 ms apart),
    not counting the first `slack_seconds` of a stretch of speech that runs on through
    it: the model dates an utterance's end up to that much early, and holding the decode
    open for the rest of the utterance it has just written makes it write that again.
    Speech after a pause always counts: it is an utterance the decode has not reached.
    """
    n = len(speech)
    after = np.append(np.cumsum(speech[::-1])[::-1], 0)  # speech frames from frame f on
    run = np.zeros(n + 1, dtype=np.int64)  # frames of speech running on from frame f
    for f in range(n - 1, -1, -1):
        run[f] = run[f + 1] + 1 if speech[f] else 0
    frames = _timestamp_frames(n_timestamps, n)
    forgiven = np.minimum(run[frames], round(slack_seconds / FRAME_SECONDS))
    return (after[frames] - forgiven) * FRAME_SECONDS >= min_seconds - 1e-9
