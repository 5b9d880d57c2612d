"""The logit rules of a decode step, as pure functions of the logits and the decode state.

Suppressed tokens and openai-whisper's timestamp rules, vectorised over the batch, on
the device, with no host value: which rules apply at a step is read from the state's
tensors (the step index, the last tokens), so that one compiled step serves every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whisper_cli.dtypes import f32_logsumexp
from whisper_cli.loading import LoadedModel

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Rules:
    """What the rules of one run need, as device tensors made once."""

    suppress: torch.Tensor  # (V,) bool: never sampled
    begin_suppress: torch.Tensor  # (V,) bool: not sampled as the first token
    ts_index: torch.Tensor  # (n_ts,) 0 .. n_ts - 1
    eot: int
    timestamp_begin: int
    timestamps: bool

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors, which a compiled step reads beside the state and caches."""
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    @classmethod
    def build(cls, loaded: LoadedModel, timestamps: bool, max_initial_timestamp: float) -> Rules:
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
            # First token: a timestamp no later than max_initial_timestamp.
            last_initial = ts_begin + round(max_initial_timestamp / 0.02)
            begin_suppress |= (vocab < ts_begin) | (vocab > last_initial)
        return cls(
            suppress=suppress,
            begin_suppress=begin_suppress,
            ts_index=torch.arange(loaded.config.vocab_size - ts_begin, device=device),
            eot=special.eot,
            timestamp_begin=ts_begin,
            timestamps=timestamps,
        )


def apply_rules(
    rules: Rules,
    logits: torch.Tensor,
    index: torch.Tensor,
    last: torch.Tensor,
    penult: torch.Tensor,
    max_ts: torch.Tensor,
    speech_after: torch.Tensor | None,
) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits with the rules applied; the input is left alone.

    index: () int64, the step (0: the first sampled token); last, penult, max_ts: (B,)
    int64, the last two tokens (-1 before any) and the largest timestamp so far (-1).
    speech_after (B, n_ts) bool: whether speech lies after each timestamp (see
    decoding.DecodeState); while it does after a row's latest timestamp, it may not end.
    """
    first = index == 0
    logits = logits.masked_fill(torch.where(first, rules.begin_suppress, rules.suppress), NEG_INF)
    if not rules.timestamps:
        return logits
    # `logits` is this function's own tensor now: the rules fill slices of it in place
    # (text, end and timestamp tokens each see only their own columns).
    ts_begin, eot = rules.timestamp_begin, rules.eot
    stamps = logits[:, ts_begin:]  # (B, n_ts) view
    last_ts = last >= ts_begin  # False at step 0 (last is -1)
    # openai-whisper: "penultimate was a timestamp" also holds while fewer than two tokens.
    penult_ts = (penult >= ts_begin) | (index < 2)
    # Timestamps come in pairs: after a pair, text; after a lone one, a timestamp or end.
    opened = last_ts & ~penult_ts
    stamps.masked_fill_((last_ts & penult_ts)[:, None], NEG_INF)
    logits[:, :eot].masked_fill_(opened[:, None], NEG_INF)
    # Timestamps never decrease, and a segment has a non-zero length (max_ts -1: no floor).
    floor = torch.where(opened, max_ts, max_ts + 1) - ts_begin
    stamps.masked_fill_(rules.ts_index < floor[:, None], NEG_INF)
    stamps_lse = f32_logsumexp(stamps)  # (B,) the timestamps' mass, unnormalised
    # The best text token other than end-of-text, and end-of-text itself (a view).
    others = torch.maximum(logits[:, :eot].amax(dim=-1), logits[:, eot + 1 : ts_begin].amax(dim=-1))
    eot_logit = logits[:, eot]
    if speech_after is not None:
        # The model ends a window early when it takes the last utterance for one that
        # runs on past the window, and after a pause it often ends wrongly: while the
        # speech map holds speech after the row's latest timestamp it may not end.
        latest = (max_ts - ts_begin).clamp(min=0)
        speech_left = last_ts & speech_after.gather(1, latest[:, None])[:, 0]
        eot_logit.masked_fill_(speech_left, NEG_INF)
    # If the timestamps together are likelier than any text token, emit a timestamp:
    # log-sum-exp(timestamps) > max(text) in log-probs, the row's normaliser cancels.
    stamps_win = stamps_lse > torch.maximum(others, eot_logit)
    logits[:, :ts_begin].masked_fill_(stamps_win[:, None], NEG_INF)
    return logits
