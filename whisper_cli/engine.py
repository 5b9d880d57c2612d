"""The engine: one batch of 30 s windows end to end, and the counters of what it ran.

`Engine.run` owns a batch: the padding of a compiled batch, the encoder (windows
encoded in an earlier batch are not encoded again), the language pass, the prefill, the
decode loop and the rows' results; `Engine.align` is the word-alignment pass over the
same batch, on the cross K/V its decode projected. Each run's data lives in its own
objects (`Decoded`), never on the engine, except a compiled step's fixed buffers.

It is the one place that knows eager from compiled:
- eager (CPU default): fresh caches and state per batch; finished rows are dropped from
  the batch as the decode goes, so no work is spent on them.
- compiled (`torch.compile` of the whole step, CUDA graphs on CUDA): one fixed batch
  shape, padded with silent rows; the caches and the state are buffers made once and
  refilled in place per batch, so the step compiles once and replays.
The host reads the device only every `sync_every` steps (has every row finished?) and
for the repetition guard; a caller that watches the decode (`on_rows`) is told each row's
latest timestamp in the same read, at most every PROGRESS_SECONDS. Counters say what
ran, so that tools measure through them instead of patching.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from whisper_cli import decoding
from whisper_cli.decoding import DecodedRow, DecodeOptions, DecodeState, Probe
from whisper_cli.dtypes import encoder_input, f32_log_softmax
from whisper_cli.features import batch_log_mel
from whisper_cli.loading import LoadedModel
from whisper_cli.model import FIXED, KV, DecodeCaches, Extent
from whisper_cli.rules import Rules, SpeechGrid
from whisper_cli.timing import Aligner, AlignRow, WindowWords
from whisper_cli.tokenizer import TIME_PRECISION

CACHE_MULTIPLE = 16  # self-attention cache length rounded up to this (aligned tiles)
# Wall seconds between two reports to `on_rows`: a progress display needs no more, and a
# report is a wider read at a sync point the loop makes anyway, never a sync of its own.
PROGRESS_SECONDS = 0.25

# What `on_rows` gets: batch row -> seconds into its window of its latest timestamp (0.0
# before the first one), or None once the row has finished.
RowPositions = dict[int, float | None]
# The language pass's verdict (see Engine.run): given the language codes and every real
# row's probabilities over them, (n, n_languages) float32, each row's language.
LanguagePicker = Callable[[list[str], np.ndarray], list[str]]


@dataclass(frozen=True)
class WindowInput:
    """One row of a batch: a window to decode, at one temperature."""

    audio: np.ndarray  # (n,) float32 16 kHz samples, at most 30 s
    # (S, C): its encoder output from an earlier batch (then it is not encoded again)
    features: torch.Tensor | None = None
    # Its language; None on a multilingual model: found by the language pass.
    language: str | None = None
    temperature: float = 0.0  # 0 is greedy (see Engine.run)
    seed: int = 0
    # Its speech map (speech.FRAME_SECONDS frames, bool), for the rules that keep a decode
    # from ending before speech or passing over it (timestamps only); None: no map.
    speech: np.ndarray | None = None


@dataclass(frozen=True)
class Decoded:
    """A decoded batch: its real rows' results, and what a later attempt at a row and
    the alignment pass need of the batch. Aligned before the engine's next run (a
    compiled engine refills its buffers then)."""

    rows: list[DecodedRow]
    features: torch.Tensor  # (B, S, C) the batch's encoder output, padding rows too
    cross: list[KV] | None  # the decode's cross K/V per layer, when the engine aligns
    run: int  # which of its engine's runs made it

    def kept(self, row: int) -> torch.Tensor:
        """(S, C) a row's encoder output, for a later attempt (a copy, not a view that
        would hold the whole batch)."""
        return self.features[row].clone()


@dataclass
class EngineCounters:
    """What the engine ran (cumulative; tools take differences)."""

    encoder_passes: int = 0
    encoded_rows: int = 0  # rows through the encoder, a compiled batch's padding too
    decodes: int = 0
    decoded_rows: int = 0  # rows decoded, padding too
    language_passes: int = 0
    prefills: int = 0
    steps: int = 0  # one-token decode steps (each for the whole current batch)
    row_steps: int = 0  # sum over steps of the rows in the batch (shrinking shows here)
    tokens: int = 0  # sampled text and timestamp tokens of the real rows, end-of-text excluded
    aligns: int = 0  # word-alignment passes
    graphs: int = 0  # graphs compiled for the step (torch.compile)
    recompiles: int = 0  # graphs compiled beyond the first of each step function
    graph_breaks: int = 0
    cudagraph_skips: int = 0  # steps that could not be recorded as CUDA graphs
    # Wall time, with the device synchronised (timed engines only): the encoder, the rest
    # of a run (language pass, prefill, loop) and the alignment passes.
    encode_s: float = 0.0
    decode_s: float = 0.0
    align_s: float = 0.0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dynamo_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["inductor"]["cudagraph_skips"],
    )


class Engine:
    """Encodes, decodes and aligns batches of 30 s windows for one run."""

    def __init__(
        self,
        loaded: LoadedModel,
        options: DecodeOptions,
        compile: bool = False,
        shrink: bool = True,
        words: bool = False,
        timed: bool = False,
    ) -> None:
        """compile: the whole step under torch.compile (fixed batch, padded); shrink:
        the eager path drops finished rows; words: align words (Engine.align), the decode's
        cross K/V kept for it; timed: synchronise the device around each stage and count
        its wall time."""
        self.loaded = loaded
        self.model = loaded.model
        self.options = options
        self.compile = compile
        self.shrink = shrink and not compile
        self.timed = timed
        self.counters = EngineCounters()
        self.special = loaded.tokenizer.special
        self.aligner = Aligner(loaded, options.task) if words else None
        device = self.model.device
        self.on_cuda = device.type == "cuda"
        # The host reads "all finished" every step on CPU (it drops rows then), every 8
        # steps on CUDA (each read waits for the device).
        self.sync_every = 8 if self.on_cuda else 1
        cfg = loaded.config
        prompt = loaded.tokenizer.prompt(
            "en", options.task, options.timestamps, options.prompt_tokens
        )
        self.prompt_length = len(prompt)
        self.max_new = min(options.max_new_tokens, cfg.max_target_positions - self.prompt_length)
        self.cache_length = min(
            _round_up(self.prompt_length + self.max_new, CACHE_MULTIPLE), cfg.max_target_positions
        )
        self.rules = Rules.build(loaded, options.timestamps, options.skip)
        self.n_timestamps = len(self.rules.ts_index)
        self._static: tuple[DecodeState, DecodeCaches] | None = None  # compiled buffers
        self._steps: dict[bool, Callable] = {}  # compiled step per `sample`
        self._runs = 0

    # -- a batch -----------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        rows: Sequence[WindowInput],
        pick_languages: LanguagePicker | None = None,
        pad_to: int = 0,
        on_rows: Callable[[RowPositions], None] | None = None,
        probe: Probe | None = None,
    ) -> Decoded:
        """Decode a batch of windows; results in row order.

        pick_languages: on a multilingual model, rows without a language need the
        language pass, and it decides their languages from its probabilities.
        pad_to: a compiled engine pads the batch to this many rows (its fixed shape).
        A row above temperature 0 draws from softmax(logits / T) at uniforms hashed from
        its seed and step, so its text does not depend on the other rows of its batch.
        on_rows: told where the real rows still decoding stand (see RowPositions).
        probe: teacher forcing and logit capture (see decoding.Probe).
        """
        self._runs += 1
        n = len(rows)
        b = max(n, pad_to) if self.compile else n
        features = self._encode(rows, b)
        started = self._start()
        caches = self._caches(features)
        languages = self._languages(rows, caches, pick_languages)
        padded = [*rows, *[WindowInput(np.zeros(0, np.float32))] * (b - n)]
        state = self._start_state(padded, probe)
        # Whether any row draws: the step's static argument (the greedy graph has no draw).
        sample = any(r.temperature > 0 for r in rows)
        no_speech = self._prefill(state, caches, [*languages, *[languages[0]] * (b - n)], sample)
        final = self._loop(state, caches, n, sample, on_rows, guard=probe is None)
        results = decoding.decoded_rows(
            final,
            self.special.eot,
            no_speech[:n],
            languages,
            [r.temperature for r in rows],
        )
        self.counters.tokens += sum(len(r.tokens) for r in results)
        self.counters.decodes += 1
        self.counters.decoded_rows += b
        self.counters.decode_s += self._stop(started)
        cross = caches.cross_kv() if self.aligner is not None else None
        return Decoded(results, features, cross, self._runs)

    @torch.inference_mode()
    def align(self, decoded: Decoded, texts: Sequence[AlignRow]) -> list[WindowWords]:
        """Word timings of `texts`, one per real row of `decoded` (rows with no tokens get
        none), from one teacher-forced pass over the batch."""
        if self.aligner is None:
            raise ValueError("this engine does not align words (Engine(words=True))")
        if decoded.run != self._runs:
            raise ValueError("a batch is aligned before the engine's next run")
        started = self._start()
        words = self.aligner.align(decoded.features, texts, decoded.cross)
        self.counters.align_s += self._stop(started)
        self.counters.aligns += 1
        return words

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) float32 log-mel -> (B, S, C) encoder output in the model dtype."""
        started = self._start()
        features = self.model.encoder(encoder_input(mel, self.model.dtype))
        self.counters.encode_s += self._stop(started)
        self.counters.encoder_passes += 1
        self.counters.encoded_rows += mel.shape[0]
        return features

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.model.device)

    # -- the stages of a run -------------------------------------------------------------

    def _encode(self, rows: Sequence[WindowInput], b: int) -> torch.Tensor:
        """(b, S, C): the rows' encoder outputs, then silent padding rows; only the rows
        not encoded before (and the padding) pass through the encoder."""
        fresh = [r for r, row in enumerate(rows) if row.features is None]
        n_encoded = len(fresh) + b - len(rows)
        encoded = None
        if n_encoded:
            mel = batch_log_mel(
                [rows[r].audio for r in fresh],
                n_encoded,
                self.loaded.config.num_mel_bins,
                self.model.device,
            )
            encoded = self.encode(mel)  # the fresh rows, then the padding
            if n_encoded == b:
                return encoded
        kept = [r for r, row in enumerate(rows) if row.features is not None]
        like = rows[kept[0]].features
        features = like.new_empty((b, *like.shape))
        features[kept] = torch.stack([rows[r].features for r in kept])
        if encoded is not None:
            features[fresh] = encoded[: len(fresh)]
            features[len(rows) :] = encoded[len(fresh) :]
        return features

    def _languages(
        self,
        rows: Sequence[WindowInput],
        caches: DecodeCaches,
        pick: LanguagePicker | None,
    ) -> list[str | None]:
        """Each row's language: its own, or the picker's from the language pass (one step
        after <|startoftranscript|> over the whole batch, read for the real rows)."""
        languages = [r.language for r in rows]
        if not self.loaded.tokenizer.is_multilingual or all(languages):
            return languages
        if pick is None:
            raise ValueError("rows without a language need a language picker")
        tokenizer = self.loaded.tokenizer
        device = self.model.device
        tokens = torch.full((caches.rows, 1), self.special.sot, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        logits = self.model.decoder(tokens, positions, caches, Extent(1))
        self.counters.language_passes += 1
        codes = list(tokenizer.language_ids)
        ids = torch.tensor([tokenizer.language_ids[c] for c in codes], device=device)
        probs = f32_log_softmax(logits[: len(rows), 0, ids]).exp()  # over languages only
        return list(pick(codes, probs.cpu().numpy()))

    def _start_state(self, rows: Sequence[WindowInput], probe: Probe | None) -> DecodeState:
        speech = None
        if self.options.timestamps and all(r.speech is not None for r in rows[:1]):
            # Padding rows have an empty map: never held open, nothing to pass over.
            p = self.options.policy
            maps = [r.speech if r.speech is not None else np.zeros(0, bool) for r in rows]
            speech = SpeechGrid.from_maps(
                maps,
                self.n_timestamps,
                p.min_speech_seconds,
                p.end_slack_seconds,
                self.model.device,
            )
        state = DecodeState.start(
            self.max_new,
            self.prompt_length,
            [r.temperature for r in rows],
            [r.seed for r in rows],
            self.special.eot,
            self.model.dtype,
            self.model.device,
            speech,
            probe,
        )
        return state

    def _prefill(
        self,
        state: DecodeState,
        caches: DecodeCaches,
        languages: list[str | None],
        sample: bool,
    ) -> list[float]:
        """The prompt through the decoder and the first token chosen; returns each row's
        no-speech probability (read after <|startoftranscript|>)."""
        tokenizer, o = self.loaded.tokenizer, self.options
        prompts = [
            tokenizer.prompt(lang, o.task, o.timestamps, o.prompt_tokens) for lang in languages
        ]
        device = self.model.device
        tokens = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T0)
        t0 = self.prompt_length
        logits = self.model.decoder(tokens, torch.arange(t0, device=device), caches, Extent(t0))
        self.counters.prefills += 1
        sot = prompts[0].index(self.special.sot)
        no_speech = f32_log_softmax(logits[:, sot])[:, self.special.no_speech].exp()
        decoding.choose(self.rules, state, logits[:, -1], sample)
        return no_speech.tolist()

    def _loop(
        self,
        state: DecodeState,
        caches: DecodeCaches,
        n: int,
        sample: bool,
        on_rows: Callable[[RowPositions], None] | None,
        guard: bool,
    ) -> DecodeState:
        """Step until every row has finished (or max_new tokens); returns the whole
        batch's state (the eager path steps over fewer rows as they finish).

        guard: run the repetition guard (a probed decode steps every row to the end)."""
        if self.compile:
            state = self._static_state(state, caches)
        final = state  # the whole batch's tokens and results
        rows = torch.arange(caches.rows, device=self.model.device)  # each active row's
        # Dynamo's counters only where it runs (importing it costs an eager run time).
        graphs_before = _dynamo_counts() if self.compile else None
        next_report = time.perf_counter() if on_rows is not None else None
        for i in range(1, self.max_new):  # i tokens sampled so far
            if guard and i % self.options.policy.loop_check_every == 0:
                decoding.stop_loops(state, i, self.options.policy, self.special.timestamp_begin)
            if i % self.sync_every == 0:
                if next_report is not None and time.perf_counter() >= next_report:
                    n_active = self._report_rows(state, rows, n, on_rows)
                    next_report = time.perf_counter() + PROGRESS_SECONDS
                else:
                    n_active = int((~state.finished).sum())
                if n_active == 0:
                    break
                if self.shrink and n_active <= 0.75 * len(rows):
                    # Drop finished rows once they are a quarter of the batch.
                    keep = (~state.finished).nonzero()[:, 0]
                    if state is not final:
                        state.store(final, rows)
                    rows = rows[keep]
                    state, caches = state.select(keep), caches.select(keep)
            if self.compile:
                self._compiled(sample)(state, caches)
            else:
                extent = Extent(self.prompt_length + i)
                decoding.step(self.model, self.rules, state, caches, extent, sample)
            self.counters.steps += 1
            self.counters.row_steps += len(rows)
        if state is not final:
            state.store(final, rows)
        if graphs_before is not None:
            self._count_graphs(graphs_before)
        return final

    def _report_rows(
        self, state: DecodeState, rows: torch.Tensor, n: int, on_rows: Callable
    ) -> int:
        """Tell on_rows where the real rows stand; returns the rows still active. One read
        of the device, in place of the count the loop reads at this step anyway."""
        begin = self.special.timestamp_begin
        latest = state.max_timestamp(begin)
        read = torch.stack([rows, state.finished.long(), latest]).tolist()
        positions: RowPositions = {}
        for row, finished, token in zip(*read, strict=True):
            if row < n:
                positions[row] = None if finished else max(token - begin, 0) * TIME_PRECISION
        on_rows(positions)
        return sum(1 for finished in read[1] if not finished)

    # -- internals -------------------------------------------------------------------

    def _caches(self, features: torch.Tensor) -> DecodeCaches:
        """The caches of a batch: made per batch, or (compiled) refilled in place."""
        decoder = self.model.decoder
        if self.compile and self._static is not None:
            static = self._static[1]
            if static.rows == features.shape[0]:
                decoder.fill_caches(static, features)
                return static
            self._static = None  # a new batch shape: new buffers (and a new graph)
        return decoder.new_caches(features, self.cache_length)

    def _static_state(self, state: DecodeState, caches: DecodeCaches) -> DecodeState:
        """The compiled step's state buffers, holding `state`'s values."""
        static = self._static
        if (
            static is None
            or len(static[0].tensors()) != len(state.tensors())
            or static[0].probe is not state.probe
        ):
            # Fixed addresses: CUDA graphs read them in place (a tensor input not marked is
            # copied into the graph's own buffer at every replay), the rules' masks too.
            if self.on_cuda:
                for t in [*state.tensors(), *caches.tensors(), *self.rules.tensors()]:
                    torch._dynamo.mark_static_address(t)
            self._static = (state, caches)
            return state
        static[0].copy_(state)
        return static[0]

    def _compiled(self, sample: bool) -> Callable[[DecodeState, DecodeCaches], None]:
        step = self._steps.get(sample)
        if step is None:
            mode = "reduce-overhead" if self.on_cuda else "default"
            compiled = torch.compile(decoding.step, fullgraph=True, dynamic=False, mode=mode)
            model, rules = self.model, self.rules

            def step(state: DecodeState, caches: DecodeCaches) -> None:
                compiled(model, rules, state, caches, FIXED, sample)

            self._steps[sample] = step
        return step

    def _count_graphs(self, before: tuple[int, int, int]) -> None:
        graphs, breaks, skips = (a - b for a, b in zip(_dynamo_counts(), before, strict=True))
        self.counters.graphs += graphs
        self.counters.graph_breaks += breaks
        self.counters.cudagraph_skips += skips
        self.counters.recompiles = max(0, self.counters.graphs - len(self._steps))

    def _start(self) -> float:
        if self.timed:
            self.sync()
        return time.perf_counter()

    def _stop(self, started: float) -> float:
        if self.timed:
            self.sync()
        return time.perf_counter() - started
