"""The decode state of a batch and the one-token step over it.

`step` is the whole of one decode step (forward, logit rules, choice, log-prob, state
update) as one function over tensors updated in place: no host value, no Python branch
on the data, so that on CUDA it is compiled whole into one graph and replayed (see
engine.py, which runs the loop, and rules.py). A draw inverts the row's cumulative
softmax at a uniform from a counter-based hash of (row seed, step), computed on the
device: the same draw eager and compiled, and never dependent on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whisper_cli.dtypes import f32_log_softmax, f32_logprobs, f32_softmax
from whisper_cli.model import DecodeCaches, Extent, Whisper
from whisper_cli.options import MAX_NEW_TOKENS, Policy
from whisper_cli.rules import Rules, SkipLimits, SpeechGrid, apply_rules


@dataclass(frozen=True)
class DecodeOptions:
    task: str = "transcribe"
    timestamps: bool = True
    max_new_tokens: int = MAX_NEW_TOKENS
    prompt_tokens: tuple[int, ...] = ()  # previous-text conditioning (initial prompt)
    # The thresholds the decode reads: the repetition guard, the speech the rules hold a
    # row open for and the speech a timestamp may pass over.
    policy: Policy = field(default_factory=Policy)

    @property
    def skip(self) -> SkipLimits:
        p = self.policy
        return SkipLimits.from_seconds(
            p.segment_speech_seconds, p.segment_speech_per_token_seconds, p.gap_speech_seconds
        )


@dataclass(frozen=True)
class DecodedRow:
    """What one window decoded to."""

    tokens: tuple[int, ...]  # sampled tokens, end-of-text excluded
    avg_logprob: float
    # The log-prob of each of `tokens` when it was chosen (the judge reads a segment's own).
    token_logprobs: tuple[float, ...]
    no_speech_prob: float
    language: str | None
    looped: bool = False  # stopped by the repetition guard
    hit_max_tokens: bool = False  # used all of max_new_tokens without ending
    temperature: float = 0.0


@dataclass(frozen=True)
class LanguageGuess:
    code: str
    probability: float


@dataclass
class Probe:
    """Teacher forcing and logit capture through the decode's own step, in fixed buffers
    the step writes at each index (tools compare devices and compiled against eager this
    way). A probed decode runs every row for every step: no row finishes."""

    logits: torch.Tensor  # (B, steps, V) model dtype: each step's logits, before the rules
    chosen: torch.Tensor  # (B, steps) int64: the token the step chose
    forced: torch.Tensor | None  # (B, steps) int64: fed to the next step in its place

    @classmethod
    def make(
        cls,
        rows: int,
        steps: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
        forced: torch.Tensor | None = None,
    ) -> Probe:
        return cls(
            logits=torch.zeros(rows, steps, vocab, dtype=dtype, device=device),
            chosen=torch.zeros(rows, steps, dtype=torch.long, device=device),
            forced=None if forced is None else forced.to(device),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.logits, self.chosen, self.forced) if t is not None]


@dataclass
class DecodeState:
    """Everything a decode step reads and writes, as device tensors: (B,) per row unless
    noted. Updated in place, so a compiled step replays over the same buffers.

    Each row counts its own tokens (`index`): a row refilled with a new window mid-decode
    (engine.py) starts at 0 while the others go on. A finished row writes its end-of-text
    tokens to a spare last column, so a row that used all max_new tokens keeps them."""

    tokens: torch.Tensor  # (B, max_new + 1) int64: sampled tokens, end-of-text after the end
    index: torch.Tensor  # int64: how many tokens the row has sampled
    finished: torch.Tensor  # bool
    logprobs: torch.Tensor  # (B, max_new + 1) float32 (listed exception): chosen log-probs
    loop_cut: torch.Tensor  # int64: where a looping row's tokens are cut, -1 if it did not
    temperature: torch.Tensor  # in the logits' dtype: 0 is greedy
    seed: torch.Tensor  # int64 in [0, 2^32): the row's sampling seed
    # (B, n_ts) each, the rows' rules.SpeechGrid: speech after / before each timestamp
    speech_after: torch.Tensor | None
    speech_before: torch.Tensor | None
    prompt_length: int  # the prompt's positions: sampled token i sits at prompt_length + i
    probe: Probe | None = None

    @classmethod
    def start(
        cls,
        max_new: int,
        prompt_length: int,
        temperatures: list[float],
        seeds: list[int],
        eot: int,
        dtype: torch.dtype,
        device: torch.device,
        speech: SpeechGrid | None = None,
        probe: Probe | None = None,
    ) -> DecodeState:
        b = len(temperatures)
        minus_one = torch.full((b,), -1, dtype=torch.long, device=device)
        folded = [(s ^ (s >> 32)) & _M32 for s in seeds]
        return cls(
            tokens=torch.full((b, max_new + 1), eot, dtype=torch.long, device=device),
            index=torch.zeros(b, dtype=torch.long, device=device),
            finished=torch.zeros(b, dtype=torch.bool, device=device),
            logprobs=f32_logprobs(b, max_new + 1, device),
            loop_cut=minus_one.clone(),
            temperature=torch.tensor(temperatures, dtype=dtype, device=device),
            seed=torch.tensor(folded, dtype=torch.long, device=device),
            speech_after=None if speech is None else speech.after,
            speech_before=None if speech is None else speech.before,
            prompt_length=prompt_length,
            probe=probe,
        )

    @property
    def max_new(self) -> int:
        return self.tokens.shape[1] - 1

    def positions(self, in_step: bool) -> torch.Tensor:
        """The position of each row's latest sampled token, the next step's input: (1,)
        int64 shared by every row when they are `in_step` (none refilled), else (B, 1).
        A finished row's stops at the last slot a row can write."""
        if in_step:
            return self.index[:1] + (self.prompt_length - 1)
        return (self.index.clamp(max=self.max_new) + (self.prompt_length - 1))[:, None]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step reads or writes (a compiled step's fixed addresses)."""
        fields = [getattr(self, name) for name in _PER_ROW]
        probe = self.probe.tensors() if self.probe is not None else []
        return [t for t in (*fields, *probe) if t is not None]

    def recent(self, back: int) -> torch.Tensor:
        """(B,) the token sampled `back` steps ago (1: the latest), -1 before the first.

        Read from `tokens` rather than kept apart: inductor may reorder the in-place
        updates of separate "last" and "penultimate" buffers.
        """
        at = (self.index - back).clamp(min=0, max=self.max_new)[:, None]
        return torch.where(self.index >= back, self.tokens.gather(1, at)[:, 0], -1)

    def max_timestamp(self, timestamp_begin: int) -> torch.Tensor:
        """(B,) the largest timestamp token sampled so far, -1 if none (tokens after the
        index are end-of-text, below the timestamps)."""
        return torch.where(self.tokens >= timestamp_begin, self.tokens, -1).amax(dim=1)

    def text_run(self, timestamp_begin: int) -> torch.Tensor:
        """(B,) text tokens sampled since the row's latest timestamp (all of them if none)."""
        steps = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        latest = torch.where(self.tokens >= timestamp_begin, steps, -1).amax(dim=1)
        return self.index - 1 - latest

    def select(self, rows: torch.Tensor) -> DecodeState:
        """The state of `rows` only (the eager path drops finished rows; a probed decode
        never does)."""
        picked = {
            name: None if getattr(self, name) is None else getattr(self, name).index_select(0, rows)
            for name in _PER_ROW
        }
        return DecodeState(**picked, prompt_length=self.prompt_length, probe=self.probe)

    def copy_(self, other: DecodeState) -> None:
        """Take `other`'s values into these buffers (a compiled step's fixed addresses)."""
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.copy_(theirs)

    def put(self, rows: torch.Tensor, other: DecodeState) -> None:
        """Take `other`'s rows (every field, in order) into these buffers at `rows`, in
        place (a refilled row's fresh state)."""
        for name in _PER_ROW:
            mine = getattr(self, name)
            if mine is not None:
                mine.index_copy_(0, rows, getattr(other, name))


# The state's (B, ...) fields, one row each.
_PER_ROW = (
    "tokens",
    "index",
    "finished",
    "logprobs",
    "loop_cut",
    "temperature",
    "seed",
    "speech_after",
    "speech_before",
)


def step(
    model: Whisper,
    rules: Rules,
    state: DecodeState,
    caches: DecodeCaches,
    extent: Extent,
    sample: bool,
    in_step: bool,
) -> None:
    """One decode step: the forward of each row's latest token, then `choose`.

    extent: the cache slots the forward reads (model.Extent; FIXED in the compiled step).
    sample: whether any row draws (a static argument: the compiled greedy step has no
    draw in its graph). in_step: every row is at the same step (see DecodeState.positions).
    """
    positions = state.positions(in_step)
    logits = model.decoder(state.recent(1)[:, None], positions, caches, extent)
    choose(rules, state, logits[:, -1], sample)


def choose(
    rules: Rules, state: DecodeState, logits: torch.Tensor, sample: bool, first: bool = False
) -> None:
    """From a step's (B, V) logits (the caller's own: the rules fill them in place): apply
    the rules, choose each row's token (argmax, or a draw at its temperature when
    `sample`), add its log-prob, and update the state. first: every row chooses its first
    token (the prompt's pass; a step never does)."""
    finished = state.finished
    # Where each row writes: its index, or the spare column once finished.  (B, 1)
    at = torch.where(finished, state.max_new, state.index)[:, None]
    probe = state.probe
    if probe is not None:
        probe.logits.scatter_(1, at[:, :, None].expand(-1, 1, logits.shape[1]), logits[:, None])
    last, penult = state.recent(1), state.recent(2)
    max_ts = state.max_timestamp(rules.timestamp_begin)
    text_run = None if state.speech_before is None else state.text_run(rules.timestamp_begin)
    logits = apply_rules(
        rules,
        logits,
        state.index,
        last,
        penult,
        max_ts,
        state.speech_after,
        state.speech_before,
        text_run,
        first,
    )
    greedy = first_argmax(logits)
    if sample:
        drawn = draw(logits, state.temperature, uniform(state.seed, state.index), greedy)
        tokens = torch.where(state.temperature > 0, drawn, greedy)
    else:
        tokens = greedy
    tokens = torch.where(finished, rules.eot, tokens)  # (B,)
    # The chosen token's log-prob. log_softmax is one fused kernel, where logsumexp runs
    # its max, subtract, exp and sum as separate ops over (B, V): 0.25 against 0.59 ms
    # (f32, 16 rows of tiny.en's vocabulary, AMD EPYC Zen 4).
    chosen = f32_log_softmax(logits).gather(1, tokens[:, None])[:, 0]
    state.logprobs.scatter_(1, at, torch.where(finished, 0.0, chosen)[:, None])
    if probe is not None:
        probe.chosen.scatter_(1, at, tokens[:, None])
        if probe.forced is not None:
            tokens = probe.forced.gather(1, at)[:, 0]
    state.tokens.scatter_(1, at, tokens[:, None])
    state.index.add_(1)
    if probe is None:
        # Ended, or out of tokens (its last one written).
        state.finished.logical_or_((tokens == rules.eot) | (state.index >= state.max_new))


ARGMAX_BLOCK = 256  # columns per block of first_argmax


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B,) int64: the index of each row's first maximum (as argmax, NaN the
    largest), from the maxima of blocks of ARGMAX_BLOCK columns: the first block that
    holds the row's maximum, then its first maximum there.

    On CPU max(dim) and argmax over the vocabulary take 0.65 and 0.47 ms at 16 rows in
    f32 (max 0.42 in bf16), amax over the same rows 0.04 (0.11): this takes 0.11 (0.25),
    measured on AMD EPYC Zen 4; every step makes this choice."""
    b, n = x.shape
    whole = n // ARGMAX_BLOCK * ARGMAX_BLOCK
    peaks = x[:, :whole].view(b, -1, ARGMAX_BLOCK).amax(dim=-1)  # (B, N // block)
    if whole < n:
        peaks = torch.cat([peaks, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = peaks.argmax(dim=-1) * ARGMAX_BLOCK  # (B,) the first block holding the max
    # The block's columns; past the last column, the last one again (found after it).
    cols = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=x.device)).clamp_(max=n - 1)
    return start + x.gather(1, cols).argmax(dim=-1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, after Wellons' "lowbias32") on int64
    values in [0, 2^32). The multipliers are below 2^31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B,) seeds, (B,) steps -> (B,) float32 uniforms in (0, 1), a pure function of (seed,
    step): the same on every device, eager or compiled. Float32 (listed exception): a
    half-precision uniform has 8 bits and rounds to 1.

    23 hash bits on the grid k / 2^23 + 2^-24: every value is exact in float32, the
    least is 2^-24 and the largest 1 - 2^-24 (24 bits plus a half step would round to 1).
    """
    bits = _mix32(seed ^ _mix32(index & _M32))  # (B,)
    return (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24


def draw(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, likeliest: torch.Tensor
) -> torch.Tensor:
    """(B, V) logits, (B,) temperatures, (B,) uniforms -> (B,) tokens drawn from
    softmax(logits / T) by inverting its cumulative distribution at u (rows at T 0 draw
    at T 1; the caller keeps their argmax). likeliest: (B,) the logits' argmax, which the
    caller has already (the softmax's argmax too, T > 0 keeping the order).

    One uniform a row rather than Gumbel noise for every token: hashing (B, V) integers
    a step costs several times the whole draw.
    """
    t = torch.where(temperature > 0, temperature, 1.0)
    probs = f32_softmax(logits, t[:, None])  # (B, V) float32
    cdf = probs.cumsum(dim=-1)
    target = u[:, None] * cdf[:, -1:]
    # The first token past the target that has mass of its own. Not searchsorted: a
    # parallel scan (CUDA) need not keep the sums flat across suppressed tokens nor
    # non-decreasing, so "first cdf above the target" could land on a -inf token.
    hit = (cdf > target) & (probs > 0)
    first = hit.to(torch.int8).argmax(dim=-1)  # argmax returns the first of equal maxima
    # No hit only when rounding puts the target at the total: the likeliest token then.
    return torch.where(hit.any(dim=-1), first, likeliest)


def stop_loops(state: DecodeState, policy: Policy, timestamp_begin: int) -> None:
    """Repetition guard, on the device: finish rows whose recent tokens repeat a period.

    A row is judged when it has sampled a multiple of policy.loop_check_every tokens (its
    own count, whatever step the batch is at), on the last max(min_loop_span, 3 * period)
    of them against those one period before, for each period up to max_loop_period; the
    shortest period that repeats wins. Timestamps are compared as one symbol, so "text
    <|t|> <|t'|> text ..." loops are caught although their times advance. A looping row
    keeps its tokens up to the repeated span (the span's repetitions are cut).
    """
    seq = state.tokens[:, : state.max_new]
    seq = torch.where(seq >= timestamp_begin, timestamp_begin, seq)
    device = seq.device
    periods = torch.arange(1, policy.max_loop_period + 1, device=device)  # (P,)
    spans = periods.mul(3).clamp(min=policy.min_loop_span)  # (P,)
    # The longest span, from the policy on the host (reading spans.max() would wait for
    # the device inside the decode loop).
    longest = max(policy.min_loop_span, 3 * policy.max_loop_period)
    offsets = torch.arange(longest, device=device)  # (S,)
    n = state.index[:, None, None]  # (B, 1, 1)
    # Each period's last `span` tokens of the row, and those one period before.  (B, P, S)
    at = (n - spans[:, None] + offsets).clamp(min=0, max=seq.shape[1] - 1)
    before = (at - periods[:, None]).clamp(min=0)
    b = seq.shape[0]
    same = seq.gather(1, at.view(b, -1)) == seq.gather(1, before.view(b, -1))
    within = offsets < spans[:, None]  # (P, S): the span's own offsets
    periodic = (same.view(at.shape) | ~within).all(dim=-1)  # (B, P)
    periodic &= n[:, :, 0] >= spans + periods
    index = state.index
    due = (index % policy.loop_check_every == 0) & ~state.finished
    new = periodic.any(dim=1) & due
    shortest = periodic.to(torch.int8).argmax(dim=1)  # the first True
    state.loop_cut.copy_(torch.where(new, index - spans[shortest], state.loop_cut))
    state.finished.logical_or_(new)


def decoded_rows(
    state: DecodeState,
    slots: list[int],
    eot: int,
    no_speech: list[float],
    languages: list[str | None],
    temperatures: list[float],
) -> list[DecodedRow]:
    """The host's view of finished rows: one DecodedRow per state row in `slots`, with
    that row's no-speech probability, language and temperature (lists in `slots`' order)."""
    results = []
    at = torch.tensor(slots, dtype=torch.long, device=state.tokens.device)
    n_max = state.max_new
    for seq, logprobs, cut, no_speech_prob, language, temperature in zip(
        state.tokens[at, :n_max].tolist(),
        state.logprobs[at, :n_max].tolist(),
        state.loop_cut[at].tolist(),
        no_speech,
        languages,
        temperatures,
        strict=True,
    ):
        n = seq.index(eot) if eot in seq else len(seq)
        kept = min(n, cut) if cut >= 0 else n
        results.append(
            DecodedRow(
                tokens=tuple(seq[:kept]),
                token_logprobs=tuple(logprobs[:kept]),
                avg_logprob=sum(logprobs) / (n + 1),  # as openai-whisper: end-of-text counts
                no_speech_prob=no_speech_prob,
                language=language,
                looped=cut >= 0,
                hit_max_tokens=cut < 0 and eot not in seq,
                temperature=temperature,
            )
        )
    return results
