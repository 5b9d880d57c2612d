"""Word (or character) error rate of a manifest of reference transcripts, per dtype.

A manifest is JSON with a ``clips`` list; each clip names an audio ``file`` (relative to
the manifest's folder), its ``language`` ("en", or two codes joined like "en+de") and
either one ``reference`` or, for a file with one speaker per channel,
``reference_left`` / ``reference_right``. A clip whose reference is null is skipped.

Every dtype is a separate run: the model is loaded once in that dtype and every clip is
transcribed with it, clips that share transcription options sharing batches. Texts
are normalised with whisper-normalizer (the English normaliser for English clips, the
basic one otherwise) and scored with jiwer. Pooled rates divide the total errors by
the total reference words (or characters), so long clips weigh by their length, as in
the Whisper paper, rather than being averaged per clip.

No Typer or Rich here: the CLI renders `render_table` or `report_to_json`.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from whisper_cli.dtypes import DtypePolicy, expand_dtypes, resolve_policy
from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.loading import LoadedModel, load_model
from whisper_cli.pipeline import Progress, TranscribeOptions, Transcriber
from whisper_cli.results import Transcript

# Written without spaces between words: scored by characters (CER) instead of words.
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "km", "yue", "bo"})
CHANNELS = ("left", "right")
WORD, CHAR = "word", "char"


# --- manifest --------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalItem:
    """One transcription to score: a clip, or one channel of a two-channel clip."""

    clip: str  # the file as the manifest names it
    path: Path
    languages: tuple[str, ...]
    reference: str
    channel: str | None = None

    @property
    def name(self) -> str:
        return f"{self.clip}[{self.channel}]" if self.channel else self.clip

    @property
    def language(self) -> str:
        return "+".join(self.languages)

    @property
    def unit(self) -> str:
        # Any unspaced language decides: split into words, a Chinese sentence is one word.
        return CHAR if NO_SPACE_LANGUAGES.intersection(self.languages) else WORD


@dataclass(frozen=True)
class SkippedClip:
    name: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    path: Path
    items: tuple[EvalItem, ...]
    skipped: tuple[SkippedClip, ...]


def read_manifest(path: Path | str) -> Manifest:
    """Parse and check a manifest; every listed file must exist, every reference be text."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WhisperCliError(f"cannot read manifest {path}: {exc}") from exc
    clips = data.get("clips") if isinstance(data, dict) else None
    if not isinstance(clips, list):
        raise WhisperCliError(f"manifest {path} has no 'clips' list")
    items: list[EvalItem] = []
    skipped: list[SkippedClip] = []
    for number, clip in enumerate(clips, start=1):
        where = f"manifest {path}, clip {number}"
        if not isinstance(clip, dict):
            raise WhisperCliError(f"{where}: not an object")
        new_items, new_skipped = _clip_items(clip, path.parent, where)
        items.extend(new_items)
        skipped.extend(new_skipped)
    if not items:
        raise WhisperCliError(f"manifest {path} has no clip with a reference")
    return Manifest(path, tuple(items), tuple(skipped))


def _clip_items(clip: dict, folder: Path, where: str) -> tuple[list[EvalItem], list[SkippedClip]]:
    file = _text_field(clip, "file", where)
    languages = parse_languages(_text_field(clip, "language", where), where)
    per_channel = any(f"reference_{side}" in clip for side in CHANNELS)
    keys = (
        [(f"reference_{side}", side) for side in CHANNELS] if per_channel else [("reference", None)]
    )
    items, skipped = [], []
    for key, channel in keys:
        name = f"{file}[{channel}]" if channel else file
        reference = clip.get(key)
        if reference is None:
            skipped.append(SkippedClip(name, f"no {key}"))
            continue
        if not isinstance(reference, str) or not normalise(reference, languages).strip():
            raise WhisperCliError(f"{where} ({name}): {key} must be non-empty text")
        items.append(EvalItem(file, folder / file, languages, reference, channel))
    if items and not (folder / file).is_file():
        # Checked before any model loads: a missing clip would make every rate wrong.
        raise WhisperCliError(f"{where}: audio file {folder / file} not found")
    return items, skipped


def _text_field(clip: dict, key: str, where: str) -> str:
    value = clip.get(key)
    if not isinstance(value, str) or not value.strip():
        raise WhisperCliError(f"{where}: '{key}' must be a non-empty string")
    return value.strip()


def parse_languages(value: str, where: str = "language") -> tuple[str, ...]:
    """The codes of a manifest language: en gives ("en",), en+de gives ("en", "de")."""
    codes = tuple(code.strip().lower() for code in value.split("+"))
    if not all(codes):
        raise WhisperCliError(f"{where}: invalid language {value!r} (use 'en' or 'en+de')")
    return codes


# --- scoring ---------------------------------------------------------------------------


@functools.cache
def _english_normaliser() -> Callable[[str], str]:
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()  # reads its spelling table once


@functools.cache
def _basic_normaliser() -> Callable[[str], str]:
    from whisper_normalizer.basic import BasicTextNormalizer

    return BasicTextNormalizer()


def normaliser_for(languages: tuple[str, ...]) -> Callable[[str], str]:
    """English rules (spellings, numbers, contractions) only for purely English text.

    A mixed clip such as en+de gets the basic normaliser: the English one would
    rewrite German words ("die", numbers) by English rules.
    """
    return _english_normaliser() if languages == ("en",) else _basic_normaliser()


def normalise(text: str, languages: tuple[str, ...]) -> str:
    return normaliser_for(languages)(text)


@dataclass(frozen=True)
class ItemScore:
    """The score of one transcription; ``units`` are words or characters (see ``unit``)."""

    name: str
    language: str
    unit: str
    reference_units: int
    substitutions: int
    deletions: int
    insertions: int
    audio_s: float
    hypothesis: str  # as transcribed, before normalisation

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def rate(self) -> float:
        return self.errors / self.reference_units


def score_item(item: EvalItem, hypothesis: str, audio_s: float = 0.0) -> ItemScore:
    """Normalise both texts and align them by words (WER) or characters (CER)."""
    import jiwer

    reference = normalise(item.reference, item.languages)
    hyp = normalise(hypothesis, item.languages)
    if item.unit == CHAR:
        # Spaces in unspaced scripts are arbitrary (the normaliser adds some): drop them.
        reference, hyp = "".join(reference.split()), "".join(hyp.split())
        ref_units = len(reference)
        align = jiwer.process_characters
    else:
        ref_units = len(reference.split())
        align = jiwer.process_words
    if not hyp.strip():
        # Nothing transcribed: every reference unit is deleted (older jiwer rejects "").
        sub, dele, ins = 0, ref_units, 0
    else:
        out = align(reference, hyp)
        sub, dele, ins = out.substitutions, out.deletions, out.insertions
    return ItemScore(
        name=item.name,
        language=item.language,
        unit=item.unit,
        reference_units=ref_units,
        substitutions=sub,
        deletions=dele,
        insertions=ins,
        audio_s=audio_s,
        hypothesis=hypothesis,
    )


def pooled_rate(scores: Iterable[ItemScore], unit: str) -> float | None:
    """Total errors / total reference units over the clips scored in ``unit``; None if none."""
    chosen = [s for s in scores if s.unit == unit]
    total = sum(s.reference_units for s in chosen)
    return sum(s.errors for s in chosen) / total if total else None


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DtypeResult:
    """All scores of one dtype's run; wall time excludes loading the model."""

    dtype: str
    items: tuple[ItemScore, ...]
    wall_s: float
    load_s: float

    @property
    def wer(self) -> float | None:
        return pooled_rate(self.items, WORD)

    @property
    def cer(self) -> float | None:
        return pooled_rate(self.items, CHAR)

    @property
    def audio_s(self) -> float:
        return sum(s.audio_s for s in self.items)


@dataclass(frozen=True)
class EvalReport:
    manifest: str
    model: str
    device: str
    results: tuple[DtypeResult, ...]
    skipped: tuple[SkippedClip, ...]
    quantize: str = "none"  # every result's linear weights: none (the dtype's) or int8


@dataclass(frozen=True)
class EvalProgress:
    """Reported after the model loads, after every batch and after every group of clips."""

    dtype: str
    items_done: int
    items_total: int
    audio_done_s: float  # seconds of audio decoded so far in this dtype's run


# --- running ---------------------------------------------------------------------------


def options_for(
    item: EvalItem, multilingual_model: bool, batch_size: int, vad: bool = True
) -> TranscribeOptions:
    """A known language is given, not detected, so detection errors do not count as WER.

    English-only models take no language at all; a clip naming two languages is
    decoded with per-window language detection.
    """
    language, multilingual = None, False
    if multilingual_model:
        if len(item.languages) > 1:
            multilingual = True
        else:
            language = item.languages[0]
    return TranscribeOptions(
        language=language,
        multilingual=multilingual,
        channel=item.channel,
        batch_size=batch_size,
        vad=vad,
    )


def transcribe_paths(
    loaded: LoadedModel,
    options: TranscribeOptions,
    paths: list[str],
    on_progress: Callable[[Progress], None] | None = None,
) -> dict[str, Transcript]:
    """Transcripts of ``paths`` by path, decoded in shared batches; any failed input raises.

    The one place evaluation touches the pipeline (tests replace it).
    """
    results: dict[str, Transcript] = {}
    errors: list[InputError] = []
    transcriber = Transcriber(loaded, options)
    transcriber.run(paths, lambda t: results.setdefault(t.path, t), errors.append, on_progress)
    if errors:
        # A clip left out would silently change the pooled rate: the run is invalid.
        raise WhisperCliError(f"evaluation failed: {errors[0].message}")
    return results


def evaluate(
    manifest_path: Path | str,
    model: str | None,
    dtypes: Iterable[str] = ("f32",),
    device: str | None = None,
    batch_size: int = TranscribeOptions.batch_size,
    progress: Callable[[EvalProgress], None] | None = None,
    vad: bool = True,
    quantize: str = "none",
) -> EvalReport:
    """Score ``model`` (None: the device's default) on every referenced clip, once per dtype
    (each with the linear layers' weights as `quantize` says: none, or int8)."""
    manifest = read_manifest(manifest_path)
    # Every dtype is checked against the device before the first (slow) run starts.
    policies: list[DtypePolicy] = []
    for name in expand_dtypes(dtypes):
        policy = resolve_policy(name, device, quantize)
        if policy not in policies:  # "auto" may repeat an explicit choice
            policies.append(policy)
    items: tuple[EvalItem, ...] = ()
    skipped = list(manifest.skipped)
    results: list[DtypeResult] = []
    for policy in policies:
        started = time.perf_counter()
        # Every item's options share the shapes the kernel plan covers (the batch size).
        loaded = load_model(model, policy, TranscribeOptions(batch_size=batch_size, vad=vad))
        load_s = time.perf_counter() - started
        model = loaded.name  # the default model of the device, when none was named
        if not results:  # the same model in every dtype: decide what it can score once
            items, unsupported = split_supported(manifest.items, loaded)
            skipped.extend(unsupported)
        results.append(evaluate_loaded(items, loaded, batch_size, progress, load_s, vad))
        del loaded  # free this dtype's weights before the next dtype loads its own
    return EvalReport(
        manifest=str(manifest.path),
        model=model,
        device=str(policies[0].device),
        results=tuple(results),
        skipped=tuple(skipped),
        quantize=quantize,
    )


def split_supported(
    items: tuple[EvalItem, ...], loaded: LoadedModel
) -> tuple[tuple[EvalItem, ...], list[SkippedClip]]:
    """Items the model can transcribe, and the others as skipped.

    An English-only model turns other languages into English-sounding gibberish whose
    error rate measures nothing (and swings with the dtype): such clips, mixed ones
    included, are not scored for it.
    """
    if loaded.tokenizer.is_multilingual:
        return items, []
    keep = tuple(item for item in items if item.languages == ("en",))
    reason = f"{loaded.name} is English-only"
    skipped = [
        SkippedClip(item.name, f"{reason}; clip language {item.language}")
        for item in items
        if item not in keep
    ]
    if not keep:
        raise WhisperCliError(f"{reason}: the manifest has no English clip with a reference")
    return keep, skipped


def evaluate_loaded(
    items: tuple[EvalItem, ...],
    loaded: LoadedModel,
    batch_size: int = TranscribeOptions.batch_size,
    progress: Callable[[EvalProgress], None] | None = None,
    load_s: float = 0.0,
    vad: bool = True,
) -> DtypeResult:
    """One dtype's run: transcribe every item (grouped by options, batched), then score."""
    dtype = loaded.policy.name
    total = len(items)
    report = progress or (lambda _: None)
    report(EvalProgress(dtype, 0, total, 0.0))

    groups: dict[TranscribeOptions, list[EvalItem]] = {}
    for item in items:
        options = options_for(item, loaded.tokenizer.is_multilingual, batch_size, vad)
        groups.setdefault(options, []).append(item)

    transcripts: dict[EvalItem, Transcript] = {}
    audio_before = 0.0
    started = time.perf_counter()
    for options, group in groups.items():
        paths = list(dict.fromkeys(str(item.path) for item in group))
        done = len(transcripts)

        def on_batch(p: Progress, done: int = done, before: float = audio_before) -> None:
            report(EvalProgress(dtype, done, total, before + p.audio_done))

        by_path = transcribe_paths(loaded, options, paths, on_batch)
        for item in group:
            transcripts[item] = by_path[str(item.path)]
        audio_before += sum(by_path[p].duration for p in paths)
        report(EvalProgress(dtype, len(transcripts), total, audio_before))
    wall_s = time.perf_counter() - started

    scores = tuple(
        score_item(item, transcripts[item].text, transcripts[item].duration)
        for item in items  # manifest order, whatever order the groups ran in
    )
    return DtypeResult(dtype, scores, round(wall_s, 3), round(load_s, 3))


# --- rendering -------------------------------------------------------------------------


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.2f}%"


def render_table(report: EvalReport) -> str:
    """A plain-text table: one row per clip, one column per dtype, pooled rows below."""
    results = report.results
    names = [s.name for s in results[0].items] if results else []
    width = max([len(n) for n in names] + [len("pooled WER")])
    head = f"{'clip':<{width}}  {'lang':<6} {'unit':<4}" + "".join(
        f" {r.dtype:>10}" for r in results
    )
    weights = "" if report.quantize == "none" else f", {report.quantize} weights"
    lines = [f"model {report.model} on {report.device}{weights}; manifest {report.manifest}", head]
    lines.append("-" * len(head))
    for row, name in enumerate(names):
        first = results[0].items[row]
        unit = "CER" if first.unit == CHAR else "WER"
        cells = "".join(f" {_percent(r.items[row].rate):>10}" for r in results)
        lines.append(f"{name:<{width}}  {first.language:<6} {unit:<4}{cells}")
    lines.append("-" * len(head))
    pad = " " * 12
    if any(r.wer is not None for r in results):
        cells = "".join(f" {_percent(r.wer):>10}" for r in results)
        lines.append(f"{'pooled WER':<{width}}{pad}{cells}")
    if any(r.cer is not None for r in results):
        cells = "".join(f" {_percent(r.cer):>10}" for r in results)
        lines.append(f"{'pooled CER':<{width}}{pad}{cells}")
    lines.append(f"{'audio s':<{width}}{pad}" + "".join(f" {r.audio_s:>10.1f}" for r in results))
    lines.append(f"{'wall s':<{width}}{pad}" + "".join(f" {r.wall_s:>10.1f}" for r in results))
    lines.append(f"{'load s':<{width}}{pad}" + "".join(f" {r.load_s:>10.1f}" for r in results))
    for skip in report.skipped:
        lines.append(f"skipped {skip.name}: {skip.reason}")
    return "\n".join(lines) + "\n"


def _item_json(score: ItemScore) -> dict:
    return {
        "clip": score.name,
        "language": score.language,
        "unit": score.unit,
        "rate": score.rate,
        "errors": score.errors,
        "reference_units": score.reference_units,
        "substitutions": score.substitutions,
        "deletions": score.deletions,
        "insertions": score.insertions,
        "audio_s": round(score.audio_s, 3),
        "hypothesis": score.hypothesis,
    }


def report_to_json(report: EvalReport) -> dict:
    """Plain JSON-serialisable data: everything the table shows, plus counts and texts."""
    return {
        "manifest": report.manifest,
        "model": report.model,
        "device": report.device,
        "quantize": report.quantize,
        "skipped": [{"clip": s.name, "reason": s.reason} for s in report.skipped],
        "results": [
            {
                "dtype": r.dtype,
                "wer": r.wer,
                "cer": r.cer,
                "audio_s": round(r.audio_s, 3),
                "wall_s": r.wall_s,
                "load_s": r.load_s,
                "clips": [_item_json(s) for s in r.items],
            }
            for r in report.results
        ],
    }
