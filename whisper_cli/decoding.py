"""Batched greedy decoding of 30 s windows over the static KV cache.

The loop keeps every tensor shape fixed from step to step, so that the one-token
decode step can be compiled once and replayed (CUDA graphs). The logit rules
(suppressed tokens, timestamp rules) are vectorised over the batch and run on the
device; the host reads the device only to check whether every row has finished,
every `sync_every` steps. On the eager CPU path the batch may shrink as rows finish
(no work spent on finished rows); the compiled path keeps its fixed batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from whisper_cli.dtypes import encoder_input, f32_log_softmax, f32_logprob_sums, f32_logsumexp
from whisper_cli.loading import LoadedModel

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecodeOptions:
    task: str = "transcribe"
    timestamps: bool = True
    max_new_tokens: int = 224  # half the text context, as openai-whisper does
    prompt_tokens: tuple[int, ...] = ()  # previous-text conditioning (initial prompt)
    max_initial_timestamp: float = 1.0  # seconds
    sync_every: int = 1  # host reads of the "all finished" flag
    shrink_batch: bool = True  # eager path: drop finished rows from the batch
    # The repetition guard (see options.Policy).
    loop_check_every: int = 8
    max_loop_period: int = 16
    min_loop_span: int = 32


@dataclass(frozen=True)
class DecodedRow:
    """What one window decoded to."""

    tokens: tuple[int, ...]  # sampled tokens, end-of-text excluded
    avg_logprob: float
    no_speech_prob: float
    language: str | None
    looped: bool = False  # stopped by the repetition guard
    hit_max_tokens: bool = False  # used all of max_new_tokens without ending
    temperature: float = 0.0


@dataclass(frozen=True)
class LanguageGuess:
    code: str
    probability: float


class GreedyDecoder:
    """Encodes a batch of log-mels and decodes each row greedily."""

    def __init__(
        self, loaded: LoadedModel, options: DecodeOptions, step: StepFn | None = None
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.options = options
        self.compiled_step = step  # fixed-shape step; None: eager calls over the filled cache
        self.forward_passes = 0  # decoder calls of decode(): prompt passes and token steps
        self.special = loaded.tokenizer.special
        cfg = loaded.config
        device = self.model.device
        prompt_len = len(
            loaded.tokenizer.prompt("en", options.task, options.timestamps, options.prompt_tokens)
        )
        self.max_new = min(options.max_new_tokens, cfg.max_target_positions - prompt_len)
        self.cache_len = prompt_len + self.max_new
        vocab = torch.arange(cfg.vocab_size, device=device)
        self.vocab = vocab
        gen = loaded.generation
        self.suppress = self._mask(gen.suppress_tokens)  # (V,) bool
        self.begin_suppress = self._mask(gen.begin_suppress_tokens) | self.suppress
        ts_begin = self.special.timestamp_begin
        self.ts_index = torch.arange(cfg.vocab_size - ts_begin, device=device)  # (n_ts,)
        if options.timestamps:
            self.suppress[self.special.no_timestamps] = True
            self.begin_suppress[self.special.no_timestamps] = True
            # First token: a timestamp no later than max_initial_timestamp.
            last_initial = ts_begin + round(options.max_initial_timestamp / 0.02)
            self.begin_suppress |= (vocab < ts_begin) | (vocab > last_initial)

    def _mask(self, ids: tuple[int, ...]) -> torch.Tensor:
        mask = torch.zeros_like(self.vocab, dtype=torch.bool)
        valid = [i for i in ids if 0 <= i < mask.shape[0]]
        mask[valid] = True
        return mask

    # -- encoder and caches -------------------------------------------------------

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) float32 log-mel -> (B, S, C) encoder output in the model dtype."""
        return self.model.encoder(encoder_input(mel, self.model.dtype))

    def _prepare(self, audio_features: torch.Tensor) -> None:
        """Caches for this batch: allocated when their shape changes, cross K/V filled once.

        The caches live on the model, which several decoders (other prompt lengths or
        max_new_tokens) may share, so their actual shapes decide.
        """
        b, s, _ = audio_features.shape
        decoder = self.model.decoder
        caches = decoder.caches()
        if (
            not caches
            or caches[0].k.shape[:3] != (b, decoder.heads, self.cache_len)
            or (caches[1].k.shape[2] != s)
        ):
            decoder.setup_caches(b, self.cache_len, s)
        if decoder.cross_source is not audio_features:  # detection may have filled them
            decoder.fill_cross_caches(audio_features)

    # -- language detection ---------------------------------------------------------

    @torch.inference_mode()
    def language_probs(self, audio_features: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Language codes and each row's probabilities over them, (B, n_languages) float32,
        from the logits after <|startoftranscript|>."""
        tokenizer = self.loaded.tokenizer
        self._prepare(audio_features)
        b = audio_features.shape[0]
        device = audio_features.device
        tokens = torch.full((b, 1), self.special.sot, dtype=torch.long, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        logits = self.model.decoder(tokens, positions, visible=1)
        codes = list(tokenizer.language_ids)
        ids = torch.tensor([tokenizer.language_ids[c] for c in codes], device=device)
        return codes, f32_log_softmax(logits[:, 0, ids]).exp()  # over language tokens only

    # -- greedy decode ---------------------------------------------------------------

    @torch.inference_mode()
    def decode(
        self,
        audio_features: torch.Tensor,
        languages: list[str | None],
        speech_after: torch.Tensor | None = None,
        temperatures: list[float] | None = None,
        seeds: list[int] | None = None,
    ) -> list[DecodedRow]:
        """Decode every row of a batch of encoder outputs, (B, S, C).

        speech_after (B, n_timestamps) bool, timestamp mode only: whether the audio after
        each timestamp still holds speech (from the speech map). While it does after a
        row's latest timestamp, that row may not end (see _apply_rules).
        temperatures: per row; 0 is greedy, above 0 samples from softmax(logits / T) with
        the row's own generator, seeded by `seeds`, so a row's text does not depend on
        the other rows of its batch.
        """
        b = audio_features.shape[0]
        device = audio_features.device
        self._prepare(audio_features)
        tokenizer = self.loaded.tokenizer
        prompts = [
            tokenizer.prompt(
                lang, self.options.task, self.options.timestamps, self.options.prompt_tokens
            )
            for lang in languages
        ]
        tokens = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T0)
        sot_index = prompts[0].index(self.special.sot)
        t0 = tokens.shape[1]
        logits = self.model.decoder(tokens, torch.arange(t0, device=device), t0)  # (B, T0, V)
        self.forward_passes += 1
        no_speech = f32_log_softmax(logits[:, sot_index])[:, self.special.no_speech].exp()
        logits = logits[:, -1]  # (B, V)

        temperatures = temperatures or [0.0] * b
        sampler = _Sampler.start(temperatures, seeds or [0] * b, logits)
        out = torch.full((b, self.max_new), self.special.eot, dtype=torch.long, device=device)
        state = _RowState.start(b, device, speech_after)
        final = _RowState.start(b, device)  # per-row results, kept as rows are dropped
        rows = torch.arange(b, device=device)  # global row of each active row
        positions = torch.arange(t0, self.cache_len, device=device)
        o = self.options
        for i in range(self.max_new):
            logits = self._apply_rules(logits, state, i)
            next_tokens = sampler.choose(logits)
            next_tokens = torch.where(state.finished, self.special.eot, next_tokens)
            # The chosen token's log-prob: its logit less the row's log-sum-exp.
            chosen = logits.gather(1, next_tokens[:, None])[:, 0] - f32_logsumexp(logits)
            chosen = torch.where(state.finished, 0.0, chosen)
            state.sum_logprob += chosen
            state.advance(next_tokens, self.special.timestamp_begin)
            state.finished |= next_tokens == self.special.eot
            out[rows, i] = next_tokens
            if i + 1 == self.max_new:
                break
            if (i + 1) % o.loop_check_every == 0:
                self._stop_loops(out, rows, state, i + 1)
            if (i + 1) % self.options.sync_every == 0:
                n_active = int((~state.finished).sum())
                if n_active == 0:
                    break
                # Eager path: drop finished rows once they are a quarter of the batch.
                if self.options.shrink_batch and n_active <= 0.75 * len(rows):
                    keep = (~state.finished).nonzero()[:, 0]
                    state.store_results(final, rows)
                    rows, next_tokens = rows[keep], next_tokens[keep]
                    state = state.select(keep)
                    sampler = sampler.select(keep)
                    self.model.decoder.keep_rows(keep)
            if self.compiled_step is not None:
                logits = self.compiled_step(next_tokens[:, None], positions[i : i + 1])
            else:
                logits = self.model.decoder(next_tokens[:, None], positions[i : i + 1], t0 + i + 1)
            logits = logits[:, -1]
            self.forward_passes += 1

        state.store_results(final, rows)
        eot = self.special.eot
        results = []
        for r, (seq, total, cut) in enumerate(
            zip(out.tolist(), final.sum_logprob.tolist(), final.loop_cut.tolist(), strict=True)
        ):
            n = seq.index(eot) if eot in seq else len(seq)
            results.append(
                DecodedRow(
                    tokens=tuple(seq[: min(n, cut) if cut >= 0 else n]),
                    avg_logprob=total / (n + 1),  # as openai-whisper: end-of-text counts
                    no_speech_prob=float(no_speech[r]),
                    language=languages[r],
                    looped=cut >= 0,
                    hit_max_tokens=cut < 0 and eot not in seq,
                    temperature=temperatures[r],
                )
            )
        return results

    def _stop_loops(self, out: torch.Tensor, rows: torch.Tensor, state: _RowState, n: int) -> None:
        """Repetition guard, on the device: finish rows whose recent tokens repeat a period.

        Timestamps are compared as one symbol, so "text <|t|><|t'|> text ..." loops are
        caught although their times advance. A looping row keeps its tokens up to the
        repeated span (the span's repetitions are cut).
        """
        ts_begin = self.special.timestamp_begin
        seq = out.index_select(0, rows)[:, :n]  # (rows, n)
        seq = torch.where(seq >= ts_begin, ts_begin, seq)
        for period in range(1, self.options.max_loop_period + 1):
            span = max(self.options.min_loop_span, 3 * period)
            if span + period > n:
                break
            periodic = (seq[:, n - span :] == seq[:, n - span - period : n - period]).all(dim=1)
            new = periodic & ~state.finished
            state.loop_cut = torch.where(new, n - span, state.loop_cut)
            state.finished |= new

    def _apply_rules(self, logits: torch.Tensor, state: _RowState, i: int) -> torch.Tensor:
        """Suppressed tokens and the timestamp rules, on the device: (rows, V) -> (rows, V).

        The first fill makes a new tensor (a compiled step's output is left alone); the
        rules then fill slices of it in place: text, end and timestamp tokens each see
        only their own columns.
        """
        inf = float("-inf")
        logits = logits.masked_fill(self.begin_suppress if i == 0 else self.suppress, inf)
        if not self.options.timestamps:
            return logits
        ts_begin, eot = self.special.timestamp_begin, self.special.eot
        stamps = logits[:, ts_begin:]  # (rows, n_ts) view
        if i > 0:
            last_ts = state.last >= ts_begin
            penult_ts = state.penult >= ts_begin if i >= 2 else torch.ones_like(last_ts)
            # Timestamps come in pairs: after a pair, text; after a lone one, a timestamp/eot.
            opened = last_ts & ~penult_ts
            stamps.masked_fill_((last_ts & penult_ts)[:, None], inf)
            logits[:, :eot].masked_fill_(opened[:, None], inf)
            # Timestamps never decrease, and a segment has a non-zero length.
            floor = torch.where(opened, state.max_ts, state.max_ts + 1) - ts_begin
            stamps.masked_fill_(self.ts_index < floor[:, None], inf)
        stamps_lse = f32_logsumexp(stamps)  # (rows,) the timestamps' mass, unnormalised
        # The best text token other than end-of-text, and end-of-text itself (a view).
        others = torch.maximum(
            logits[:, :eot].amax(dim=-1), logits[:, eot + 1 : ts_begin].amax(dim=-1)
        )
        eot_logit = logits[:, eot]
        if i > 0 and state.speech_after is not None:
            # The model ends a window early when it takes the last utterance for one that
            # runs on past the window, and after a pause it often ends wrongly: while the
            # speech map holds speech after the row's latest timestamp it may not end.
            latest = (state.max_ts - ts_begin).clamp(min=0)
            speech_left = last_ts & state.speech_after.gather(1, latest[:, None])[:, 0]
            eot_logit.masked_fill_(speech_left, inf)
        # If the timestamps together are likelier than any text token, emit a timestamp:
        # log-sum-exp(timestamps) > max(text) in log-probs, the row's normaliser cancels.
        stamps_win = stamps_lse > torch.maximum(others, eot_logit)
        logits[:, :ts_begin].masked_fill_(stamps_win[:, None], inf)
        return logits


@dataclass
class _RowState:
    """Per-row decoding state, all on the device: (rows,) tensors."""

    last: torch.Tensor
    penult: torch.Tensor
    max_ts: torch.Tensor  # largest timestamp token so far, -1 if none
    finished: torch.Tensor
    sum_logprob: torch.Tensor
    loop_cut: torch.Tensor  # where a looping row's tokens are cut, -1 if it did not loop
    speech_after: torch.Tensor | None  # (rows, n_timestamps) bool, see decode()

    RESULTS = ("sum_logprob", "loop_cut")

    @classmethod
    def start(
        cls, b: int, device: torch.device, speech_after: torch.Tensor | None = None
    ) -> _RowState:
        minus_one = torch.full((b,), -1, dtype=torch.long, device=device)
        return cls(
            last=minus_one.clone(),
            penult=minus_one.clone(),
            max_ts=minus_one.clone(),
            finished=torch.zeros(b, dtype=torch.bool, device=device),
            sum_logprob=f32_logprob_sums(b, device),
            loop_cut=minus_one.clone(),
            speech_after=speech_after,
        )

    def advance(self, tokens: torch.Tensor, ts_begin: int) -> None:
        self.penult = self.last
        self.last = tokens
        self.max_ts = torch.where(
            tokens >= ts_begin, torch.maximum(self.max_ts, tokens), self.max_ts
        )

    def select(self, keep: torch.Tensor) -> _RowState:
        return _RowState(
            *(None if t is None else t.index_select(0, keep) for t in vars(self).values())
        )

    def store_results(self, final: _RowState, rows: torch.Tensor) -> None:
        """Write these rows' results into `final`, the whole batch's, at global `rows`."""
        for name in self.RESULTS:
            getattr(final, name)[rows] = getattr(self, name)


@dataclass
class _Sampler:
    """Greedy choice, or sampling at a row's temperature with the row's own generator."""

    temperature: torch.Tensor  # (rows,) in the logits' dtype
    generators: list[torch.Generator | None]  # per active row; None: greedy

    @classmethod
    def start(cls, temperatures: list[float], seeds: list[int], logits: torch.Tensor) -> _Sampler:
        generators: list[torch.Generator | None] = []
        for t, seed in zip(temperatures, seeds, strict=True):
            g = None
            if t > 0:
                g = torch.Generator(device=logits.device)
                g.manual_seed(seed)
            generators.append(g)
        temperature = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
        return cls(temperature, generators)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, V) -> (rows,) tokens: argmax, or argmax(logits / T + Gumbel noise), which is
        a draw from softmax(logits / T)."""
        if all(g is None for g in self.generators):
            return logits.argmax(dim=-1)
        scores = logits.clone()
        for r, g in enumerate(self.generators):
            if g is not None:
                gumbel = torch.empty_like(logits[r]).exponential_(generator=g).log_().neg_()
                scores[r] = logits[r] / self.temperature[r] + gumbel
        return scores.argmax(dim=-1)

    def select(self, keep: torch.Tensor) -> _Sampler:
        kept = keep.tolist()
        return _Sampler(self.temperature[keep], [self.generators[r] for r in kept])
