"""The engine: one batch of 30 s windows end to end, and the counters of what it ran.

`Engine.run` owns a batch: the padding of a compiled batch, the encoder (windows
encoded in an earlier batch are not encoded again), the language pass, the prefill, the
decode loop and the rows' results; `Engine.align` is the word-alignment pass over the
same batch, on the cross K/V its decode projected. Each run's data lives in its own
objects (`Decoded`), never on the engine, except a compiled step's fixed buffers.

A run may hold more windows than the batch decodes at once (`slots`): the rest wait, and
each row that finishes is refilled with the next of them (continuous batching), so no
step is spent on a finished row while windows wait. The caller hears of each row as it
finishes (`on_finish`) and may ask for its window again at other temperatures (a
fallback, `Retry`): retries wait first in line, so a window's attempts follow one
another within the run instead of stepping in a run of their own, and later attempts can
be decoded ahead in rows that nothing else would fill. A refilled row starts its own count
of tokens (positions per row, see decoding.DecodeState), and the repetition guard judges
every row at the same counts of its own tokens whatever the step: a row's text does not
depend on which rows share its batch, nor on when it entered it.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

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
    # Its last speech was cut off by its end (windows.Window.cut_off): the no-end rule
    # forgives less of it (Policy.cut_end_slack_seconds).
    cut_off: bool = False


@dataclass(frozen=True)
class Retry:
    """A finished row's window decoded again, at another temperature and seed (its audio,
    encoder output, language and speech map are the row's)."""

    temperature: float
    seed: int


@dataclass(frozen=True)
class Reply:
    """What the caller wants once a row has finished: windows to decode again, each as
    (the index of a row of that window, its retry), in order; and rows it asked for
    before and no longer needs, by index: those in the batch stop where they are (and
    are told of as they finish), one still waiting is decoded all the same."""

    retries: Sequence[tuple[int, Retry]] = ()
    stop: Sequence[int] = ()


# Told of each row as it finishes: its index in the run's results (see Engine.run), what
# it decoded, and the batch's finished rows that no waiting row will take (spare: the
# eager batch drops finished rows, a compiled one keeps its width).
OnFinish = Callable[[int, DecodedRow, int], Reply]


@dataclass(frozen=True)
class Decoded:
    """A decoded batch: its real rows' results, and what a later attempt at a row and
    the alignment pass need of the batch. Aligned before the engine's next run (a
    compiled engine refills its buffers then)."""

    # The caller's rows, then the retries asked for during the run, in the order asked.
    rows: list[DecodedRow]
    features: torch.Tensor  # (N, S, C) the run's encoder output, padding rows too
    # The decode's cross K/V per layer, when the engine aligns and no row was refilled
    # (a refill overwrites a row's); None: the alignment pass projects them again.
    cross: list[KV] | None
    run: int  # which of its engine's runs made it
    width: int  # the rows decoded at once (the alignment pass takes as many)
    # Row r's encoder output is features[at[r]] (a refilled run keeps the order in which
    # its rows entered the batch; a retry shares its window's); None: features[r].
    at: tuple[int, ...] | None = None

    def kept(self, row: int) -> torch.Tensor:
        """(S, C) a row's encoder output, for a later attempt (a copy, not a view that
        would hold the whole batch)."""
        return self.features[row if self.at is None else self.at[row]].clone()


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
    refills: int = 0  # rows refilled with a waiting window as another finished
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


@dataclass
class _Run:
    """A run beyond its batch: every row (the caller's, then padding, then retries), the
    rows that wait for a place in it, and the results of the rows that finished."""

    rows: list[WindowInput]
    features: torch.Tensor  # (N, S, C) the caller's and the padding rows' encoder output
    feature_of: list[int]  # per run row: its row of `features`
    # Per run row: the first run row of its window (the same encoder output: one
    # WindowInput.features object, or a retry's row); a batch's rows of one window get
    # copies of one projection of its cross K/V (see slot_kv).
    window_of: list[int]
    languages: list[str | None]
    maps: bool  # the rules read the rows' speech maps
    sample: bool  # some row draws (the step's static argument)
    no_speech: list[float]  # per run row
    real: int  # the caller's rows: run rows 0..real-1
    padding: int  # then this many padding rows (never reported, never retried)
    on_finish: OnFinish | None = None
    pending: deque[int] = field(default_factory=deque)  # rows that wait, in order
    refilled: bool = False  # some row was refilled: rows are out of step
    results: dict[int, DecodedRow] = field(default_factory=dict)  # run row -> its result
    # During the loop: each batch row's run row (device, and its host copy), the batch
    # rows whose row has finished and been read into `results`, and the step before each
    # batch row's first token (at step i its index is i - start).
    slots: torch.Tensor | None = None
    slot_rows: list[int] = field(default_factory=list)
    # Each batch row's cross K/V: which projection made them (0 at the start, k at the k-th
    # refill) and of which window. Rows of one key hold copies of one projection's rows.
    slot_kv: list[tuple[int, int]] = field(default_factory=list)
    kv_made: int = 0  # projections made so far
    idle: int = 0
    starts: list[int] = field(default_factory=list)

    def result_index(self, row: int) -> int:
        """A run row's index among the run's results (padding rows have none)."""
        return row if row < self.real else row - self.padding

    def run_row(self, result: int) -> int:
        """The run row of a result index."""
        return result if result < self.real else result + self.padding

    def output(self) -> list[int]:
        """The run rows that are results, in order: the caller's, then the retries."""
        return [*range(self.real), *range(self.real + self.padding, len(self.rows))]


def _windows_of(rows: Sequence[WindowInput], n: int) -> list[int]:
    """For each of n run rows (rows, then padding), the first row of its window: rows
    given one encoder output object (a window's attempts, as the scheduler passes
    them) are one window; every other row is its own."""
    first: dict[int, int] = {}
    return [
        first.setdefault(id(rows[r].features), r)
        if r < len(rows) and rows[r].features is not None
        else r
        for r in range(n)
    ]


def _speech_amount(row: WindowInput) -> int:
    """How much a row has to say: its speech frames, else its audio's length."""
    return int(row.speech.sum()) if row.speech is not None else len(row.audio)


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
        slots: int | None = None,
        on_finish: OnFinish | None = None,
    ) -> Decoded:
        """Decode a run of windows; results in row order, then any retries.

        pick_languages: on a multilingual model, rows without a language need the
        language pass, and it decides their languages from its probabilities.
        pad_to: a compiled engine pads the batch to this many rows (its fixed shape).
        A row above temperature 0 draws from softmax(logits / T) at uniforms hashed from
        its seed and step, so its text does not depend on the other rows of its batch.
        on_rows: told where the real rows still decoding stand (see RowPositions).
        probe: teacher forcing and logit capture (see decoding.Probe).
        slots: the rows decoded at once; the run's rows past them wait and refill rows
        that finish (None: every row at once).
        on_finish: told of each row as it finishes, by its index in the results (the
        caller's row r is r; the k-th retry asked for is len(rows) + k); the retries it
        returns wait for a place in the batch ahead of the rows past `slots`, in order,
        and are told of in turn (see Reply).
        """
        n = len(rows)
        width = n if slots is None else min(n, slots)
        if probe is not None and (width < n or on_finish is not None):
            raise ValueError("a probed decode runs every row to the end: no refills")
        if width == n:
            return self._run(rows, pick_languages, pad_to, on_rows, probe, width, on_finish)
        # Longest first (most speech: most tokens), so that short rows fill in at the end
        # rather than a long one starting late and stepping alone; the results, encoder
        # output, language picker and progress keep the caller's order (retries keep the
        # order they were asked in, after the caller's rows).
        order = sorted(range(n), key=lambda r: -_speech_amount(rows[r]))
        inverse = [0] * n
        for j, r in enumerate(order):
            inverse[r] = j

        def caller(j: int) -> int:
            return order[j] if j < n else j

        def pick(codes: list[str], probs: np.ndarray) -> list[str]:
            chosen = pick_languages(codes, probs[inverse])
            return [chosen[r] for r in order]

        def report(positions: RowPositions) -> None:
            on_rows({order[j]: p for j, p in positions.items()})

        def finish(j: int, row: DecodedRow, spare: int) -> Reply:
            reply = on_finish(caller(j), row, spare)
            own = [(inverse[r] if r < n else r, retry) for r, retry in reply.retries]
            return Reply(own, [inverse[r] if r < n else r for r in reply.stop])

        decoded = self._run(
            [rows[r] for r in order],
            pick if pick_languages is not None else None,
            pad_to,
            report if on_rows is not None else None,
            None,
            width,
            finish if on_finish is not None else None,
        )
        at = decoded.at if decoded.at is not None else range(len(decoded.rows))
        return Decoded(
            [decoded.rows[j] for j in inverse] + decoded.rows[n:],
            decoded.features,
            None,  # rows were refilled (see _run)
            decoded.run,
            decoded.width,
            tuple(at[j] for j in inverse) + tuple(at[n:]),
        )

    def _run(
        self,
        rows: Sequence[WindowInput],
        pick_languages: LanguagePicker | None,
        pad_to: int,
        on_rows: Callable[[RowPositions], None] | None,
        probe: Probe | None,
        width: int,
        on_finish: OnFinish | None,
    ) -> Decoded:
        """Engine.run with the rows in the order they enter the batch: the first `width`
        at once, the rest (and any retries) as rows finish."""
        self._runs += 1
        n = len(rows)
        # A compiled batch is padded to its fixed shape; rows that wait fill it instead.
        b = max(width, pad_to) if self.compile and width == n else width
        pad = b - width
        features = self._encode(rows, pad, b)
        started = self._start()
        window_of = _windows_of(rows, n + pad)
        caches = self._caches(features[:b], window_of[:b])
        languages = self._languages(rows, features, caches, pick_languages)
        silence = WindowInput(np.zeros(0, np.float32))
        padded = [*rows[:width], *[silence] * pad]
        maps = self.options.timestamps and rows[0].speech is not None
        state = self._start_state(padded, maps, probe)
        # Whether any row draws: the step's static argument (the greedy graph has no draw).
        sample = any(r.temperature > 0 for r in rows)
        no_speech = self._prefill(
            state, caches, [*languages[:width], *[languages[0]] * pad], sample
        )
        run = _Run(
            rows=[*rows, *[silence] * pad],
            features=features,
            feature_of=list(range(n + pad)),
            window_of=window_of,
            languages=[*languages, *[languages[0]] * pad],
            maps=maps,
            sample=sample,
            no_speech=[*no_speech[:width], *[0.0] * (n - width), *no_speech[width:]],
            real=n,
            padding=pad,
            on_finish=on_finish,
            pending=deque(range(width, n)),
        )
        self._loop(state, caches, run, on_rows, guard=probe is None)
        out = run.output()
        results = [run.results[j] for j in out]
        self.counters.tokens += sum(len(r.tokens) for r in results)
        self.counters.decodes += 1
        self.counters.decoded_rows += len(run.rows)
        self.counters.decode_s += self._stop(started)
        keep_cross = self.aligner is not None and not run.refilled
        cross = caches.cross_kv() if keep_cross else None
        at = tuple(run.feature_of[j] for j in out) if len(out) > n else None
        return Decoded(results, features, cross, self._runs, b, at)

    @torch.inference_mode()
    def align(self, decoded: Decoded, texts: Sequence[AlignRow]) -> list[WindowWords]:
        """Word timings of `texts`, one per real row of `decoded` (rows with no tokens get
        none), from teacher-forced passes over its rows, a batch's width at a time."""
        if self.aligner is None:
            raise ValueError("this engine does not align words (Engine(words=True))")
        if decoded.run != self._runs:
            raise ValueError("a batch is aligned before the engine's next run")
        started = self._start()
        if decoded.cross is not None:
            words = self.aligner.align(decoded.features, texts, decoded.cross)
        else:
            # The features' rows hold the caller's rows `order` (see Decoded.at).
            n = len(decoded.features)
            order = list(range(n))
            if decoded.at is not None:
                for r, j in enumerate(decoded.at[: len(texts)]):
                    order[j] = r
            found: dict[int, WindowWords] = {}
            for at in range(0, n, decoded.width):
                rows = [r for r in order[at : at + decoded.width] if r < len(texts)]
                chunk = decoded.features[at : at + decoded.width]
                words = self.aligner.align(chunk, [texts[r] for r in rows])
                found.update(zip(rows, words, strict=True))
            words = [found[r] for r in range(len(texts))]
        self.counters.align_s += self._stop(started)
        self.counters.aligns += 1
        return words

    @torch.inference_mode()
    def align_audio(
        self, audio: Sequence[np.ndarray], texts: Sequence[AlignRow]
    ) -> list[WindowWords]:
        """Word timings of `texts`, one per window of `audio`, for windows decoded in an
        earlier run: their audio is encoded again (the decode keeps no encoder output
        once its batch is judged), then aligned in one teacher-forced pass."""
        aligner = self.aligner or Aligner(self.loaded, self.options.task)
        mel = batch_log_mel(
            list(audio), len(audio), self.loaded.config.num_mel_bins, self.model.device
        )
        features = self.encode(mel)
        started = self._start()
        words = aligner.align(features, texts)
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

    def _encode(self, rows: Sequence[WindowInput], pad: int, chunk: int) -> torch.Tensor:
        """(len(rows) + pad, S, C): the rows' encoder outputs, then `pad` silent rows; only
        the rows not encoded before (and the padding) pass through the encoder, `chunk`
        at a time (a batch's worth: the shapes its kernel plan covers)."""
        n = len(rows)
        todo = [r for r, row in enumerate(rows) if row.features is None] + list(range(n, n + pad))
        features = None
        for at in range(0, len(todo), chunk):
            part = todo[at : at + chunk]
            mel = batch_log_mel(
                [rows[r].audio for r in part if r < n],  # then silence for the padding
                len(part),
                self.loaded.config.num_mel_bins,
                self.model.device,
            )
            encoded = self.encode(mel)
            if len(part) == n + pad:
                return encoded
            if features is None:
                features = encoded.new_empty((n + pad, *encoded.shape[1:]))
            features[part] = encoded
        kept = [r for r, row in enumerate(rows) if row.features is not None]
        if kept:
            stacked = torch.stack([rows[r].features for r in kept])
            if features is None:
                features = stacked.new_empty((n + pad, *stacked.shape[1:]))
            features[kept] = stacked
        return features

    def _languages(
        self,
        rows: Sequence[WindowInput],
        features: torch.Tensor,
        caches: DecodeCaches,
        pick: LanguagePicker | None,
    ) -> list[str | None]:
        """Each row's language: its own, or the picker's from the language pass (one step
        after <|startoftranscript|>, read for the real rows): over the batch's caches, and
        over caches made for it for the rows that wait (a batch's width at a time)."""
        languages = [r.language for r in rows]
        if not self.loaded.tokenizer.is_multilingual or all(languages):
            return languages
        if pick is None:
            raise ValueError("rows without a language need a language picker")
        tokenizer = self.loaded.tokenizer
        codes = list(tokenizer.language_ids)
        ids = torch.tensor([tokenizer.language_ids[c] for c in codes], device=features.device)
        width = caches.rows
        probs = [self._language_probs(caches, ids)[: min(len(rows), width)]]
        for at in range(width, len(rows), width):
            waiting = range(at, min(at + width, len(rows)))
            if all(languages[r] for r in waiting):  # never read by the picker
                probs.append(probs[0].new_zeros((len(waiting), len(codes))))
                continue
            own = self.model.decoder.new_caches(features[at : at + len(waiting)], 1)
            probs.append(self._language_probs(own, ids))
        return list(pick(codes, torch.cat(probs).cpu().numpy()))

    def _language_probs(self, caches: DecodeCaches, ids: torch.Tensor) -> torch.Tensor:
        """(B, n_languages) float32: each row's probabilities over the languages only."""
        device = self.model.device
        tokens = torch.full((caches.rows, 1), self.special.sot, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        logits = self.model.decoder(tokens, positions, caches, Extent(1))
        self.counters.language_passes += 1
        return f32_log_softmax(logits[:, 0, ids]).exp()

    def _start_state(
        self, rows: Sequence[WindowInput], maps: bool, probe: Probe | None = None
    ) -> DecodeState:
        """The state of `rows` before their prompt; maps: the rules read the rows' speech
        maps (padding rows have an empty one: never held open, nothing to pass over)."""
        speech = None
        if maps:
            p = self.options.policy
            empty = np.zeros(0, bool)
            speech = SpeechGrid.from_maps(
                [r.speech if r.speech is not None else empty for r in rows],
                self.n_timestamps,
                p.min_speech_seconds,
                [
                    (p.cut_end_slack_seconds,) * 2
                    if r.cut_off
                    else (p.open_end_slack_seconds, p.end_slack_seconds)
                    for r in rows
                ],
                self.model.device,
            )
        return DecodeState.start(
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
        # Read before the choice, which fills the logits in place (a prompt of <|sot|>
        # alone makes logits[:, sot] and logits[:, -1] one view).
        no_speech = f32_log_softmax(logits[:, sot])[:, self.special.no_speech].exp()
        decoding.choose(self.rules, state, logits[:, -1], sample, first=True)
        return no_speech.tolist()

    def _loop(
        self,
        state: DecodeState,
        caches: DecodeCaches,
        run: _Run,
        on_rows: Callable[[RowPositions], None] | None,
        guard: bool,
    ) -> None:
        """Step until every row has finished (or max_new tokens) and no row waits, each
        row's result read into run.results as it finishes where a caller, a waiting row or
        a drop needs it, else at the end (the eager path steps over fewer rows as they
        finish, rows that wait take the places of rows that finish).

        guard: run the repetition guard (a probed decode steps every row to the end)."""
        if self.compile:
            state = self._static_state(state, caches)
        b, n = caches.rows, len(run.rows)
        width = n - len(run.pending)
        run.slot_rows = [*range(width), *range(n, n + b - width)]
        run.slot_kv = [(0, run.window_of[j]) for j in run.slot_rows]
        run.slots = torch.tensor(run.slot_rows, device=self.model.device)
        run.starts = [0] * b
        self._share(caches, run)
        # Dynamo's counters only where it runs (importing it costs an eager run time).
        graphs_before = _dynamo_counts() if self.compile else None
        next_report = time.perf_counter() if on_rows is not None else None
        every = self.options.policy.loop_check_every
        i = 1  # the step: the oldest row has sampled i tokens
        while True:
            # Every row has sampled max_new tokens (and so finished, unless probed).
            spent = i >= max(run.starts) + self.max_new
            if spent and run.on_finish is None and not run.pending:
                break
            # The guard judges each row at multiples of `every` of its own tokens.
            if guard and any((i - s) % every == 0 for s in set(run.starts)):
                decoding.stop_loops(state, self.options.policy, self.special.timestamp_begin)
            if i % self.sync_every == 0 or spent:
                if next_report is not None and time.perf_counter() >= next_report:
                    n_active = self._report_rows(state, run.slots, run.real, on_rows)
                    next_report = time.perf_counter() + PROGRESS_SECONDS
                else:
                    n_active = int((~state.finished).sum())
                # Finished rows are read here only where it matters before the loop ends
                # (a caller told of each, a row waiting for a place, a drop); else once at
                # the end, with no device reads in between (CUDA).
                listened = run.on_finish is not None or run.pending or self.shrink
                if listened and n_active < len(run.slot_rows) - run.idle:
                    n_active = self._finished(state, run)  # may queue retries, stop rows
                if n_active == 0 and not run.pending:
                    break
                if run.pending and n_active < len(run.slot_rows):
                    self._refill(state, caches, run, i)
                elif not run.pending and self.shrink and n_active <= 0.75 * len(run.slot_rows):
                    state, caches = self._drop_finished(state, caches, run)
            self._step(state, caches, run, i)
            i += 1
        self._finished(state, run, every=True)
        if graphs_before is not None:
            self._count_graphs(graphs_before)

    def _finished(self, state: DecodeState, run: _Run, every: bool = False) -> int:
        """Read the rows that finished since the last call into run.results, and tell
        run.on_finish of each: the retries it asks for are queued first, and the rows it
        stops are finished where they are and read in turn. Returns the rows still active.

        every: the loop has ended; read every row not read yet, finished or not (a
        probed decode never finishes a row)."""
        while True:
            finished = state.finished.tolist()
            slots = [
                s
                for s, (row, done) in enumerate(zip(run.slot_rows, finished, strict=True))
                if (done or every) and row not in run.results
            ]
            if not slots:
                return finished.count(False)
            rows = [run.slot_rows[s] for s in slots]
            decoded = decoding.decoded_rows(
                state,
                slots,
                self.special.eot,
                [run.no_speech[j] for j in rows],
                [run.languages[j] for j in rows],
                [run.rows[j].temperature for j in rows],
            )
            run.idle += len(slots)
            live = finished.count(False)
            for j, result in zip(rows, decoded, strict=True):
                run.results[j] = result
                if run.on_finish is not None and not run.real <= j < run.real + run.padding:
                    spare = max(len(run.slot_rows) - live - len(run.pending), 0)
                    self._reply(state, run, run.on_finish(run.result_index(j), result, spare))

    def _reply(self, state: DecodeState, run: _Run, reply: Reply) -> None:
        """Queue the retries asked for first (in order), and stop the rows named."""
        new = range(len(run.rows), len(run.rows) + len(reply.retries))
        for of, retry in reply.retries:
            k = run.run_row(of)
            again = replace(run.rows[k], temperature=retry.temperature, seed=retry.seed)
            run.rows.append(again)
            run.feature_of.append(run.feature_of[k])
            run.window_of.append(run.window_of[k])
            run.languages.append(run.languages[k])
            run.no_speech.append(0.0)  # its own prefill's, once it has a place
            run.sample |= again.temperature > 0
        run.pending.extendleft(reversed(new))  # first: their windows have waited longest
        stop = {run.run_row(r) for r in reply.stop}
        slots = [s for s, j in enumerate(run.slot_rows) if j in stop and j not in run.results]
        if slots:
            state.finished[torch.tensor(slots, device=state.finished.device)] = True

    def _step(self, state: DecodeState, caches: DecodeCaches, run: _Run, i: int) -> None:
        """Step i of the loop over the batch: the compiled step, or the eager one over the
        cache slots written so far (its rows in step until one is refilled)."""
        if self.compile:
            self._compiled(run.sample)(state, caches)
        else:
            extent = Extent(self.prompt_length + min(i - min(run.starts), self.max_new))
            in_step = not run.refilled
            decoding.step(self.model, self.rules, state, caches, extent, run.sample, in_step)
        self.counters.steps += 1
        self.counters.row_steps += len(run.slot_rows)

    def _drop_finished(
        self, state: DecodeState, caches: DecodeCaches, run: _Run
    ) -> tuple[DecodeState, DecodeCaches]:
        """The eager batch without its finished rows (their results read already).

        With no alignment pass to come the caches are this run's alone: the live rows past
        the new width move into the places of finished rows before it, in place. With one,
        the kept rows are selected into new caches: the pass reads the decode's cross K/V."""
        live = ~state.finished
        if self.aligner is None:
            n = int(live.sum())
            holes = (~live[:n]).nonzero()[:, 0]  # finished rows before n
            movers = live[n:].nonzero()[:, 0] + n  # as many live rows past it
            keep = torch.arange(n, device=live.device).index_copy_(0, holes, movers)
            caches = caches.compact(holes, movers, n)
        else:
            keep = live.nonzero()[:, 0]
            caches = caches.select(keep)
        kept = keep.tolist()
        run.starts = [run.starts[k] for k in kept]
        run.slot_rows = [run.slot_rows[k] for k in kept]
        run.slot_kv = [run.slot_kv[k] for k in kept]
        run.slots = run.slots[keep]
        run.idle = 0
        self._share(caches, run)
        return state.select(keep), caches

    def _refill(self, state: DecodeState, caches: DecodeCaches, run: _Run, i: int) -> None:
        """At step i, refill finished batch rows (their results read already) with the
        rows that wait, in order: each new row's cross K/V, prompt and first token (its
        own prefill) written in place of the old row's."""
        slots = state.finished.nonzero()[:, 0][: len(run.pending)]
        new = [run.pending.popleft() for _ in range(len(slots))]
        fresh = [run.rows[j] for j in new]
        features = run.features[[run.feature_of[j] for j in new]]
        windows = [run.window_of[j] for j in new]
        same = [windows.index(w) for w in windows]
        own = self.model.decoder.new_caches(features, self.prompt_length, same=same)
        run.kv_made += 1
        prompted = self._start_state(fresh, run.maps)
        languages = [run.languages[j] for j in new]
        for j, p in zip(new, self._prefill(prompted, own, languages, run.sample), strict=True):
            run.no_speech[j] = p
        t0 = self.prompt_length
        for big, small in zip(caches.self_attn, own.self_attn, strict=True):
            big.k[:, :, :t0].index_copy_(0, slots, small.k)
            big.v[:, :, :t0].index_copy_(0, slots, small.v)
        for big, small in zip(caches.cross, own.cross, strict=True):
            big.k.index_copy_(0, slots, small.k)
            big.v.index_copy_(0, slots, small.v)
        state.put(slots, prompted)
        run.slots[slots] = torch.tensor(new, device=run.slots.device)
        for slot, j in zip(slots.tolist(), new, strict=True):
            run.starts[slot] = i - 1  # its first token came from its prefill
            run.slot_rows[slot] = j
            run.slot_kv[slot] = (run.kv_made, run.window_of[j])
        run.idle -= len(new)
        run.refilled = True
        self.counters.refills += len(new)
        self._share(caches, run)

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

    def _share(self, caches: DecodeCaches, run: _Run) -> None:
        """Tell the caches which batch rows hold copies of one projection of one window's
        cross K/V (run.slot_kv: a window's retry and the attempts decoded ahead of it,
        made in one new_caches call), so that the eager step reads them from memory once
        for all of them (DecodeCaches.sources): the same bytes, whatever the GEMM's
        rounding. The compiled step takes no such argument (a tuple of rows would be a
        graph per batch)."""
        if self.compile:
            return
        first: dict[tuple[int, int], int] = {}
        sources = tuple(first.setdefault(kv, s) for s, kv in enumerate(run.slot_kv))
        caches.sources = None if len(first) == len(sources) else sources

    def _caches(self, features: torch.Tensor, same: list[int] | None = None) -> DecodeCaches:
        """The caches of a batch: made per batch (each window's cross K/V projected once:
        `same`, as Decoder.new_caches takes it), or (compiled) refilled in place."""
        decoder = self.model.decoder
        if self.compile and self._static is not None:
            static = self._static[1]
            if static.rows == features.shape[0]:
                decoder.fill_caches(static, features)
                return static
            self._static = None  # a new batch shape: new buffers (and a new graph)
        return decoder.new_caches(features, self.cache_length, same=same)

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
                compiled(model, rules, state, caches, FIXED, sample, False)

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
