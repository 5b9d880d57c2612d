"""The engine: encode a batch of log-mels, prefill, and run the decode loop.

It is the one place that knows eager from compiled:
- eager (CPU default): fresh caches and state per batch; finished rows are dropped from
  the batch as the decode goes, so no work is spent on them.
- compiled (`torch.compile` of the whole step, CUDA graphs on CUDA): one fixed batch
  shape, padded with silent rows; the caches and the state are buffers made once and
  refilled in place per batch, so the step compiles once and replays.
The host reads the device only every `sync_every` steps (has every row finished?) and
for the repetition guard; a caller that watches the decode (`on_rows`) is told each row's
latest timestamp in the same read, at most every PROGRESS_SECONDS. Counters say what
ran: encoder passes, steps, rows, graphs, recompiles and CUDA-graph skips, so tools
measure through them instead of patching.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from whisper_cli import decoding
from whisper_cli.decoding import DecodedRow, DecodeOptions, DecodeState
from whisper_cli.dtypes import encoder_input, f32_log_softmax
from whisper_cli.loading import LoadedModel
from whisper_cli.model import KV, DecodeCaches
from whisper_cli.rules import Rules, SpeechGrid
from whisper_cli.tokenizer import TIME_PRECISION

CACHE_MULTIPLE = 16  # self-attention cache length rounded up to this (aligned tiles)
# Wall seconds between two reports to `on_rows`: a progress display needs no more, and a
# report is a wider read at a sync point the loop makes anyway, never a sync of its own.
PROGRESS_SECONDS = 0.25

# What `on_rows` gets: batch row -> seconds into its window of its latest timestamp (0.0
# before the first one), or None once the row has finished.
RowPositions = dict[int, float | None]


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
    graphs: int = 0  # graphs compiled for the step (torch.compile)
    recompiles: int = 0  # graphs compiled beyond the first of each step function
    graph_breaks: int = 0
    cudagraph_skips: int = 0  # steps that could not be recorded as CUDA graphs
    encode_s: float = 0.0  # wall time, with the device synchronised (timed engines only)
    decode_s: float = 0.0


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
    """Encodes and decodes batches of 30 s windows for one run."""

    def __init__(
        self,
        loaded: LoadedModel,
        options: DecodeOptions,
        compile: bool = False,
        shrink: bool = True,
        retain_cross: bool = False,
        timed: bool = False,
    ) -> None:
        """compile: the whole step under torch.compile (fixed batch, padded); shrink:
        the eager path drops finished rows; retain_cross: keep the last batch's cross K/V
        for the word-alignment pass (see cross_kv); timed: synchronise the device around
        encode and decode and count their wall time."""
        self.loaded = loaded
        self.model = loaded.model
        self.options = options
        self.compile = compile
        self.shrink = shrink and not compile
        self.retain_cross = retain_cross
        self.timed = timed
        self.counters = EngineCounters()
        self.special = loaded.tokenizer.special
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
        self.rules = Rules.build(
            loaded, options.timestamps, options.max_initial_timestamp, options.skip
        )
        self._prepared: DecodeCaches | None = None  # caches of the latest encoded batch
        self._static: tuple[DecodeState, DecodeCaches] | None = None  # compiled buffers
        self._steps: dict[bool, object] = {}  # compiled step per `sample`
        self._retained: tuple[torch.Tensor, list[KV]] | None = None

    # -- batch shape -------------------------------------------------------------------

    def rows_for(self, n: int, batch_size: int) -> int:
        """How many rows to encode for `n` windows: a compiled step's fixed batch."""
        return max(n, batch_size) if self.compile else n

    # -- encoder -----------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) float32 log-mel -> (B, S, C) encoder output in the model dtype."""
        started = self._start()
        features = self.model.encoder(encoder_input(mel, self.model.dtype))
        self.counters.encode_s += self._stop(started)
        self.counters.encoder_passes += 1
        self.counters.encoded_rows += mel.shape[0]
        return features

    # -- language ----------------------------------------------------------------------

    @torch.inference_mode()
    def language_probs(self, features: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Language codes and each row's probabilities over them, (B, n_languages) float32,
        from the logits after <|startoftranscript|>."""
        tokenizer = self.loaded.tokenizer
        caches = self._caches(features)
        device = features.device
        tokens = torch.full((features.shape[0], 1), self.special.sot, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        logits = self.model.decoder(tokens, positions, caches, visible=1)
        self.counters.language_passes += 1
        codes = list(tokenizer.language_ids)
        ids = torch.tensor([tokenizer.language_ids[c] for c in codes], device=device)
        return codes, f32_log_softmax(logits[:, 0, ids]).exp()  # over language tokens only

    # -- decode ------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(
        self,
        features: torch.Tensor,
        languages: list[str | None],
        speech: SpeechGrid | None = None,
        temperatures: list[float] | None = None,
        seeds: list[int] | None = None,
        on_rows: Callable[[RowPositions], None] | None = None,
    ) -> list[DecodedRow]:
        """Decode the first len(languages) rows of a batch of encoder outputs (B, S, C);
        rows after them are padding (see rows_for).

        speech: the n rows' speech maps on the timestamp grid, timestamp mode only: a row
        may not end while speech lies after its latest timestamp, nor pass a timestamp
        over more speech than its text can hold (see rules.apply_rules).
        temperatures: per row; 0 is greedy, above 0 draws from softmax(logits / T) at
        uniforms hashed from the row's seed (`seeds`) and step, so a row's text does not
        depend on the other rows of its batch.
        on_rows: told where the real rows still decoding stand (see RowPositions).
        """
        started = self._start()
        n, b = len(languages), features.shape[0]
        pad = b - n
        temperatures = [*(temperatures or [0.0] * n), *[0.0] * pad]
        seeds = [*(seeds or [0] * n), *[0] * pad]
        languages = [*languages, *[languages[0]] * pad]
        device = features.device
        if speech is not None and pad:  # padding rows are never held open
            speech = speech.padded(pad)
        sample = any(t > 0 for t in temperatures)
        state = DecodeState.start(
            self.max_new,
            self.prompt_length,
            temperatures,
            seeds,
            self.special.eot,
            self.model.dtype,
            device,
            speech,
        )
        caches = self._caches(features)
        if self.compile:
            state = self._static_state(state, caches)

        tokenizer = self.loaded.tokenizer
        prompts = [
            tokenizer.prompt(
                lang, self.options.task, self.options.timestamps, self.options.prompt_tokens
            )
            for lang in languages
        ]
        tokens = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T0)
        t0 = self.prompt_length
        logits = self.model.decoder(
            tokens, torch.arange(t0, device=device), caches, t0
        )  # (B, T0, V)
        self.counters.prefills += 1
        sot_index = prompts[0].index(self.special.sot)
        no_speech = f32_log_softmax(logits[:, sot_index])[:, self.special.no_speech].exp()
        decoding.choose(self.rules, state, logits[:, -1], sample)
        if self.retain_cross:
            self._retained = (features, caches.cross_kv())

        final = state  # the whole batch's tokens and results
        rows = torch.arange(b, device=device)  # the batch row of each active row
        o = self.options
        # Dynamo's counters only where it runs (importing it costs an eager run time).
        graphs_before = _dynamo_counts() if self.compile else None
        next_report = time.perf_counter() if on_rows is not None else None
        for i in range(1, self.max_new):  # i tokens sampled so far
            if i % o.loop_check_every == 0:
                decoding.stop_loops(state, i, o, self.special.timestamp_begin)
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
                decoding.step(self.model, self.rules, state, caches, t0 + i, sample)
            self.counters.steps += 1
            self.counters.row_steps += len(rows)
        if state is not final:
            state.store(final, rows)
        if graphs_before is not None:
            self._count_graphs(graphs_before)
        results = decoding.decoded_rows(
            final, self.special.eot, no_speech.tolist(), languages, temperatures
        )
        self._prepared = None  # the next batch brings its own
        self.counters.tokens += sum(len(r.tokens) for r in results[:n])
        self.counters.decodes += 1
        self.counters.decoded_rows += b
        self.counters.decode_s += self._stop(started)
        return results[:n]

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

    def cross_kv(self, features: torch.Tensor) -> list[KV] | None:
        """The cross K/V of the whole latest batch, per layer, if it was `features` and
        retain_cross is on (the alignment pass then need not project them again)."""
        retained, self._retained = self._retained, None
        if retained is not None and retained[0] is features:
            return retained[1]
        return None

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.model.device)

    def sync_if_timed(self) -> None:
        """Synchronise the device when this engine is timed (so a stage's time is its own)."""
        if self.timed:
            self.sync()

    # -- internals -------------------------------------------------------------------

    def _caches(self, features: torch.Tensor) -> DecodeCaches:
        """The caches of this batch: made (or, compiled, refilled) once per encoder output."""
        prepared = self._prepared
        if prepared is not None and prepared.source is features:
            return prepared
        decoder = self.model.decoder
        if self.compile and self._static is not None:
            static = self._static[1]
            if static.source.shape == features.shape:
                decoder.fill_caches(static, features)
                self._prepared = static
                return static
            self._static = None  # a new batch shape: new buffers (and a new graph)
        self._prepared = decoder.new_caches(features, self.cache_length)
        return self._prepared

    def _static_state(self, state: DecodeState, caches: DecodeCaches) -> DecodeState:
        """The compiled step's state buffers, holding `state`'s values."""
        static = self._static
        if static is None or (static[0].speech_after is None) != (state.speech_after is None):
            # Fixed addresses: CUDA graphs read them in place (a tensor input not marked is
            # copied into the graph's own buffer at every replay), the rules' masks too.
            if self.on_cuda:
                for t in [*vars(state).values(), *caches.tensors(), *self.rules.tensors()]:
                    if t is not None:
                        torch._dynamo.mark_static_address(t)
            self._static = (state, caches)
            return state
        static[0].copy_(state)
        return static[0]

    def _compiled(self, sample: bool):
        step = self._steps.get(sample)
        if step is None:
            function = decoding.sampled_step if sample else decoding.greedy_step
            mode = "reduce-overhead" if self.on_cuda else "default"
            compiled = torch.compile(function, fullgraph=True, dynamic=False, mode=mode)
            model, rules = self.model, self.rules

            def step(state: DecodeState, caches: DecodeCaches) -> None:
                compiled(model, rules, state, caches)

            self._steps[sample] = step
        return step

    def _count_graphs(self, before: tuple[int, int, int]) -> None:
        graphs, breaks, skips = (a - b for a, b in zip(_dynamo_counts(), before, strict=True))
        self.counters.graphs += graphs
        self.counters.graph_breaks += breaks
        self.counters.cudagraph_skips += skips
        self.counters.recompiles = max(0, self.counters.graphs - len(self._steps))

    def _start(self) -> float:
        self.sync_if_timed()
        return time.perf_counter()

    def _stop(self, started: float) -> float:
        self.sync_if_timed()
        return time.perf_counter() - started
