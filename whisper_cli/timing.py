"""Word-level timestamps: cross-attention alignment and dynamic time warping.

After a batch is decoded, one teacher-forced decoder pass runs over all its rows at
once: `<|sot|> [lang task] <|notimestamps|> text... <|endoftext|>` (timestamps dropped),
reusing the encoder output. The cross-attention scores of the model's alignment heads
show which audio frames each token attends to; per row they are cropped to the row's
own audio, softmaxed, normalised per frame over the tokens, median-filtered along time,
averaged over the heads, and a monotonic path from the first token and frame to the
last is found by DTW. A token starts at the first frame its path row reaches, a word
at its first token's start. This is openai-whisper's `find_alignment`, batched; the
word rules (splitting, punctuation, durations) follow it too, so times can be compared.

Shapes: B rows, h alignment heads, T sequence, S encoder frames (1500), N text tokens + 1
(the path's rows), M a row's frames (20 ms each).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.dtypes import f32_alignment_weights, f32_log_softmax
from whisper_cli.features import HOP_LENGTH
from whisper_cli.loading import LoadedModel
from whisper_cli.model import KV, Extent
from whisper_cli.tokenizer import Tokenizer

MEDIAN_FILTER_WIDTH = 7  # openai-whisper's medfilt_width
SAMPLES_PER_FRAME = 2 * HOP_LENGTH  # samples per encoder frame (two mel frames): 20 ms
FRAMES_PER_SECOND = SAMPLE_RATE // SAMPLES_PER_FRAME
# Written without spaces between words: split into characters (whole code points) instead.
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
# Merged into the following / previous word (openai-whisper's defaults).
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"
# Word durations are judged against the window's median word duration, itself capped.
MAX_MEDIAN_DURATION = 0.7  # seconds
# Values filtered at a time: under torch's parallel grain size (32768), so each of the
# filter's many small ops runs on one thread. Split across threads, each op waits at a
# barrier, and on a busy CPU that wait (a descheduled thread) costs far more than the
# work. Small slices also stay in the cache.
MEDIAN_CHUNK = 1 << 14
LOGITS_ROWS = 256  # positions projected to the vocabulary at a time (B * T * V is large)


@dataclass(frozen=True)
class WordTiming:
    """One word of a window, times in seconds from the window's start."""

    word: str
    tokens: tuple[int, ...]
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class WindowWords:
    """The words of one window and its median word duration (for the segment rules)."""

    words: tuple[WordTiming, ...]
    median_duration: float

    @property
    def max_duration(self) -> float:
        return 2 * self.median_duration


@dataclass(frozen=True)
class AlignRow:
    """What one row of a batch is aligned with: its text and how much audio it has."""

    tokens: tuple[int, ...]  # text tokens only (no timestamps, no specials)
    samples: int  # the window's audio length, 16 kHz samples
    language: str | None = None


# --- the alignment heads ------------------------------------------------------------------


def alignment_heads(loaded: LoadedModel) -> dict[int, torch.Tensor]:
    """{decoder layer: head indices} from generation_config.json's `alignment_heads`.

    A model without them gets openai-whisper's (and CTranslate2's) default: every head
    of the last half of the decoder layers.
    """
    cfg = loaded.config
    pairs = loaded.generation.alignment_heads or tuple(
        (layer, head)
        for layer in range(cfg.decoder_layers // 2, cfg.decoder_layers)
        for head in range(cfg.decoder_attention_heads)
    )
    by_layer: dict[int, list[int]] = {}
    for layer, head in sorted(set(pairs)):
        by_layer.setdefault(layer, []).append(head)
    device = loaded.model.device
    return {layer: torch.tensor(h, device=device) for layer, h in by_layer.items()}


# --- median filter and DTW ----------------------------------------------------------------


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over a sliding window of odd `width` along the last dim, edges reflected.

    As openai-whisper: an input no longer than width // 2 is returned as it is. The
    `width` shifted copies are sorted elementwise by odd-even transposition (width
    rounds of min/max), in slices of MEDIAN_CHUNK values (see there): several times
    faster than sorting unfolded windows.
    """
    if width < 1 or width % 2 == 0:
        raise ValueError("the median filter's width must be odd")
    pad, m = width // 2, x.shape[-1]
    if m <= pad:
        return x
    rows = x.reshape(-1, m)  # (R, m)
    padded = F.pad(rows[None], (pad, pad), mode="reflect")[0]  # (R, m + 2 pad)
    out = torch.empty_like(rows)
    step = max(1, MEDIAN_CHUNK // m)
    for start in range(0, rows.shape[0], step):
        chunk = padded[start : start + step]
        lanes = [chunk[:, k : k + m] for k in range(width)]
        for round_ in range(width):
            for i in range(round_ % 2, width - 1, 2):
                low = torch.minimum(lanes[i], lanes[i + 1])
                lanes[i + 1] = torch.maximum(lanes[i], lanes[i + 1])
                lanes[i] = low
        out[start : start + step] = lanes[pad]
    return out.view(x.shape)


def dtw(cost: torch.Tensor, rows: Sequence[int], cols: Sequence[int]) -> list[np.ndarray]:
    """Minimum-cost monotonic paths through cost[b, :rows[b], :cols[b]] for every b at once.

    cost (B, N, M) float32, padded anywhere past each row's own (rows, cols). Each path
    goes from (0, 0) to (rows - 1, cols - 1) by steps down, right or diagonal; returned
    as (2, L) int arrays (text index, time index), as openai-whisper's `dtw`. Ties go
    as there: diagonal or down only when strictly cheaper than both others, else right.

    The cells of one anti-diagonal depend only on the two before it, so the loop runs
    over the N + M - 1 anti-diagonals, each a few vectorised ops over every row of every
    batch item; the cost matrix is stored skewed, one anti-diagonal per row.
    """
    b, n, m = cost.shape
    # skew[b, k, i] = cost[b, i, k - i] (inf outside), k = 0 .. n + m - 2: pad every row by
    # n + 1 and re-read the flat data with rows one shorter, so row i shifts right by i.
    padded = F.pad(cost, (0, n + 1), value=float("inf"))
    skew = padded.flatten(1)[:, : n * (n + m)].view(b, n, n + m).transpose(1, 2).contiguous()
    # acc[b, d, i]: the cheapest path cost to cell (i, d - i) of the (n + 1, m + 1) table
    # whose row and column 0 are the start: only (0, 0) is reachable there, at 0.
    acc = cost.new_full((b, n + m + 1, n + 1), float("inf"))
    acc[:, 0, 0].zero_()
    trace = torch.full((b, n + m + 1, n + 1), 2, dtype=torch.int8, device=cost.device)
    for d in range(2, n + m + 1):
        diag, up, left = acc[:, d - 2, :n], acc[:, d - 1, :n], acc[:, d - 1, 1:]
        take_diag = (diag < up) & (diag < left)
        take_up = (up < diag) & (up < left)
        best = torch.where(take_diag, diag, torch.where(take_up, up, left))
        acc[:, d, 1:] = skew[:, d - 2] + best
        trace[:, d, 1:] = 2 - 2 * take_diag.to(torch.int8) - take_up.to(torch.int8)
    return _backtrace(trace.cpu().numpy(), rows, cols)


def _backtrace(trace: np.ndarray, rows: Sequence[int], cols: Sequence[int]) -> list[np.ndarray]:
    """Walk every row's path back from its end, all rows in step: (2, L) arrays."""
    i = np.asarray(rows, dtype=np.int64).copy()
    j = np.asarray(cols, dtype=np.int64).copy()
    steps = int((i + j).max()) if len(i) else 0
    path_i = np.zeros((len(i), steps), dtype=np.int64)
    path_j = np.zeros((len(i), steps), dtype=np.int64)
    lengths = np.zeros(len(i), dtype=np.int64)
    active = np.nonzero((i > 0) | (j > 0))[0]
    while len(active):
        ia, ja = i[active], j[active]
        path_i[active, lengths[active]] = ia - 1
        path_j[active, lengths[active]] = ja - 1
        lengths[active] += 1
        # 0: diagonal, 1: up (previous text row), 2: left (previous frame); on the
        # table's first row only left, on its first column only up.
        step = np.where(ia == 0, 2, np.where(ja == 0, 1, trace[active, ia + ja, ia]))
        i[active] = ia - (step != 2)
        j[active] = ja - (step != 1)
        active = active[(i[active] > 0) | (j[active] > 0)]
    return [
        np.stack([path_i[r, : lengths[r]][::-1], path_j[r, : lengths[r]][::-1]])
        for r in range(len(lengths))
    ]


# --- words from tokens ---------------------------------------------------------------------


def split_on_unicode(tokens: Sequence[int], tokenizer: Tokenizer) -> list[list[int]]:
    """Group tokens into runs that each decode to whole characters.

    A character may span tokens (byte-level BPE): a run ends where its text has no
    replacement character, or only one the full text itself has there.
    """
    full = tokenizer.decode(list(tokens))
    groups: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for token in tokens:
        current.append(token)
        text = tokenizer.decode(current)
        bad = text.find("\ufffd")
        if bad < 0 or full[offset + bad : offset + bad + 1] == "\ufffd":
            groups.append(current)
            current = []
            offset += len(text)
    if current:  # a cut-off character at the very end
        groups.append(current)
    return groups


def split_words(
    tokens: Sequence[int], tokenizer: Tokenizer, language: str | None
) -> list[list[int]]:
    """Tokens grouped into words, as openai-whisper splits them.

    Languages written without spaces (NO_SPACE_LANGUAGES) split into characters; others
    at spaces, with each punctuation character its own word (merged back later).
    """
    groups = split_on_unicode(tokens, tokenizer)
    if language in NO_SPACE_LANGUAGES:
        return groups
    words: list[list[int]] = []
    for group in groups:
        text = tokenizer.decode(group)
        # `in string.punctuation` as openai-whisper: any substring of it, "" included.
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(list(group))
        else:
            words[-1].extend(group)
    return words


def merge_punctuations(words: list[_Word], prepended: str, appended: str) -> None:
    """Merge punctuation words into their neighbours, in place (openai-whisper's rule):
    opening marks (with a leading space) onto the following word, closing marks (with
    none) onto the previous one. Merged-away words are left empty, their tokens moved."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        previous, following = words[i], words[j]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            following.word = previous.word + following.word
            following.tokens = previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        previous, following = words[i], words[j]
        if not previous.word.endswith(" ") and following.word in appended:
            previous.word = previous.word + following.word
            previous.tokens = previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


@dataclass
class _Word:
    """A word while the rules rewrite it (WordTiming is its frozen result)."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def window_words(
    token_starts: np.ndarray,
    token_probs: Sequence[float],
    tokens: Sequence[int],
    tokenizer: Tokenizer,
    language: str | None,
) -> WindowWords:
    """Words of one window from its tokens' start times (N + 1: the last is the end).

    Long words at sentence boundaries are shortened to twice the median word duration,
    and punctuation is merged into words, as openai-whisper does.
    """
    groups = split_words(tokens, tokenizer, language)
    bounds = np.cumsum([0] + [len(g) for g in groups])
    words = [
        _Word(
            tokenizer.decode(group),
            list(group),
            float(token_starts[bounds[k]]),
            float(token_starts[bounds[k + 1]]),
            float(np.mean(token_probs[bounds[k] : bounds[k + 1]])),
        )
        for k, group in enumerate(groups)
    ]
    durations = np.array([w.end - w.start for w in words])
    durations = durations[durations.nonzero()]
    median = min(MAX_MEDIAN_DURATION, float(np.median(durations))) if len(durations) else 0.0
    if len(durations):
        longest = 2 * median
        for k in range(1, len(words)):
            if words[k].end - words[k].start > longest:
                if words[k].word in SENTENCE_END_MARKS:
                    words[k].end = words[k].start + longest
                elif words[k - 1].word in SENTENCE_END_MARKS:
                    words[k].start = words[k].end - longest
    merge_punctuations(words, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    return WindowWords(
        tuple(WordTiming(w.word, tuple(w.tokens), w.start, w.end, w.probability) for w in words),
        median,
    )


# --- the alignment pass ---------------------------------------------------------------------


class Aligner:
    """Word timings of a decoded batch from one teacher-forced pass over its rows."""

    def __init__(self, loaded: LoadedModel, task: str = "transcribe") -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.task = task
        self.heads = alignment_heads(loaded)

    @torch.inference_mode()
    def align(
        self,
        features: torch.Tensor,
        rows: Sequence[AlignRow],
        cross: list[KV] | None = None,
    ) -> list[WindowWords]:
        """features (B, S, C): the batch's encoder output; rows: its first len(rows) rows.

        cross: the decode's cross K/V of `features`, per layer, so they are not projected
        again; every row of `features` goes through the pass (a compiled run's padding
        rows as empty ones).
        """
        eot = self.tokenizer.special.eot
        device = features.device
        prompts = [self.tokenizer.prompt(r.language, self.task, timestamps=False) for r in rows]
        n_prompt = len(prompts[0]) if prompts else 0  # sot [lang task] notimestamps
        sequences = [[*p, *r.tokens, eot] for p, r in zip(prompts, rows, strict=True)]
        sequences += [[*sequences[0][:n_prompt], eot]] * (features.shape[0] - len(rows))
        t = max(len(s) for s in sequences)
        tokens = torch.full((len(sequences), t), eot, dtype=torch.long, device=device)
        for r, seq in enumerate(sequences):
            tokens[r, : len(seq)] = torch.tensor(seq, device=device)
        # A whole sequence from position 0 through the decoder, into caches of its length.
        decoder = self.model.decoder
        caches = decoder.new_caches(features, t, cross)
        positions = torch.arange(t, device=device)
        hidden, scores = decoder.hidden(tokens, positions, caches, Extent(t), self.heads)

        # Row b: text tokens n_b, path rows n_b + 1 (the last predicts end-of-text),
        # frames m_b of its own audio (never the padding after it).
        n_text = [len(r.tokens) for r in rows]
        frames = [min(r.samples // SAMPLES_PER_FRAME, scores.shape[-1]) for r in rows]
        todo = [b for b, (n, m) in enumerate(zip(n_text, frames, strict=True)) if n and m]
        costs = [
            self._row_cost(scores[b, :, : n_prompt + n_text[b] + 1, : frames[b]], n_prompt)
            for b in todo
        ]  # (n_b + 1, m_b) each, float32
        n_max = max((c.shape[0] for c in costs), default=0)
        m_max = max((c.shape[1] for c in costs), default=0)
        paths = []
        if costs:
            padded = [F.pad(c, (0, m_max - c.shape[1], 0, n_max - c.shape[0])) for c in costs]
            paths = dtw(
                torch.stack(padded), [c.shape[0] for c in costs], [c.shape[1] for c in costs]
            )
        probs = self._token_probs(hidden, rows, n_prompt)

        out = [WindowWords((), 0.0)] * len(rows)
        for b, path in zip(todo, paths, strict=True):
            text_index, time_index = path
            first = np.diff(text_index, prepend=-1) != 0  # each text row's first frame
            starts = time_index[first] / FRAMES_PER_SECOND  # (n_b + 1,)
            row = rows[b]
            out[b] = window_words(starts, probs[b], row.tokens, self.tokenizer, row.language)
        return out

    @staticmethod
    def _row_cost(scores: torch.Tensor, n_prompt: int) -> torch.Tensor:
        """(h, T_b, m) scores of one row -> (n_b + 1, m) DTW cost, float32.

        Normalised over the whole sequence, then its rows from <|notimestamps|> (which
        predicts the first text token) to the last text token (which predicts the end).
        """
        weights = f32_alignment_weights(scores.softmax(dim=-1))  # softmax in the model dtype
        std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
        weights = median_filter((weights - mean) / std)
        return -weights.mean(dim=0)[n_prompt - 1 : -1]

    def _token_probs(
        self, hidden: torch.Tensor, rows: Sequence[AlignRow], n_prompt: int
    ) -> list[list[float]]:
        """Each text token's probability in the pass, over text tokens only (openai-whisper)."""
        eot = self.tokenizer.special.eot
        picked, targets = [], []
        for b, row in enumerate(rows):
            n = len(row.tokens)
            picked.append(hidden[b, n_prompt - 1 : n_prompt - 1 + n])  # positions predicting them
            targets.extend(row.tokens)
        if not targets:
            return [[] for _ in rows]
        states = torch.cat(picked)  # (sum n_b, C)
        target = torch.tensor(targets, device=hidden.device)
        values = []
        for chunk, ids in zip(states.split(LOGITS_ROWS), target.split(LOGITS_ROWS), strict=True):
            logprobs = f32_log_softmax(self.model.decoder.logits(chunk)[:, :eot])
            values.append(logprobs.gather(1, ids[:, None])[:, 0].exp())
        flat = torch.cat(values).tolist()
        out, at = [], 0
        for row in rows:
            out.append(flat[at : at + len(row.tokens)])
            at += len(row.tokens)
        return out
