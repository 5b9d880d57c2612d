"""The engine against the transformers reference: logits, greedy tokens, cache, log-mel."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from util import (
    decode_mel,
    make_random_model,
    manifest,
    real_model,
    real_tokenizer,
    shared_clip,
    shifted_tokenizer,
)

from whisper_cli import decoding
from whisper_cli.audio import load_audio
from whisper_cli.decoding import DecodeOptions, DecodeState
from whisper_cli.dtypes import resolve_policy
from whisper_cli.engine import Engine, Reply, Retry, WindowInput
from whisper_cli.features import log_mel
from whisper_cli.loading import load_model
from whisper_cli.model import FIXED, Attention, Extent

transformers = pytest.importorskip("transformers")

F32 = resolve_policy("f32", "cpu")

# (mel bins, vocabulary, tokenizer of): English-only, multilingual, large-v3 style.
CONFIGS = {
    "en-80": (80, 51864, "tiny.en"),
    "multi-80": (80, 51865, "base"),
    "v3-128": (128, 51866, "base"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def random_dirs(request, tmp_path_factory) -> Path:
    mels, vocab, tok_of = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tok = real_tokenizer(tok_of)
    if vocab == 51866:
        tok = shifted_tokenizer(tok, root / "tokenizer-v3.json")
    return make_random_model(root / "model", tok, vocab_size=vocab, num_mel_bins=mels)


def reference(path: Path):
    return transformers.WhisperForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()


def random_mel(n_mels: int, batch: int = 2) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(batch, n_mels, 3000) * 0.5


def test_random_config_logits_match_reference(random_dirs):
    ours = load_model(str(random_dirs), F32)
    ref = reference(random_dirs)
    mel = random_mel(ours.config.num_mel_bins)
    special = ours.tokenizer.special
    prompt = ours.tokenizer.prompt("en", "transcribe", timestamps=False)
    tokens = torch.tensor([[*prompt, 400, 1000, 2000, 3000]] * 2)
    with torch.no_grad():
        expected = ref(input_features=mel, decoder_input_ids=tokens).logits
        audio = ours.model.encoder(mel)
        caches = ours.model.decoder.new_caches(audio, 32)
        got = ours.model.decoder(tokens, torch.arange(tokens.shape[1]), caches, FIXED)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    assert special.sot == ref.generation_config.decoder_start_token_id


def test_static_cache_steps_equal_full_forward(random_dirs):
    """Decoding one token at a time over the static cache = one uncached full forward."""
    ours = load_model(str(random_dirs), F32)
    mel = random_mel(ours.config.num_mel_bins)
    tokens = torch.tensor([[ours.tokenizer.special.sot, 400, 1000, 2000, 3000, 17]] * 2)
    decoder = ours.model.decoder
    with torch.no_grad():
        audio = ours.model.encoder(mel)
        positions = torch.arange(tokens.shape[1])
        full = decoder(tokens, positions, decoder.new_caches(audio, 16), FIXED)
        caches = decoder.new_caches(audio, 16)
        steps = [
            decoder(tokens[:, i : i + 1], torch.tensor([i]), caches, Extent(i + 1))
            for i in range(tokens.shape[1])
        ]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def first_pass(segments: list[dict], prompt: list[int], eot: int) -> list[int]:
    """The tokens of transformers' first decoding pass over a window, as it decoded them.

    Its long-form loop keeps a pass's complete segments only and decodes the audio again
    from the last one (so its `sequences` drop the rest of that pass); each segment keeps
    the whole output of the pass that made it, prompt included."""
    sequence = segments[0]["result"]["sequences"].tolist()
    assert sequence[: len(prompt)] == prompt
    tokens = sequence[len(prompt) :]
    return tokens[: tokens.index(eot)] if eot in tokens else tokens


@pytest.mark.parametrize("timestamps", [False, True])
def test_random_config_greedy_tokens_match_reference(random_dirs, timestamps):
    """The same tokens as transformers' greedy decode of the same length (its first pass,
    with timestamps): every token, the end or the length limit included."""
    ours = load_model(str(random_dirs), F32)
    ref = reference(random_dirs)
    mel = random_mel(ours.config.num_mel_bins)
    language = "en" if ours.tokenizer.is_multilingual else None
    engine = Engine(ours, DecodeOptions(timestamps=timestamps, max_new_tokens=24))
    with torch.inference_mode():
        rows = decode_mel(engine, mel, [language] * 2).rows
    kwargs = {"language": "en", "task": "transcribe"} if language else {}
    expected = ref.generate(
        input_features=mel,
        return_timestamps=timestamps,
        max_new_tokens=24,
        return_dict_in_generate=timestamps,
        **kwargs,
    )
    eot = ours.tokenizer.special.eot
    if timestamps:
        prompt = ours.tokenizer.prompt(language, "transcribe", timestamps=True)
        expected = [first_pass(segments, prompt, eot) for segments in expected["segments"]]
    else:
        expected = [[t for t in exp if t != eot] for exp in expected.tolist()]
    for row, exp in zip(rows, expected, strict=True):
        assert list(row.tokens) == exp


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def clip_cases():
    clips = {c["file"]: c for c in manifest()["clips"]}
    yield "jfk.flac", None, clips["jfk.flac"]["reference"]
    diar = clips["stereo_diarization.wav"]
    yield "stereo_diarization.wav", "left", diar["reference_left"]
    yield "stereo_diarization.wav", "right", diar["reference_right"]


@pytest.mark.parametrize("model_name", ["tiny.en", "base"])
def test_real_models_match_reference_on_real_speech(model_name):
    """Greedy tokens identical to transformers in f32; texts equal the references."""
    model_dir = real_model(model_name)
    ours = load_model(str(model_dir), F32)
    ref = reference(model_dir)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(model_dir)
    language = "en" if ours.tokenizer.is_multilingual else None
    kwargs = {"language": "en", "task": "transcribe"} if language else {}
    for name, channel, text in clip_cases():
        audio = load_audio(shared_clip(name), channel=channel)
        features = extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        expected = ref.generate(input_features=features, return_timestamps=True, **kwargs)
        engine = Engine(ours, DecodeOptions())
        with torch.inference_mode():
            mel = log_mel(torch.from_numpy(audio)[None], ours.config.num_mel_bins)
            row = decode_mel(engine, mel, [language]).rows[0]
        exp = [t for t in expected[0].tolist() if t != ours.tokenizer.special.eot]
        assert list(row.tokens) == exp, f"{model_name} {name} {channel}"
        assert words(ours.tokenizer.decode(row.tokens)) == words(text)


def test_log_mel_matches_feature_extractor_80_and_128():
    audio = load_audio(shared_clip("jfk.flac"))
    for n_mels in (80, 128):
        extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)
        expected = extractor(audio, sampling_rate=16000, return_tensors="np").input_features
        got = log_mel(torch.from_numpy(audio)[None], n_mels).numpy()
        assert got.shape == expected.shape == (1, n_mels, 3000)
        assert np.abs(got - expected).max() < 1e-4


def test_decoders_with_other_cache_lengths_share_one_model(random_dirs):
    """Each engine's decode has caches of its own shape (prompt + max_new_tokens)."""
    ours = load_model(str(random_dirs), F32)
    mel = random_mel(ours.config.num_mel_bins)
    language = "en" if ours.tokenizer.is_multilingual else None
    short = Engine(ours, DecodeOptions(timestamps=False, max_new_tokens=4))
    long = Engine(ours, DecodeOptions(timestamps=False, max_new_tokens=16))
    with torch.inference_mode():
        first = decode_mel(long, mel, [language] * 2).rows
        decode_mel(short, mel, [language] * 2)
        again = decode_mel(long, mel, [language] * 2).rows
    assert [r.tokens for r in again] == [r.tokens for r in first]


@pytest.mark.parametrize("looping", [True, False])
def test_repetition_guard_stops_a_looping_row(random_dirs, looping, monkeypatch):
    """A row that repeats a 3-token period is stopped on the device, long before the limit."""
    ours = load_model(str(random_dirs), F32)
    steps = []
    real_choose = decoding.choose

    def step(model, rules, state, caches, extent, sample, in_step) -> None:
        # A model that never ends: token 1000 + (position mod 3) (looping) or + position.
        pos = int(state.positions(in_step)[0])
        steps.append(pos)
        logits = torch.zeros(state.tokens.shape[0], ours.config.vocab_size)
        logits[:, 1000 + (pos % 3 if looping else pos)] = 10.0
        real_choose(rules, state, logits, sample)

    monkeypatch.setattr(decoding, "step", step)
    engine = Engine(ours, DecodeOptions(timestamps=False, max_new_tokens=120))
    language = "en" if ours.tokenizer.is_multilingual else None
    rows = decode_mel(engine, random_mel(ours.config.num_mel_bins), [language] * 2).rows
    if looping:
        assert all(r.looped for r in rows)
        assert len(steps) < 60  # stopped at the first check that sees the loop
        assert all(len(r.tokens) < 20 for r in rows)  # the repeated span is cut off
    else:
        assert not any(r.looped for r in rows)
        assert len(steps) == 119 and all(len(r.tokens) == 120 for r in rows)


def test_compiled_step_inputs_have_fixed_addresses_on_cuda(random_dirs, monkeypatch):
    """On CUDA every tensor the compiled step reads (state, caches and the rules' masks) is
    marked static, so that CUDA-graph replays read it in place instead of copying it in at
    every step. Seen here through the engine's CUDA branch, with the marking recorded."""
    ours = load_model(str(random_dirs), F32)
    engine = Engine(ours, DecodeOptions(max_new_tokens=4), compile=True)
    engine.on_cuda = True
    marked = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", marked.append)
    with torch.inference_mode():
        features = engine.encode(random_mel(ours.config.num_mel_bins))
        caches = engine._caches(features)
        state = DecodeState.start(
            engine.max_new, engine.prompt_length, [0.0] * 2, [0] * 2, 0, torch.float32, F32.device
        )
        engine._static_state(state, caches)
    rules = engine.rules.tensors()
    assert len(rules) == 4  # never, first_suppress, ts_index, held_bit
    state_tensors = [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
    assert len(state_tensors) >= 7
    inputs = [*rules, *caches.tensors(), *state_tensors]
    assert {id(t) for t in inputs} <= {id(t) for t in marked}


@pytest.mark.slow
def test_a_refilled_run_decodes_each_row_as_batches_do():
    """tiny.en on nine real 30 s windows, 3 rows at a time: refilled as rows finish
    (continuous batching), each row's tokens, log-probs and no-speech probability are
    those of the same rows decoded in batches of 3 and alone; no row is dropped or
    repeated, the results keep the caller's order, and fewer steps are taken."""
    loaded = load_model(str(real_model("tiny.en")), F32)
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    long = np.concatenate([left, jfk, left, jfk, left, jfk, left, jfk])  # ~2.5 min
    windows = [long[i * 240_000 : i * 240_000 + 480_000] for i in range(9)]  # 15 s apart
    rows = [WindowInput(w, language=None, seed=k) for k, w in enumerate(windows)]

    refilled_engine = Engine(loaded, DecodeOptions())
    refilled = refilled_engine.run(rows, slots=3)
    batches_engine = Engine(loaded, DecodeOptions())
    batched = [r for at in range(0, 9, 3) for r in batches_engine.run(rows[at : at + 3]).rows]
    alone = Engine(loaded, DecodeOptions()).run(rows[4:5]).rows[0]

    assert [r.tokens for r in refilled.rows] == [r.tokens for r in batched]
    assert all(r.tokens for r in batched)
    for a, b in zip(refilled.rows, batched, strict=True):
        assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-5)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-5)
    assert refilled.rows[4].tokens == alone.tokens
    assert refilled.features.shape[0] == 9
    ran, batch = refilled_engine.counters, batches_engine.counters
    assert ran.refills == 6 and batch.refills == 0
    assert ran.steps < batch.steps


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_with_timed_kernels_a_rows_text_does_not_depend_on_its_batch(dtype, tmp_path, monkeypatch):
    """The plan's own choices, timed here (the suite's are forced): tiny.en on four real
    windows, each row's tokens and log-probability are the same alone, in one batch, and
    refilled two rows at a time (rows at their own positions under a mask)."""
    monkeypatch.setenv("WHISPER_CLI_KERNELS", "auto")
    monkeypatch.setenv("WHISPER_CLI_KERNELS_CACHE", str(tmp_path / "kernels.json"))
    loaded = load_model(str(real_model("tiny.en")), resolve_policy(dtype, "cpu"))
    assert loaded.model.plan.mode == "auto" and loaded.model.plan.timed
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    long = np.concatenate([left, jfk, left, jfk])
    windows = [long[i * 240_000 : i * 240_000 + 480_000] for i in range(4)]  # 15 s apart
    rows = [WindowInput(w, language=None, seed=k) for k, w in enumerate(windows)]

    def run(rows, slots=None):
        return [
            (r.tokens, r.avg_logprob)
            for r in Engine(loaded, DecodeOptions()).run(rows, slots=slots).rows
        ]

    batched = run(rows)
    assert run(rows, slots=2) == batched
    assert [run([r])[0] for r in rows] == batched
    assert all(tokens for tokens, _ in batched)


@pytest.mark.slow
def test_a_retry_asked_for_as_a_row_finishes_is_decoded_in_the_same_run():
    """tiny.en on five real windows, 2 rows at a time: `on_finish` hears of each row once
    as it finishes (the caller's index, then the retry's), and the retry it asks for is
    decoded in the same run, on its window's encoder output, to what that window at that
    temperature and seed decodes alone; the other rows are as in a run with no retry."""
    loaded = load_model(str(real_model("tiny.en")), F32)
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    long = np.concatenate([left, jfk, left, jfk])
    rows = [WindowInput(long[i * 240_000 : i * 240_000 + 480_000], language=None) for i in range(5)]
    plain = Engine(loaded, DecodeOptions()).run(rows, slots=2)

    heard: list[int] = []

    def on_finish(r: int, row, spare: int) -> Reply:
        heard.append(r)
        assert 0 <= spare <= 1  # two rows at once, one of them just finished
        return Reply([(3, Retry(temperature=0.6, seed=11))] if r == 3 else [])

    engine = Engine(loaded, DecodeOptions())
    decoded = engine.run(rows, slots=2, on_finish=on_finish)
    assert sorted(heard) == [0, 1, 2, 3, 4, 5]
    assert heard.index(3) < heard.index(5)
    assert len(decoded.rows) == 6 and decoded.rows[5].temperature == 0.6
    assert [r.tokens for r in decoded.rows[:5]] == [r.tokens for r in plain.rows]
    assert torch.equal(decoded.kept(5), decoded.kept(3))
    assert decoded.features.shape[0] == 5  # the window is encoded once
    again = WindowInput(rows[3].audio, language=None, temperature=0.6, seed=11)
    alone = Engine(loaded, DecodeOptions()).run([again]).rows[0]
    assert decoded.rows[5].tokens == alone.tokens and alone.tokens != plain.rows[3].tokens
    assert decoded.rows[5].avg_logprob == pytest.approx(alone.avg_logprob, abs=1e-5)
    ran = engine.counters
    assert ran.refills == 4 and ran.decoded_rows == 6 and ran.encoded_rows == 5


def test_caches_select_and_compact_rows_in_their_own_layout():
    """Keys stored by column (model.cross_keys_transposed) stay so through a select and a
    compaction, and every row lands where it should, in both layouts."""
    from whisper_cli.model import DecodeCaches, KVCache

    g = torch.Generator().manual_seed(0)
    by_column = torch.randn(6, 2, 8, 30, generator=g).mT  # (B, H, S, D) stored (B, H, D, S)
    by_rows = torch.randn(6, 2, 30, 8, generator=g)
    caches = DecodeCaches(
        [KVCache(by_rows.clone(), by_rows.clone())], [KVCache(by_column, by_rows)]
    )
    before = [t.clone() for t in caches.tensors()]
    rows = torch.tensor([4, 1])
    picked = caches.select(rows)
    for t, old in zip(picked.tensors(), before, strict=True):
        assert torch.equal(t, old[rows]) and t.stride(-2) == old.stride(-2)
    kept = caches.compact(torch.tensor([0, 2]), torch.tensor([4, 5]), 4)
    for t, new in zip(kept.tensors(), before, strict=True):
        assert torch.equal(t, new[[4, 1, 5, 3]]) and t.stride() == new.stride()


def test_copy_by_column_keeps_every_key_in_column_order():
    """model.copy_by_column copies a block of frames at a time into keys stored (B, H, D,
    S): every frame, the last partial block's too, lands where a whole transposing copy
    puts it, and nothing beside `out` is written."""
    from whisper_cli.model import BY_COLUMN_FRAMES, copy_by_column

    g = torch.Generator().manual_seed(0)
    for frames in (1, BY_COLUMN_FRAMES, 2 * BY_COLUMN_FRAMES + 5):
        x = torch.randn(3, frames, 4 * 6, generator=g)  # (B, S, C), C = H * D
        keys = x.view(3, frames, 4, 6).transpose(1, 2)  # (B, H, S, D), as split_heads
        stored = torch.full((4, 4, 6, frames), -7.0)  # (B + 1, H, D, S): row 3 untouched
        copy_by_column(keys, stored[:3].mT)
        assert torch.equal(stored[:3].mT, keys) and (stored[3] == -7.0).all()


def test_rows_dropped_in_place_decode_as_rows_never_dropped(monkeypatch):
    """tiny.en on nine real windows at once: the eager batch drops finished rows by moving
    live ones into their places (no select of the caches), and each row's tokens and
    log-probs are those of a batch that never drops a row; with an alignment pass to come
    the kept rows are selected instead, the decode's cross K/V left whole for it."""
    from whisper_cli.model import DecodeCaches

    loaded = load_model(str(real_model("tiny.en")), F32)
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    long = np.concatenate([left, jfk, left, jfk, left, jfk, left, jfk])
    windows = [long[i * 240_000 : i * 240_000 + 480_000] for i in range(9)]
    # Short windows too: rows that end early, so the batch shrinks more than once.
    windows[1], windows[5] = windows[1][:60_000], windows[5][:100_000]
    rows = [WindowInput(w, language=None) for w in windows]
    reads = []
    real_read = decoding.decoded_rows
    monkeypatch.setattr(decoding, "decoded_rows", lambda *a: reads.append(a[1]) or real_read(*a))
    whole = Engine(loaded, DecodeOptions(), shrink=False).run(rows)
    # No drop, no caller told, no row waiting: the finished rows are read once, at the end.
    assert len(reads) == 1 and sorted(reads[0]) == list(range(len(rows)))
    monkeypatch.undo()

    moved, selected = [], []
    for name, seen in (("compact", moved), ("select", selected)):
        real = getattr(DecodeCaches, name)
        monkeypatch.setattr(
            DecodeCaches, name, lambda self, *a, f=real, seen=seen: seen.append(a) or f(self, *a)
        )
    dropped = Engine(loaded, DecodeOptions()).run(rows)
    assert len(moved) >= 2 and not selected
    assert [r.tokens for r in dropped.rows] == [r.tokens for r in whole.rows]
    for a, b in zip(dropped.rows, whole.rows, strict=True):
        assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-5)

    moved.clear()
    aligned = Engine(loaded, DecodeOptions(), words=True).run(rows)
    assert selected and not moved
    assert [r.tokens for r in aligned.rows] == [r.tokens for r in whole.rows]
    # The decode's cross K/V of every row, unmoved: those of the features, row by row.
    with torch.inference_mode():
        for layer, (k, v) in zip(loaded.model.decoder.layers, aligned.cross, strict=True):
            want_k, want_v = layer.encoder_attn.cross_kv(aligned.features)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_rows_of_one_window_read_its_cross_caches_once_and_decode_as_apart(monkeypatch):
    """tiny.en on two real windows, each decoded at several temperatures in one batch (a
    retry and the attempts decoded ahead of it, which the scheduler gives one encoder
    output object): the step's cross-attention reads one row's caches for every row of a
    window (DecodeCaches.sources, kept right as rows finish and are dropped), whose cross
    K/V are projected once for all of them; and each row's tokens and log-probs are,
    exactly, those of a batch where every row has its own copy of its window's encoder
    output; so too refilled two rows at a time, where a row that takes a finished row's
    place reads its own projection's K/V, not one made at the start (with the whole
    batch's tokens; log-probs as test_a_refilled_run_decodes_each_row_as_batches_do has
    them). A `same` that names no row is refused."""
    from whisper_cli import kernels

    loaded = load_model(str(real_model("tiny.en")), F32)
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    long = np.concatenate([left, jfk, left])
    windows = [long[i * 240_000 : i * 240_000 + 480_000] for i in range(2)]
    first = Engine(loaded, DecodeOptions()).run([WindowInput(w, language=None) for w in windows])
    a, b = first.kept(0), first.kept(1)
    silent = np.zeros(0, np.float32)
    # Refilled two at a time, the first two rows (in this order: no speech map, no audio)
    # share; a row of the other window then takes the place of the first that finishes.
    attempts = [(a, 0.0, 0), (a, 0.4, 1), (b, 0.0, 0), (a, 0.8, 2), (b, 0.6, 3)]
    shared = [WindowInput(silent, features=f, temperature=t, seed=s) for f, t, s in attempts]
    apart = [replace(row, features=row.features.clone()) for row in shared]

    seen: list[tuple[int, ...]] = []
    real = kernels._fused

    def fused(q, k, v, mask, causal, sources=None):
        seen.append(sources)
        return real(q, k, v, mask, causal, sources)

    monkeypatch.setattr(kernels, "_fused", fused)
    projected: list[int] = []  # the rows each cross K/V projection takes
    real_kv = Attention.cross_kv
    monkeypatch.setattr(
        Attention,
        "cross_kv",
        lambda self, audio: projected.append(len(audio)) or real_kv(self, audio),
    )
    layers = len(loaded.model.decoder.layers)

    def run(rows, slots=None):
        decoded = Engine(loaded, DecodeOptions()).run(rows, slots=slots).rows
        return [(r.tokens, r.avg_logprob, r.no_speech_prob) for r in decoded]

    together = run(shared)
    assert seen[0] == (0, 0, 2, 0, 2)  # the step's first call, one per layer from there
    assert len(seen) > 4 * 10
    assert {len(s) for s in seen} > {5}  # still shared once finished rows were dropped
    assert projected == [2] * layers  # each window's cross K/V projected once
    seen.clear()
    projected.clear()
    separate = run(apart)
    assert not seen  # no row shares: the rows' own caches, as before
    assert projected == [5] * layers
    assert together == separate
    assert all(tokens for tokens, _, _ in together)
    with torch.inference_mode(), pytest.raises(ValueError, match="same"):
        loaded.model.decoder.new_caches(first.features, 4, same=[0])
    refilled = run(shared, slots=2)
    assert seen and seen[0] == (0, 0)
    assert refilled == run(apart, slots=2)
    assert [tokens for tokens, _, _ in refilled] == [tokens for tokens, _, _ in separate]


def test_the_guard_judges_a_refilled_row_at_its_own_token_counts(random_dirs, monkeypatch):
    """A row that loops is cut where it would be alone, whenever it entered the batch:
    the guard judges every row at multiples of loop_check_every of its own tokens."""
    ours = load_model(str(random_dirs), F32)
    real_choose = decoding.choose
    period = {0: 7, 1: 3, 2: 5}  # row seed -> the period of its loop (7: ends at once)

    def step(model, rules, state, caches, extent, sample, in_step) -> None:
        # Row with seed s writes 1000 + (its own count mod its period); seed 0 ends.
        logits = torch.zeros(state.tokens.shape[0], ours.config.vocab_size)
        rows = zip(state.seed.tolist(), state.index.tolist(), strict=True)
        for r, (seed, index) in enumerate(rows):
            token = rules.eot if seed == 0 and index >= 5 else 1000 + index % period[seed]
            logits[r, token] = 10.0
        real_choose(rules, state, logits, sample)

    monkeypatch.setattr(decoding, "step", step)
    engine = Engine(ours, DecodeOptions(timestamps=False, max_new_tokens=120))
    language = "en" if ours.tokenizer.is_multilingual else None
    features = engine.encode(random_mel(ours.config.num_mel_bins, 3))
    silent = np.zeros(0, np.float32)
    rows = [
        WindowInput(silent, features=f, language=language, seed=k) for k, f in enumerate(features)
    ]
    alone = [engine.run([row]).rows[0] for row in rows]
    # One row at a time: rows 1 and 2 each enter when the one before has finished.
    refilled = engine.run(rows, slots=1).rows
    assert [r.looped for r in alone] == [False, True, True]
    assert [(r.tokens, r.looped) for r in refilled] == [(r.tokens, r.looped) for r in alone]


def test_rows_wait_for_a_row_that_runs_to_max_new_tokens(random_dirs, monkeypatch):
    """A row that never ends holds its place for max_new_tokens; the rows waiting behind
    it are decoded after it, in full (the run does not end at the first row's limit)."""
    ours = load_model(str(random_dirs), F32)
    real_choose = decoding.choose

    def step(model, rules, state, caches, extent, sample, in_step) -> None:
        logits = torch.zeros(state.tokens.shape[0], ours.config.vocab_size)
        logits[:, 1000] = 10.0  # never the end
        real_choose(rules, state, logits, sample)

    monkeypatch.setattr(decoding, "step", step)
    options = DecodeOptions(timestamps=False, max_new_tokens=20)
    engine = Engine(ours, options)
    language = "en" if ours.tokenizer.is_multilingual else None
    features = engine.encode(random_mel(ours.config.num_mel_bins, 3))
    silent = np.zeros(0, np.float32)
    rows = [WindowInput(silent, features=f, language=language) for f in features]
    decoded = Engine(ours, options).run(rows, slots=1).rows
    assert [len(r.tokens) for r in decoded] == [20, 20, 20]
    assert all(r.hit_max_tokens and not r.looped for r in decoded)


@pytest.mark.slow
def test_a_refilled_run_passes_every_row_to_the_language_picker():
    """base (multilingual), five windows of English and German, 2 rows at a time: the
    language pass covers the rows that wait too (over caches of their own), so the picker
    sees every row's probabilities in the caller's order, as one batch of all five gives,
    and the rows decode in the languages it picked."""
    loaded = load_model(str(real_model("base")), F32)
    jfk = load_audio(shared_clip("jfk.flac"))
    multi = load_audio(shared_clip("multilingual.mp3"))  # English, then German
    windows = [jfk, multi[: 28 * 16000], multi[30 * 16000 : 58 * 16000], jfk[:80000], jfk]
    rows = [WindowInput(w, seed=k) for k, w in enumerate(windows)]
    seen = {}

    def picker(name):
        def pick(codes, probs):
            seen[name] = probs.copy()
            return [codes[int(p.argmax())] for p in probs]

        return pick

    whole = Engine(loaded, DecodeOptions()).run(rows, picker("whole"))
    refilled = Engine(loaded, DecodeOptions()).run(rows, picker("refilled"), slots=2)
    assert seen["refilled"].shape == seen["whole"].shape == (5, len(loaded.tokenizer.language_ids))
    np.testing.assert_allclose(seen["refilled"], seen["whole"], atol=1e-5)
    assert [r.language for r in refilled.rows] == [r.language for r in whole.rows]
    assert [r.language for r in whole.rows] == ["en", "en", "de", "en", "en"]
    assert [r.tokens for r in refilled.rows] == [r.tokens for r in whole.rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 256, 257, 51864, 51866])
def test_first_argmax_is_argmax_first_of_ties(dtype, n):
    """The block search picks what argmax picks (the first of equal maxima, NaN the
    largest) whatever block holds it: ties within and across blocks, the last column
    (a short tail block or none), rows with nothing left but -inf."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 4, (24, n), generator=g).to(dtype)  # every row full of ties
    x[0] = float("-inf")
    x[1, n - 1] = 9  # alone in the last column
    x[2, [n // 3, n - 1]] = 9  # tied maxima, blocks apart (the same block when n is small)
    x[3, :] = float("-inf")
    x[3, n - 1] = -5
    x[4, n // 2] = float("nan")
    x[5, [min(255, n - 1), min(256, n - 1)]] = 9  # on either side of a block boundary
    got = decoding.first_argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[2] == n // 3 and got[1] == n - 1 and got[0] == 0


def test_fill_rows_sets_rows_to_minus_inf_and_keeps_the_other_values():
    from whisper_cli.rules import fill_rows

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(4, 10).to(dtype)
        x[1, 2] = float("-inf")
        x[2, 3] = -0.0
        before = x.clone()
        fill_rows(x[:, :6], torch.tensor([True, False, False, True]))
        assert torch.isneginf(x[[0, 3], :6]).all()
        assert torch.equal(x[[1, 2]], before[[1, 2]])  # the same values (-0.0 may become 0.0)
        assert torch.equal(x[:, 6:], before[:, 6:])  # columns outside the view untouched
        assert x.dtype == dtype


def test_a_batchs_log_mel_is_each_rows_own_whatever_rows_share_its_batch():
    """batch_log_mel computes one row per call (MEL_ROWS: bounded temporaries, and a call
    over several rows may round a row otherwise where MKL runs its AVX2 GEMM): each row's
    log-mel is the bytes of that row alone, in any batch and at any place in it, padding
    rows included."""
    from whisper_cli import features

    assert features.MEL_ROWS == 1
    g = np.random.default_rng(7)
    clips = [g.standard_normal(n).astype(np.float32) * 0.1 for n in (480000, 16000, 250000)]
    clips += [load_audio(shared_clip("jfk.flac"))]
    whole = np.zeros((9, features.N_SAMPLES), dtype=np.float32)
    for row, clip in enumerate(clips):
        whole[row, : len(clip)] = clip
    alone = torch.cat([log_mel(torch.from_numpy(whole[r : r + 1]), 80) for r in range(9)])
    got = features.batch_log_mel(clips, 9, 80, torch.device("cpu"))
    assert got.shape == (9, 80, 3000) and torch.equal(got, alone)
    reordered = features.batch_log_mel(clips[::-1], 6, 80, torch.device("cpu"))
    assert torch.equal(reordered, alone[[3, 2, 1, 0, 4, 5]])


@pytest.mark.parametrize(
    ("name", "dtype", "quantize"),
    [
        ("tiny.en", "f32", "none"),
        ("base", "f32", "none"),
        ("base", "bf16", "none"),
        ("base", "f32", "int8"),
    ],
)
def test_a_windows_encoder_output_and_cross_kv_are_its_own_whatever_windows_share_its_batch(
    name, dtype, quantize
):
    """On CPU the encoder and the cross K/V projections take a batch's windows one at a
    time (model.window_parts): on four windows of real speech, a window's encoder output
    and every layer's cross K and V are the bytes of that window alone, in a batch of four
    and of three, at any place. (Held to AVX2, base f32 fails this with a batch in one
    call: MKL's f32 GEMM rounds a window there by the call's rows.)"""
    from whisper_cli import features

    loaded = load_model(str(real_model(name)), resolve_policy(dtype, "cpu", quantize))
    model = loaded.model
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    clips = [load_audio(shared_clip("jfk.flac")), left[:480_000], left[480_000:960_000]]
    clips.append(load_audio(shared_clip("hotwords.mp3"))[:480_000])
    mel = features.batch_log_mel(clips, 4, loaded.config.num_mel_bins, model.device)
    mel = mel.to(model.dtype)

    def encoded(rows: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        with torch.inference_mode():
            audio = model.encoder(mel[rows])
            return audio, model.decoder.new_caches(audio, 8).cross_kv()

    alone = [encoded([r]) for r in range(4)]
    for rows in ([0, 1, 2, 3], [3, 1, 2]):
        audio, cross = encoded(rows)
        assert audio.dtype == model.dtype and len(cross) == loaded.config.decoder_layers
        for at, r in enumerate(rows):
            assert torch.equal(audio[at], alone[r][0][0]), (rows, r)
            for (k, v), (k_alone, v_alone) in zip(cross, alone[r][1], strict=True):
                assert torch.equal(k[at], k_alone[0]) and torch.equal(v[at], v_alone[0]), (rows, r)


@pytest.mark.parametrize("timestamps", [False, True])
def test_the_rules_suppress_the_checkpoints_tokens_at_a_step_and_at_a_first_token(
    tiny_en, timestamps
):
    """A step fills exactly the never-sampled columns (the generation config's
    suppress_tokens, and <|notimestamps|> with timestamps) of the caller's logits, in
    place; a first token also the begin ones and, with timestamps, every text token and
    the timestamps past the initial limit. Every other logit keeps its value."""
    from whisper_cli.rules import Rules, apply_rules

    gen, special = tiny_en.generation, tiny_en.tokenizer.special
    rules = Rules.build(tiny_en, timestamps)
    vocab = tiny_en.config.vocab_size
    never = set(gen.suppress_tokens) | ({special.no_timestamps} if timestamps else set())
    first = never | set(gen.begin_suppress_tokens)
    if timestamps:
        last = special.timestamp_begin + gen.max_initial_timestamp_index
        first |= set(range(special.timestamp_begin)) | set(range(last + 1, vocab))
    assert len(never) > 50 and never < first < set(range(vocab))
    b = 3
    # Rows at their 5th token, after text: every timestamp rule leaves the text alone.
    state = [torch.full((b,), 4), torch.full((b,), 7), torch.full((b,), 7), torch.full((b,), -1)]
    for first_token, banned in ((False, never), (True, first)):
        index = torch.zeros(b, dtype=torch.long) if first_token else state[0]
        logits = torch.randn(b, vocab)
        logits[:, special.timestamp_begin :] -= 30  # text likelier than any timestamp
        before = logits.clone()
        out = apply_rules(rules, logits, index, *state[1:], None, first=first_token)
        assert out is logits  # in place
        cut = sorted(banned)
        assert (out[:, cut] == float("-inf")).all()
        kept = [
            t for t in range(special.timestamp_begin if timestamps else vocab) if t not in banned
        ]
        assert torch.equal(out[:, kept], before[:, kept])
