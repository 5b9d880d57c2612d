"""Error-rate evaluation: manifest reading, scoring arithmetic, options, and real dtype parity.

The unit tests replace model loading and transcription with fakes, so they check the
bookkeeping (pooling, skipping, channels, units, normalisers) exactly and fast. The
slow tests run the real models on the shared clips in every dtype.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from util import real_model, shared_clip

from whisper_cli.errors import WhisperCliError
from whisper_cli.options import default_model
from whisper_cli.pipeline import TranscribeOptions
from whisper_cli.results import Transcript
from whisper_cli.tools import evaluate as ev

# --- fakes ---------------------------------------------------------------------------------


def write_manifest(folder: Path, clips: list[dict]) -> Path:
    """A manifest plus placeholder audio files (never decoded: transcription is faked)."""
    for clip in clips:
        (folder / clip["file"]).write_bytes(b"not audio")
    path = folder / "manifest.json"
    path.write_text(json.dumps({"clips": clips}), encoding="utf-8")
    return path


class FakeRun:
    """Stands in for load_model and transcribe_paths; records what evaluation asked for."""

    def __init__(self, texts: dict[tuple[str, str | None], str], multilingual: bool = True):
        self.texts = texts  # (file name, channel) -> transcript text
        self.multilingual = multilingual
        self.loads: list[str] = []
        self.calls: list[tuple[TranscribeOptions, list[str]]] = []

    def load_model(self, name, policy, options=None):
        self.loads.append(policy.name)
        tokenizer = SimpleNamespace(is_multilingual=self.multilingual)
        name = name or default_model(policy.device.type)  # as loading.load_model names it
        return SimpleNamespace(name=name, policy=policy, tokenizer=tokenizer)

    def transcribe_paths(self, loaded, options, paths, on_progress=None):
        self.calls.append((options, list(paths)))
        out = {}
        for path in paths:
            text = self.texts[(Path(path).name, options.channel)]
            out[path] = Transcript(path=path, text=text, language=None, segments=(), duration=2.0)
        return out


@pytest.fixture
def fake(monkeypatch):
    def install(texts, multilingual=True) -> FakeRun:
        run = FakeRun(texts, multilingual)
        monkeypatch.setattr(ev, "load_model", run.load_model)
        monkeypatch.setattr(ev, "transcribe_paths", run.transcribe_paths)
        return run

    return install


def by_name(result: ev.DtypeResult) -> dict[str, ev.ItemScore]:
    return {score.name: score for score in result.items}


# --- pooling and skipping --------------------------------------------------------------------


def test_pooled_rate_is_total_errors_over_total_words_not_mean(tmp_path, fake):
    manifest = write_manifest(
        tmp_path,
        [
            {"file": "short.wav", "language": "en", "reference": "hello world"},
            {"file": "long.wav", "language": "en", "reference": "ask what you can do for"},
        ],
    )
    fake({("short.wav", None): "hello there", ("long.wav", None): "ask what you can do for"})
    report = ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    (result,) = report.results
    scores = by_name(result)
    assert scores["short.wav"].rate == pytest.approx(1 / 2)
    assert scores["long.wav"].rate == 0.0
    assert result.wer == pytest.approx(1 / 8)  # not (0.5 + 0) / 2
    assert result.cer is None
    assert result.audio_s == 4.0


def test_null_reference_is_skipped_and_listed(tmp_path, fake):
    manifest = write_manifest(
        tmp_path,
        [
            {"file": "a.wav", "language": "en", "reference": "ask not"},
            {"file": "b.mp3", "language": "en", "reference": None, "reference_note": "unknown"},
        ],
    )
    run = fake({("a.wav", None): "ask not"})
    report = ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    assert [s.name for s in report.results[0].items] == ["a.wav"]
    assert [(s.name, s.reason) for s in report.skipped] == [("b.mp3", "no reference")]
    assert [Path(p).name for _, paths in run.calls for p in paths] == ["a.wav"]
    assert "skipped b.mp3" in ev.render_table(report)


def test_two_channel_clip_gives_one_entry_per_channel(tmp_path, fake):
    manifest = write_manifest(
        tmp_path,
        [
            {
                "file": "stereo.wav",
                "language": "en",
                "reference_left": "the wizard vanished",
                "reference_right": "the horizon seems distant",
            },
            {
                "file": "half.wav",
                "language": "en",
                "reference_left": "only left",
                "reference_right": None,
            },
        ],
    )
    run = fake(
        {
            ("stereo.wav", "left"): "the wizard vanished",
            ("stereo.wav", "right"): "the horizon is distant",
            ("half.wav", "left"): "only left",
        }
    )
    report = ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    scores = by_name(report.results[0])
    assert list(scores) == ["stereo.wav[left]", "stereo.wav[right]", "half.wav[left]"]
    assert scores["stereo.wav[left]"].errors == 0
    assert scores["stereo.wav[right]"].substitutions == 1
    assert [s.name for s in report.skipped] == ["half.wav[right]"]
    # Each channel is its own transcription; both left channels share one batch.
    assert sorted(o.channel for o, _ in run.calls) == ["left", "right"]
    left = next(paths for o, paths in run.calls if o.channel == "left")
    assert [Path(p).name for p in left] == ["stereo.wav", "half.wav"]


# --- units and normalisers -------------------------------------------------------------------


def test_chinese_clip_is_scored_by_characters(tmp_path, fake):
    manifest = write_manifest(
        tmp_path,
        [
            {"file": "zh.wav", "language": "zh", "reference": "我们说中文。"},
            {"file": "en.wav", "language": "en", "reference": "ask not"},
        ],
    )
    fake({("zh.wav", None): "我 说中问", ("en.wav", None): "ask not"})
    result = ev.evaluate(manifest, "fake", ["f32"], device="cpu").results[0]
    zh = by_name(result)["zh.wav"]
    assert zh.unit == ev.CHAR
    assert zh.reference_units == 5  # punctuation and spaces do not count
    assert (zh.substitutions, zh.deletions, zh.insertions) == (1, 1, 0)
    assert result.cer == pytest.approx(2 / 5)
    assert result.wer == 0.0  # words and characters are pooled separately
    assert "pooled CER" in ev.render_table(ev.evaluate(manifest, "fake", ["f32"], device="cpu"))


@pytest.mark.parametrize("language", ["ja", "th", "yue", "zh+en"])
def test_unspaced_languages_use_characters(language):
    item = ev.EvalItem("x.wav", Path("x.wav"), ev.parse_languages(language), "abc")
    assert item.unit == ev.CHAR


def test_english_normaliser_for_english_basic_for_others():
    english = ev.normaliser_for(("en",))
    assert english is ev.normaliser_for(("en",))  # built once
    assert ev.normaliser_for(("de",)) is ev.normaliser_for(("en", "de"))
    assert english is not ev.normaliser_for(("en", "de"))

    def item(language: str) -> ev.EvalItem:
        return ev.EvalItem(
            "x.wav", Path("x.wav"), ev.parse_languages(language), "Mr. Smith's colour"
        )

    # English rules map spellings and abbreviations; the basic normaliser only cases and
    # strips punctuation, so the same pair of texts differs for a German or mixed clip.
    hypothesis = "mister Smith's color"
    assert ev.score_item(item("en"), hypothesis).errors == 0
    assert ev.score_item(item("de"), hypothesis).errors == 2
    assert ev.score_item(item("en+de"), hypothesis).errors == 2


def test_empty_hypothesis_counts_every_word_deleted():
    item = ev.EvalItem("x.wav", Path("x.wav"), ("en",), "ask not what")
    score = ev.score_item(item, "")
    assert (score.deletions, score.errors, score.rate) == (3, 3, 1.0)


# --- options, dtypes, errors -------------------------------------------------------------------


def test_language_options_per_model_kind(tmp_path, fake):
    clips = [
        {"file": "en.wav", "language": "en", "reference": "ask not"},
        {"file": "de.wav", "language": "de", "reference": "frag nicht"},
        {"file": "mix.wav", "language": "en+de", "reference": "ask not frag nicht"},
    ]
    manifest = write_manifest(tmp_path, clips)
    texts = {(c["file"], None): c["reference"] for c in clips}

    run = fake(texts, multilingual=True)
    ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    got = {Path(paths[0]).name: (o.language, o.multilingual) for o, paths in run.calls}
    assert got == {"en.wav": ("en", False), "de.wav": ("de", False), "mix.wav": (None, True)}

    # English-only: no language given; clips in other languages (mixed too) not scored.
    run = fake(texts, multilingual=False)
    report = ev.evaluate(manifest, "fake", ["f32"], device="cpu", batch_size=4)
    ((options, paths),) = run.calls
    assert (options.language, options.multilingual, options.batch_size) == (None, False, 4)
    assert [Path(p).name for p in paths] == ["en.wav"]
    assert [s.name for s in report.results[0].items] == ["en.wav"]
    assert [s.name for s in report.skipped] == ["de.wav", "mix.wav"]
    assert "English-only" in report.skipped[0].reason


def test_english_only_model_needs_an_english_clip(tmp_path, fake):
    clip = {"file": "de.wav", "language": "de", "reference": "frag nicht"}
    manifest = write_manifest(tmp_path, [clip])
    fake({}, multilingual=False)
    with pytest.raises(WhisperCliError, match="no English clip"):
        ev.evaluate(manifest, "fake", ["f32"], device="cpu")


def test_all_dtypes_load_the_model_once_each(tmp_path, fake):
    manifest = write_manifest(tmp_path, [{"file": "a.wav", "language": "en", "reference": "hi"}])
    run = fake({("a.wav", None): "hi"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # f16 on CPU is slow: expected here
        report = ev.evaluate(manifest, "fake", ["all"], device="cpu")
    assert run.loads == ["f32", "f16", "bf16"]
    assert [r.dtype for r in report.results] == ["f32", "f16", "bf16"]
    data = ev.report_to_json(report)
    json.dumps(data)  # plain data only
    assert [r["wer"] for r in data["results"]] == [0.0, 0.0, 0.0]
    assert data["results"][0]["clips"][0]["hypothesis"] == "hi"


@pytest.mark.parametrize(("cuda", "expected"), [(True, "turbo"), (False, "base")])
def test_no_model_means_the_default_of_the_device_it_runs_on(
    tmp_path, fake, monkeypatch, cuda, expected
):
    import torch

    manifest = write_manifest(tmp_path, [{"file": "a.wav", "language": "en", "reference": "hi"}])
    fake({("a.wav", None): "hi"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    report = ev.evaluate(manifest, None, ["f32"], device="auto")
    assert report.model == expected
    assert report.device == ("cuda" if cuda else "cpu")


def test_progress_reports_every_item(tmp_path, fake):
    manifest = write_manifest(
        tmp_path,
        [
            {"file": "a.wav", "language": "en", "reference": "hi"},
            {"file": "b.wav", "language": "de", "reference": "hallo"},
        ],
    )
    fake({("a.wav", None): "hi", ("b.wav", None): "hallo"})
    seen: list[ev.EvalProgress] = []
    ev.evaluate(manifest, "fake", ["f32"], device="cpu", progress=seen.append)
    assert seen[0].items_done == 0
    assert (seen[-1].items_done, seen[-1].items_total, seen[-1].audio_done_s) == (2, 2, 4.0)


@pytest.mark.parametrize(
    ("clips", "message"),
    [
        ([{"file": "a.wav", "language": "en", "reference": "[music] um"}], "non-empty text"),
        ([{"file": "a.wav", "language": "", "reference": "hi"}], "'language'"),
        ([{"file": "a.wav", "language": "en", "reference": None}], "no clip with a reference"),
    ],
)
def test_bad_manifests_fail_before_loading(tmp_path, fake, clips, message):
    manifest = write_manifest(tmp_path, clips)
    run = fake({})
    with pytest.raises(WhisperCliError, match=message):
        ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    assert run.loads == []


def test_missing_audio_file_fails_before_loading(tmp_path, fake):
    manifest = tmp_path / "manifest.json"
    clip = {"file": "gone.wav", "language": "en", "reference": "hi"}
    manifest.write_text(json.dumps({"clips": [clip]}))
    run = fake({})
    with pytest.raises(WhisperCliError, match=r"gone\.wav not found"):
        ev.evaluate(manifest, "fake", ["f32"], device="cpu")
    with pytest.raises(WhisperCliError, match="cannot read manifest"):
        ev.read_manifest(tmp_path / "nothing.json")
    assert run.loads == []


# --- real models ---------------------------------------------------------------------------

DTYPE_TOLERANCE = 0.01  # one point of pooled WER


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny.en", "base"])
def test_half_precision_wer_matches_f32_on_shared_clips(model):
    """f16 and bf16 transcribe the real clips about as well as f32 does.

    Only the referenced clips are decoded, the model is loaded once per dtype, and
    clips with the same options share batches. f16 on CPU has no native kernels and
    dominates the run time (see the timings printed with -s).
    """
    manifest = shared_clip("manifest.json")
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = ev.evaluate(manifest, str(real_model(model)), ["all"], device="cpu")
    print(f"\n{ev.render_table(report)}total {time.perf_counter() - started:.1f} s")
    f32, f16, bf16 = report.results
    assert (f32.dtype, f16.dtype, bf16.dtype) == ("f32", "f16", "bf16")
    assert by_name(f32)["jfk.flac"].rate <= 0.1  # the models work at all
    assert abs(f16.wer - f32.wer) <= DTYPE_TOLERANCE
    assert abs(bf16.wer - f32.wer) <= DTYPE_TOLERANCE
