"""Calibration data for the speech-map thresholds of options.Policy, on audio no test asserts on.

Speech comes from eSpeak NG (Debian's `espeak-ng`: several voices, English, French,
German and Spanish; word lists with pauses, sentences, short words, at full level, 20 dB
down and in noise) and from the real two-speaker sample of `make demo` (pyannote's,
with its reference times in sample.stm). Non-speech is generated: clicks, knocks, noise
bursts, tones, chords, hum and noise. The tests assert on none of it.

It prints, per question:
  onsets  how late the detector's onset is after the true start of speech, for eSpeak's
          (known starts) and, by word timing with the map off, for real speech: the demo
          sample and the shared clips 20 dB down and in noise (-> speech_lead_seconds)
  level   the speech frames found with each input stored at a peak of -20 to -80 dBFS,
          with the detector's gain and without it, and the non-speech at its level and
          30 and 50 dB down (-> detector_target_dbfs, detector_max_gain_db); then speech
          at -20 to -50 dBFS after 6 s of something loud (a chord, music, noise, a loud
          talker), and non-speech after a loud talker (-> quiet_drop_db,
          quiet_hold_seconds, quiet_room_db)
  short   the peak speech probability of stretches shorter than min_speech_seconds, for
          short words and for non-speech (-> short_speech_threshold)
  text    for every segment decoded with the map on: the speech under it (per margin),
          its own mean token log-prob, its window's no-speech probability, and whether
          its words are real (-> text_min_speech_seconds, text_speech_margin_seconds)
  ends    with the map off and no hold: the speech left running on after a window's last
          timestamp in windows whose text is complete (-> end_slack_seconds)
  spans   with the no-skip rule off: the speech under each real segment against its text
          tokens, and in the gaps between segments; then the reference words found with
          the rule on and off (-> segment_speech_seconds, segment_speech_per_token_seconds,
          gap_speech_seconds)
  cuts    with the map on, long readings whose windows are cut inside speech: the words
          lost and invented at each slack for a window its end cut off, and the windows
          judged silent (-> cut_end_slack_seconds)
  draws   with the map on, the long readings and the same texts said twice running: the
          words lost and invented with each count of attempts that must repeat what was
          heard before a draw that passes is set aside (-> repeat_min_attempts)
  repeats with the map on, the corpus, speech that repeats itself (a sentence said four
          times, short words three times running, a word list with every word twice)
          and the non-speech: in windows where every temperature failed, the reference
          words found and the words invented by the attempt judge.best keeps, against
          faster-whisper's rule (-> judge.repeats_speech)
  tolerance
          with the map on, the corpus, the repeated, long and doubled readings: the
          reference words found and the words past the reference's counts with each share
          of a repeat's words that may differ from what it repeats, and the segments each
          share drops that word-for-word matching keeps (-> repeat_max_changed_share)

    python scripts/calibrate_speech.py [--model models/tiny.en] [--model models/base]
        [--dtype f32|bf16|f16] [--quantize none|int8]
        [--only detector|level|text|ends|spans|cuts|draws|repeats|tolerance]

The decoding questions run each model in --dtype (default f32) with --quantize (default
none), on the CPU: a threshold that drops text is then checked in the mode a user runs
(int8 weights, a bf16 run) as well as in f32.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import soundfile as sf
import soxr

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from whisper_cli import pipeline  # noqa: E402
from whisper_cli.audio import SAMPLE_RATE, load_audio  # noqa: E402
from whisper_cli.decoding import DecodedRow  # noqa: E402
from whisper_cli.dtypes import resolve_policy  # noqa: E402
from whisper_cli.judge import Judgement, judge  # noqa: E402
from whisper_cli.loading import load_model  # noqa: E402
from whisper_cli.options import Policy, TranscribeOptions  # noqa: E402
from whisper_cli.speech import FRAME_SAMPLES, FRAME_SECONDS, SpeechStream, load_detector  # noqa: E402
from whisper_cli.windows import Window, speech_stream  # noqa: E402

RATE = SAMPLE_RATE
DEMO = REPO / ".cache" / "demo"


@dataclass(frozen=True)
class ModelRun:
    """A model as the decoding questions run it: its directory, dtype and quantization."""

    path: str
    dtype: str = "f32"
    quantize: str = "none"

    @property
    def label(self) -> str:
        """Its name and mode, as each question's heading gives them: "tiny.en f32 + int8"."""
        mode = self.dtype if self.quantize == "none" else f"{self.dtype} + {self.quantize}"
        return f"{Path(self.path).name} {mode}"

    @functools.lru_cache(maxsize=1)  # noqa: B019 (one ModelRun lives for the script's run)
    def load(self):
        """The model, loaded once for every question asked of it in a row (the latest
        run's alone is kept)."""
        return load_model(self.path, resolve_policy(self.dtype, "cpu", self.quantize))


_WORD_LISTS = {
    "en": "apple river seven yellow window garden pencil thunder basket morning",
    "fr": "pomme rivière sept jaune fenêtre jardin crayon tonnerre panier matin",
    "de": "Apfel Fluss sieben gelb Fenster Garten Bleistift Donner Korb Morgen",
    "es": "manzana río siete amarillo ventana jardín lápiz trueno cesta mañana",
}
WORDS = {lang: words.split() for lang, words in _WORD_LISTS.items()}
SHORT = {"en": ["yes", "no", "hi", "stop", "two"], "fr": ["oui", "non"], "de": ["ja", "nein"]}
SENTENCES = {
    "en": [
        "And so it begins, quietly, with a single step.",
        "Please send the report to the office before noon on Friday.",
        "The weather turned cold, so we stayed inside and read.",
    ],
    "fr": ["Bonjour ! Est-ce que vous allez bien ?", "Le train part à huit heures du soir."],
    "de": ["Guten Morgen, wie geht es Ihnen heute?", "Das Buch liegt auf dem Tisch."],
    "es": ["Buenos días, ¿cómo estás hoy?", "La casa está cerca del río."],
}
# Continuous reading (no pause long enough to cut it), at a normal and a slow pace: how
# much speech a segment's text covers when nothing breaks it up.
PARAGRAPHS = {
    "en": "When the ferry finally reached the harbour, the passengers gathered their bags "
    "and waited in a long, patient line, while the gulls circled overhead and a small boy "
    "counted the boats that were tied along the old stone wall, one by one, until his "
    "mother called him back.",
    "fr": "Quand le bateau est enfin arrivé au port, les passagers ont pris leurs sacs et "
    "ont attendu en silence, pendant que les mouettes tournaient au-dessus de l'eau et "
    "qu'un petit garçon comptait les barques attachées le long du vieux mur de pierre.",
    "de": "Als die Fähre endlich den Hafen erreichte, nahmen die Reisenden ihre Taschen "
    "und warteten geduldig in einer langen Reihe, während die Möwen über dem Wasser "
    "kreisten und ein kleiner Junge die Boote an der alten Mauer zählte.",
    "es": "Cuando el barco llegó por fin al puerto, los pasajeros recogieron sus bolsas y "
    "esperaron en una larga fila, mientras las gaviotas volaban sobre el agua y un niño "
    "contaba las barcas atadas junto al viejo muro de piedra.",
}
VOICES = {"en": ["en", "en+f3", "en-us+m3"], "fr": ["fr", "fr+f2"], "de": ["de"], "es": ["es"]}


def speak(text: str, voice: str, speed: int = 160) -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", f.name, text], check=True)
        audio, rate = sf.read(f.name, dtype="float32")
    audio = soxr.resample(audio, rate, RATE).astype(np.float32)
    nonzero = np.flatnonzero(np.abs(audio) > 1e-4)  # eSpeak pads with digital silence
    return audio[nonzero[0] : nonzero[-1] + 1] / max(np.abs(audio).max(), 1e-9) * 0.5


def noise(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    if kind == "brown":
        x = np.cumsum(x)
        x -= np.convolve(x, np.ones(800) / 800, mode="same")
    return (x / np.sqrt(np.mean(x**2))).astype(np.float32)


def tone(seconds: float, freqs: tuple[float, ...], level: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (level * sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * RATE), np.float32)


def with_noise(x: np.ndarray, snr_db: float | None, kind: str, seed: int) -> np.ndarray:
    """x in noise at snr_db relative to its speech level (None: clean)."""
    if snr_db is None:
        return x
    level = np.sqrt(np.mean(x[np.abs(x) > 1e-3] ** 2))
    return (x + level / 10 ** (snr_db / 20) * noise(kind, len(x), seed)).astype(np.float32)


# --- the corpus --------------------------------------------------------------------------------


def corpus() -> list[dict]:
    """Inputs with their reference text and the true start of every stretch of speech."""
    rng = np.random.default_rng(0)
    items = []
    for lang, voices in VOICES.items():
        for v, voice in enumerate(voices):
            for level_db in (0, -20):
                gain = 10 ** (level_db / 20)
                for snr in (None, 10):
                    # A word list: words 1.5-3 s apart, after 2 s of silence (or noise).
                    pieces, starts, t = [silence(2.0)], [], 2.0
                    for word in WORDS[lang]:
                        audio = speak(word, voice) * gain
                        starts.append(t)
                        gap = float(rng.uniform(1.5, 3.0))
                        pieces += [audio, silence(gap)]
                        t += len(audio) / RATE + gap
                    items.append(
                        {
                            "name": f"{voice} words {level_db} dB snr {snr}",
                            "lang": lang,
                            "audio": with_noise(np.concatenate(pieces), snr, "white", v),
                            "reference": " ".join(WORDS[lang]),
                            "starts": starts,
                        }
                    )
                    # Sentences after pauses, the last running to 0.3 s before the end.
                    pieces, starts, t = [silence(1.5)], [], 1.5
                    for sentence in SENTENCES[lang]:
                        audio = speak(sentence, voice) * gain
                        starts.append(t)
                        pieces += [audio, silence(2.5)]
                        t += len(audio) / RATE + 2.5
                    pieces[-1] = silence(0.3)
                    items.append(
                        {
                            "name": f"{voice} sentences {level_db} dB snr {snr}",
                            "lang": lang,
                            "audio": with_noise(np.concatenate(pieces), snr, "brown", v + 7),
                            "reference": " ".join(SENTENCES[lang]),
                            "starts": starts,
                        }
                    )
            # A paragraph read straight through, at a normal and a slow pace.
            for speed in (160, 90):
                for snr in (None, 10):
                    items.append(
                        {
                            "name": f"{voice} paragraph speed {speed} snr {snr}",
                            "lang": lang,
                            "audio": with_noise(
                                np.concatenate(
                                    [
                                        silence(1.0),
                                        speak(PARAGRAPHS[lang], voice, speed),
                                        silence(1.0),
                                    ]
                                ),
                                snr,
                                "white",
                                v + 3,
                            ),
                            "reference": PARAGRAPHS[lang],
                            "starts": [1.0],
                        }
                    )
            # Short words alone, each after 20 s of silence.
            for word in SHORT.get(lang, []):
                for level_db in (0, -20):
                    audio = speak(word, voice) * 10 ** (level_db / 20)
                    items.append(
                        {
                            "name": f"{voice} short '{word}' {level_db} dB",
                            "lang": lang,
                            "audio": np.concatenate([silence(20.0), audio, silence(2.0)]),
                            "reference": word,
                            "starts": [20.0],
                            "short": True,
                        }
                    )
    if (DEMO / "sample.wav").exists():  # `make demo` fetches it
        starts, words, previous_end = [], [], 0.0
        for line in (DEMO / "sample.stm").read_text().splitlines():
            fields = line.split(maxsplit=5)
            start, end = float(fields[3]), float(fields[4])
            if start - previous_end >= 0.5:  # onsets after a pause only
                starts.append(start)
            previous_end = end
            words.append(fields[5])
        items.append(
            {
                "name": "demo sample (real, two speakers)",
                "lang": "en",
                "audio": load_audio(DEMO / "sample.wav"),
                "reference": " ".join(words),
                "starts": starts,
            }
        )
    return items


def non_speech() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    clicks = silence(20.0)
    clicks[rng.integers(0, len(clicks), 40)] = 0.8
    knocks = silence(20.0)
    for at in rng.integers(0, len(knocks) - 800, 15):
        knocks[at : at + 800] += (
            np.exp(-np.arange(800) / 120) * np.sin(np.arange(800) * 0.3) * 0.6
        ).astype(np.float32)
    bursts = silence(20.0)
    for at in rng.integers(0, len(bursts) - 3200, 12):
        n = int(rng.integers(800, 3200))  # 50-200 ms
        bursts[at : at + n] += 0.2 * noise("white", n, int(at))
    beeps = np.concatenate([np.concatenate([tone(0.15, (1000.0,)), silence(0.85)])] * 20)
    music = np.concatenate([tone(0.25, (f, f * 1.25, f * 1.5)) for f in rng.uniform(200, 600, 80)])
    return {
        "clicks": clicks,
        "knocks": knocks,
        "noise bursts 50-200 ms": bursts,
        "beeps 150 ms": beeps,
        "music (chords, 250 ms notes)": music,
        "hum 50 Hz + harmonics": tone(20.0, (50.0, 100.0, 150.0), 0.1),
        "white -30 dBFS": 0.03 * noise("white", 20 * RATE, 3),
        "brown -20 dBFS": 0.1 * noise("brown", 20 * RATE, 4),
    }


# --- the detector alone ------------------------------------------------------------------------


def runs(probs: np.ndarray, policy: Policy) -> list[tuple[int, int]]:
    """(first, last + 1) frames of each stretch of speech by the policy's hysteresis."""
    out, speaking, first = [], False, 0
    for i, p in enumerate(probs):
        now = p >= (policy.vad_neg_threshold if speaking else policy.vad_threshold)
        if now and not speaking:
            first = i
        if speaking and not now:
            out.append((first, i))
        speaking = now
    if speaking:
        out.append((first, len(probs)))
    return out


def speech_map(audio: np.ndarray, detector) -> np.ndarray:
    """The map the product makes (the default policy's gain)."""
    stream = speech_stream(detector, Policy())
    stream.push(audio)
    stream.finish()
    return stream.map()


def onsets_and_short(items: list[dict], detector, policy: Policy) -> None:
    print("## onsets: detector onset minus the true start of speech (s)")
    lags: dict[str, list[float]] = {}
    short_peaks: list[tuple[float, str]] = []
    for item in items:
        probs = speech_map(item["audio"], detector)
        found = runs(probs, policy)
        for start in item["starts"]:
            after = [a for a, _ in found if a * FRAME_SECONDS >= start - 0.3]
            if after:
                lag = after[0] * FRAME_SECONDS - start
                if lag < 1.5:  # else the detector missed this one (counted below)
                    key = item["name"].split(" ", 1)[1]
                    lags.setdefault(key, []).append(lag)
        for a, b in found:
            if (b - a) * FRAME_SECONDS < policy.min_speech_seconds:
                short_peaks.append((float(probs[a:b].max()), item["name"]))
        if item.get("short"):
            peak = float(probs[round(19.5 / FRAME_SECONDS) :].max())
            print(f"  short word {item['name']:34s} peak P {peak:.3f}")
    every = [lag for values in lags.values() for lag in values]
    for key, values in sorted(lags.items()):
        v = np.array(values)
        print(f"  {key:28s} n {len(v):3d} median {np.median(v):+.3f} max {v.max():+.3f}")
    print(
        f"  ALL n {len(every)} p50 {np.percentile(every, 50):+.3f} p95 "
        f"{np.percentile(every, 95):+.3f} p99 {np.percentile(every, 99):+.3f} max {max(every):+.3f}"
    )
    print("\n## short stretches (< min_speech_seconds) in speech: peak P")
    for peak, name in sorted(short_peaks, reverse=True)[:25]:
        print(f"  {peak:.3f} {name}")
    print("\n## short stretches in non-speech: peak P (and the longest stretch)")
    for name, audio in non_speech().items():
        probs = speech_map(audio, detector)
        found = runs(probs, policy)
        peaks = [float(probs[a:b].max()) for a, b in found]
        longest = max(((b - a) * FRAME_SECONDS for a, b in found), default=0.0)
        print(
            f"  {name:30s} stretches {len(found):3d} max peak {max(peaks, default=0.0):.3f} "
            f"longest {longest:.2f} s  overall max P {probs.max():.3f}"
        )


def level_evidence(items: list[dict], detector, policy: Policy) -> None:
    """The detector at other recording levels, with and without its gain (speech.LevelGain):
    each input brought to a peak of L dBFS and stored as 16-bit PCM would store it; the
    speech frames found against those found at the input's own level (recall), and the
    frames found that were not (added). Then the non-speech at its level, 30 and 50 dB
    down, and digital silence plain and dithered (+-1 LSB): the stretches the map's rules
    call speech (runs of at least min_speech_seconds, or of a short word's peak)."""

    def as_16_bit(x: np.ndarray, peak_dbfs: float) -> np.ndarray:
        y = x / max(float(np.abs(x).max()), 1e-12) * 10 ** (peak_dbfs / 20)
        return (np.round(y * 32767) / 32767).astype(np.float32)

    def probs_of(audio: np.ndarray, gain: bool) -> np.ndarray:
        """gain: the product's map (its gain and quiet sections); else the detector alone."""
        stream = speech_stream(detector, policy) if gain else SpeechStream(detector)
        stream.push(audio)
        stream.finish()
        return stream.map()

    def speech_runs(probs: np.ndarray) -> list[tuple[int, int]]:
        short = policy.short_speech_threshold
        keep = lambda a, b: (b - a) * FRAME_SECONDS >= policy.min_speech_seconds  # noqa: E731
        return [(a, b) for a, b in runs(probs, policy) if keep(a, b) or probs[a:b].max() >= short]

    def frames_of(probs: np.ndarray) -> np.ndarray:
        mask = np.zeros(len(probs), bool)
        for a, b in speech_runs(probs):
            mask[a:b] = True
        return mask

    print("## level: speech frames found at a peak of L dBFS (16-bit), against the input's own")
    target, most = policy.detector_target_dbfs, policy.detector_max_gain_db
    print(f"   gain: target {target} dBFS, at most +{most} dB")
    levels = (-20, -30, -40, -50, -60, -70, -80)
    speech_items = [i for i in items if "snr None" in i["name"] or "demo" in i["name"]]
    own_frames = {
        item["name"]: frames_of(probs_of(item["audio"], gain=False)) for item in speech_items
    }
    for gain in (False, True):
        for level in levels:
            found = added = total = 0
            worst = (1.0, "")
            for item in speech_items:
                own = own_frames[item["name"]]
                at = frames_of(probs_of(as_16_bit(item["audio"], level), gain))
                n = min(len(own), len(at))
                hit = int((own[:n] & at[:n]).sum())
                found, total = found + hit, total + int(own.sum())
                added += int((at[:n] & ~own[:n]).sum())
                if own.sum():
                    worst = min(worst, (hit / own.sum(), item["name"]))
            print(
                f"  gain {'on ' if gain else 'off'} {level:4d} dBFS: "
                f"recall {found / max(total, 1):.3f} "
                f"(worst {worst[0]:.2f} {worst[1]}), added {added * FRAME_SECONDS:.1f} s "
                f"over {len(speech_items)} inputs"
            )
    rng = np.random.default_rng(2)
    quiet = {
        "digital silence 60 s": silence(60.0),
        "dithered silence 60 s (+-1 LSB)": (
            (rng.integers(0, 2, 60 * RATE) - rng.integers(0, 2, 60 * RATE)) / 32767
        ).astype(np.float32),
    }
    print("\n## level: non-speech, stretches called speech (gain off / on)")
    for name, audio in {**non_speech(), **quiet}.items():
        row = []
        for down in (0, 30, 50):
            x = (audio * 10 ** (-down / 20)).astype(np.float32)
            x = (np.round(x * 32767) / 32767).astype(np.float32)
            off, on = (speech_runs(probs_of(x, g)) for g in (False, True))
            seconds = lambda r: sum(b - a for a, b in r) * FRAME_SECONDS  # noqa: E731
            row.append(f"-{down} dB: {len(off)}/{len(on)} ({seconds(off):.1f}/{seconds(on):.1f} s)")
            if not np.abs(audio).max():
                break
        print(f"  {name:32s} " + "  ".join(row))

    # Speech after something loud: the gain keeps the loudest level held, and Silero's
    # state remembers a loud level for seconds, so speech far below a loud sound just
    # before it is missed unless its quiet section is heard again (speech.QuietSection).
    loud_talker = next(i["audio"] for i in items if i["name"] == "en paragraph speed 160 snr None")
    rate6 = 6 * RATE
    leads = {
        "chord": tone(6.0, (261.6, 329.6, 392.0, 523.3)),
        "music": non_speech()["music (chords, 250 ms notes)"][:rate6],
        "white noise": noise("white", rate6, 9),
        "a loud talker": loud_talker[:rate6],
    }
    floor = (0.001 * noise("white", 10 * 60 * RATE, 5)).astype(np.float32)  # -60 dBFS
    later = [i for i in speech_items if i["audio"] is not loud_talker]
    print("\n## level: speech after 6 s of something at -1 dBFS, then 1 s of silence (gap)")
    print("   or straight on over white noise at -60 dBFS (floor): speech frames found at its")
    print("   own level found again, and how late its first speech is found (p50 / max, s)")
    for name, lead in leads.items():
        for way in ("gap", "floor"):
            row = []
            for level in (-20, -35, -50):
                found = total = 0
                late = []
                for item in later:
                    speech = as_16_bit(item["audio"], level)
                    if way == "gap":
                        x = np.concatenate([as_16_bit(lead, -1), silence(1.0), speech])
                    else:
                        x = np.concatenate([as_16_bit(lead, -1), speech + floor[: len(speech)]])
                    own = own_frames[item["name"]]
                    at = frames_of(probs_of(x, gain=True))[-len(own) :]
                    found, total = found + int((own & at).sum()), total + int(own.sum())
                    if own.any():  # from 0.3 s before its first speech (the lead's own
                        start = max(int(np.argmax(own)) - 10, 0)  # speech may run on)
                        after = np.flatnonzero(at[start:])
                        first = start + int(after[0]) if len(after) else len(at)
                        late.append((first - int(np.argmax(own))) * FRAME_SECONDS)
                row.append(
                    f"{level}: {found / max(total, 1):.3f} "
                    f"({np.median(late):.2f} / {max(late):.2f})"
                )
            print(f"  {name:14s} {way:5s} " + "  ".join(row))
    print("\n## level: non-speech after 6 s of a loud talker: stretches called speech in it")
    for name, audio in non_speech().items():
        row = []
        for down in (0, 30, 50):
            x = as_16_bit(audio, -down + 20 * np.log10(max(float(np.abs(audio).max()), 1e-12)))
            x = np.concatenate([as_16_bit(loud_talker[:rate6], -1), silence(1.0), x])
            probs = probs_of(x, gain=True)[rate6 // FRAME_SAMPLES + 32 :]
            found = speech_runs(probs)
            seconds = sum(b - a for a, b in found) * FRAME_SECONDS
            row.append(f"-{down} dB: {len(found)} ({seconds:.1f} s)")
        print(f"  {name:32s} " + "  ".join(row))


# --- through the pipeline -----------------------------------------------------------------------


def normalised(text: str) -> str:
    """Lower-case words, punctuation dropped."""
    return " ".join("".join(c.lower() if c.isalnum() else " " for c in text).split())


def words_of(text: str) -> set[str]:
    return set(normalised(text).split())


class Judged(NamedTuple):
    """One final verdict of the real pipeline: the reading, the window, the verdict, and
    the attempts it was given (the judge is pure: it may be asked again)."""

    item: dict
    window: Window
    verdict: Judgement
    attempts: list[DecodedRow]


def transcribable(items: list[dict], tokenizer) -> list[dict]:
    """The readings a model can transcribe, in their order: English alone for an .en
    model. (A window's source indexes this list in decoded().)"""
    return [i for i in items if tokenizer.is_multilingual or i["lang"] == "en"]


def decoded(run: ModelRun, items: list[dict], policy: Policy, vad: bool, tmp: Path) -> list[Judged]:
    """Every final verdict on transcribable(items), through the real pipeline."""
    loaded = run.load()
    chosen = transcribable(items, loaded.tokenizer)
    paths = []
    for n, item in enumerate(chosen):
        paths.append(str(tmp / f"{n}.wav"))
        sf.write(paths[-1], item["audio"], RATE, subtype="FLOAT")
    seen: list[Judged] = []
    real = pipeline.judge

    def spy(window, attempts, *args, **kwargs):  # the judge is pure: watching it is safe
        verdict = real(window, attempts, *args, **kwargs)
        if verdict.final:
            seen.append(Judged(chosen[window.source], window, verdict, list(attempts)))
        return verdict

    pipeline.judge = spy
    try:
        t = pipeline.Transcriber(loaded, TranscribeOptions(vad=vad, policy=policy))
        t.run(paths, lambda r: None, print)
    finally:
        pipeline.judge = real
    return seen


def text_evidence(run: ModelRun, items: list[dict], tmp: Path) -> None:
    # Nothing dropped by the map, so that every segment's evidence is seen.
    policy = Policy(text_min_speech_seconds=0.0)
    print(f"\n## text ({run.label}, map on): speech under each segment")
    rows = []
    for item, window, verdict, _ in decoded(run, items, policy, True, tmp):
        known = words_of(item["reference"])
        for s in verdict.segments:
            a, b = s.start - window.start, s.end - window.start
            under = [window.speech_seconds_between(a - m, b + m) for m in (0.0, 0.25, 0.5, 1.0)]
            real = bool(words_of(s.text) & known)
            rows.append((under, real, s, item["name"], verdict.row.no_speech_prob))
    rows.sort(key=lambda r: r[0][0])
    print("  speech s under it at margin 0 / 0.25 / 0.5 / 1.0, real?, no-speech P, text")
    for under, real, s, name, nsp in rows:
        if not real or under[0] < 0.5:
            print(
                f"  {' / '.join(f'{u:.2f}' for u in under)} {'real' if real else 'INVENTED'} "
                f"nsp {nsp:.2f} {s.text.strip()[:50]!r} [{name}]"
            )
    for m, margin in enumerate((0.0, 0.25, 0.5, 1.0)):
        real_min = min((r[0][m] for r in rows if r[1]), default=float("nan"))
        print(f"  margin {margin}: least speech under a real segment {real_min:.2f} s")


def repeated_readings() -> list[dict]:
    """Speech that repeats itself, as people do: a sentence said four times, short words
    said three times running, a word list with every word twice; clean and in noise."""
    items = []
    for lang, voices in VOICES.items():
        for v, voice in enumerate(voices):
            for snr in (None, 10):
                sentence = SENTENCES[lang][-1]
                said = speak(sentence, voice)
                items.append(
                    {
                        "name": f"{voice} sentence x4 snr {snr}",
                        "lang": lang,
                        "audio": with_noise(
                            np.concatenate([silence(1.0), *[said, silence(1.0)] * 4]),
                            snr,
                            "white",
                            v + 11,
                        ),
                        "reference": " ".join([sentence] * 4),
                    }
                )
                short = SHORT.get(lang, WORDS[lang][:2])
                pieces = [silence(1.0)]
                for word in short:
                    pieces += [speak(word, voice), silence(0.3)] * 3 + [silence(1.0)]
                items.append(
                    {
                        "name": f"{voice} short words x3 snr {snr}",
                        "lang": lang,
                        "audio": with_noise(np.concatenate(pieces), snr, "brown", v + 13),
                        "reference": " ".join(w for w in short for _ in range(3)),
                    }
                )
                pieces = [silence(1.0)]
                for word in WORDS[lang]:
                    pieces += [speak(word, voice), silence(0.6)] * 2 + [silence(0.8)]
                items.append(
                    {
                        "name": f"{voice} words x2 snr {snr}",
                        "lang": lang,
                        "audio": with_noise(np.concatenate(pieces), snr, "white", v + 17),
                        "reference": " ".join(w for w in WORDS[lang] for _ in range(2)),
                    }
                )
    return items


def repeat_evidence(run: ModelRun, items: list[dict], tmp: Path) -> None:
    """Windows where every temperature failed: the attempt kept by judge.best against the
    one faster-whisper's rule keeps (best log-prob among the attempts that are not too
    repetitive), in words of the reference found and words invented."""
    from collections import Counter

    from whisper_cli.judge import is_repetitive, needs_fallback, row_text

    tokenizer, policy = run.load().tokenizer, Policy()
    seen = [
        (j.item, j.attempts, j.verdict)
        for j in decoded(run, items, policy, True, tmp)
        if not j.verdict.silent
    ]
    print(f"\n## repeats ({run.label}, map on): windows where every attempt failed")
    print("  kept by: judge.best / faster-whisper's rule; reference words found, words invented")
    totals = Counter()
    for item, attempts, verdict in seen:
        texts = [row_text(a, tokenizer) for a in attempts]
        if len(attempts) < 2 or not needs_fallback(attempts[-1], texts[-1], policy):
            continue
        fine = [a for a, t in zip(attempts, texts, strict=True) if not is_repetitive(a, t, policy)]
        theirs = max(fine or attempts, key=lambda a: a.avg_logprob)
        reference = Counter(normalised(item["reference"]).split())
        known = set(reference)
        figures = []
        # Ours as kept (the judge's segments); theirs as the attempt's whole text.
        ours = " ".join(segment.text for segment in verdict.segments)
        for row, text in ((verdict.row, ours), (theirs, row_text(theirs, tokenizer))):
            said = Counter(normalised(text).split())
            found = sum((said & reference).values())
            invented = sum(n for w, n in said.items() if w not in known)
            figures.append((found, invented, row.avg_logprob))
        totals["windows"] += 1
        totals["changed"] += verdict.row is not theirs
        for k, (found, invented, _) in zip(("ours", "theirs"), figures, strict=True):
            totals[f"{k} found"] += found
            totals[f"{k} invented"] += invented
        (f1, i1, l1), (f2, i2, l2) = figures
        mark = "same" if verdict.row is theirs else "CHANGED"
        print(
            f"  {mark}: found {f1} / {f2}, invented {i1} / {i2}, log-prob {l1:.2f} / {l2:.2f}"
            f" of {sum(reference.values())} words [{item['name']}]"
        )
    print(
        f"  {totals['windows']} windows, {totals['changed']} changed; found "
        f"{totals['ours found']} / {totals['theirs found']}, invented "
        f"{totals['ours invented']} / {totals['theirs invented']}"
    )


def tolerance_evidence(run: ModelRun, items: list[dict], tmp: Path) -> None:
    """What policy.repeat_max_changed_share takes: every window of `items` decoded once
    (map on), its final attempt judged again at each share (the judge is pure), and per
    share the reference words found and the words past the reference's counts (invented
    or repeated once too often), with each segment that a share drops and word-for-word
    matching (share 0) keeps."""
    from collections import Counter
    from dataclasses import replace

    tokenizer, policy = run.load().tokenizer, Policy()
    seen = decoded(run, items, policy, True, tmp)
    chosen = transcribable(items, tokenizer)
    minutes = sum(len(i["audio"]) for i in chosen) / RATE / 60
    print(f"\n## repeat tolerance ({run.label}, map on; {len(chosen)} inputs, {minutes:.1f} min)")
    print("   per repeat_max_changed_share: reference words found, words past the reference")
    references = [Counter(normalised(i["reference"]).split()) for i in chosen]
    for share in (0.0, 0.1, 0.2, 0.3):
        said = [Counter() for _ in chosen]
        notes = []
        for _, window, _, attempts in seen:
            verdicts = [
                judge(window, attempts, replace(policy, repeat_max_changed_share=s), tokenizer)
                for s in (0.0, share)
            ]
            for segment in verdicts[1].segments:
                said[window.source].update(normalised(segment.text).split())
            kept = {(s.start, s.text) for s in verdicts[1].segments}
            for segment in verdicts[0].segments:
                if (segment.start, segment.text) not in kept:
                    name = chosen[window.source]["name"]
                    notes.append(f"{segment.start:.2f} s {segment.text!r} [{name}]")
        found = sum(sum((s & r).values()) for s, r in zip(said, references, strict=True))
        past = sum(sum((s - r).values()) for s, r in zip(said, references, strict=True))
        total = sum(sum(r.values()) for r in references)
        print(f"  share {share:.1f}: found {found} of {total}, past the reference {past}")
        for note in notes:
            print(f"    dropped beside share 0: {note}")


def end_evidence(run: ModelRun, items: list[dict], tmp: Path) -> None:
    # Map off and no hold: where does the model end by itself?
    policy = Policy(min_speech_seconds=1e6)
    print(f"\n## ends ({run.label}, map off, no hold): speech running on after the")
    print("   last timestamp of windows whose words are all there")
    left = []
    for item, window, verdict, _ in decoded(run, items, policy, False, tmp):
        if not verdict.segments:
            continue
        got = words_of(" ".join(s.text for s in verdict.segments))
        if not words_of(item["reference"]) <= got | {"a", "the"}:
            continue  # incomplete: that is what the hold is for
        end = verdict.segments[-1].end - window.start
        frame = int(np.ceil(end / FRAME_SECONDS))
        run = 0
        while frame + run < len(window.speech) and window.speech[frame + run]:
            run += 1
        left.append((run * FRAME_SECONDS, item["name"]))
    for seconds, name in sorted(left, reverse=True)[:12]:
        print(f"  {seconds:.2f} s [{name}]")
    values = np.array([s for s, _ in left])
    if len(values):
        print(
            f"  n {len(values)} p50 {np.percentile(values, 50):.2f} p95 "
            f"{np.percentile(values, 95):.2f} max {values.max():.2f}"
        )


def span_evidence(run: ModelRun, items: list[dict], tmp: Path) -> None:
    """What the no-skip rule may allow, measured with it off; then the words with it on."""
    off = Policy(segment_speech_seconds=1e6, gap_speech_seconds=1e6)
    print(f"\n## spans ({run.label}, map on, no-skip rule off): speech under segments")
    per_token, gaps, recall = [], [], {}
    for item, window, verdict, _ in decoded(run, items, off, True, tmp):
        known = words_of(item["reference"])
        previous_end = None
        for s in verdict.segments:
            a, b = s.start - window.start, s.end - window.start
            if words_of(s.text) & known:
                under = window.speech_seconds_between(a, b)
                per_token.append((under, len(s.tokens), s.text.strip()[:50], item["name"]))
            if previous_end is not None:
                gaps.append((window.speech_seconds_between(previous_end, a), item["name"]))
            previous_end = b
    for per in (0.5, 1.0):
        worst = sorted(per_token, key=lambda r: r[0] - per * r[1], reverse=True)[:5]
        print(f"  speech under a real segment less {per} s a text token, the largest:")
        for under, n, text, name in worst:
            print(f"    {under - per * n:+.2f} s ({under:.2f} s, {n} tokens) {text!r} [{name}]")
    rates = np.array([u / n for u, n, _, _ in per_token if n])
    print(f"  s of speech per token: p50 {np.median(rates):.2f} p99 {np.percentile(rates, 99):.2f}")
    print(f"  speech in a gap between segments: max {max((g for g, _ in gaps), default=0):.2f} s")
    for g, name in sorted(gaps, reverse=True)[:5]:
        print(f"    {g:.2f} s [{name}]")
    for label, policy in (("off", off), ("on", Policy())):
        found = {}
        for item, _, verdict, _ in decoded(run, items, policy, True, tmp):
            got = found.setdefault(item["name"], set())
            got |= words_of(" ".join(s.text for s in verdict.segments)) & words_of(
                item["reference"]
            )
        recall[label] = found
    lost = [
        (name, sorted(recall["off"][name] - recall["on"].get(name, set())))
        for name in recall["off"]
        if recall["off"][name] - recall["on"].get(name, set())
    ]
    gained = sum(len(recall["on"][n] - recall["off"].get(n, set())) for n in recall["on"])
    print(f"  rule on vs off: reference words gained {gained}, lost in {len(lost)} inputs")
    for name, words in lost:
        print(f"    lost {words} [{name}]")


def real_onsets(run: ModelRun, detector, tmp: Path) -> None:
    """Detector onset minus the first word's start (word timing, map off) after silence."""
    shared = REPO.parent / "shared" / "audio"
    clips = [load_audio(shared / n) for n in ("jfk.flac", "hotwords.mp3")]
    stereo = shared / "stereo_diarization.wav"
    clips += [load_audio(stereo, "left"), load_audio(stereo, "right")]
    inputs = []
    for n, clip in enumerate(clips):
        for name, audio in (
            ("-20 dB", clip * 0.1),
            ("white 10 dB", with_noise(clip, 10, "white", n)),
            ("brown 5 dB", with_noise(clip, 5, "brown", n)),
        ):
            inputs.append((f"clip {n} {name}", np.concatenate([silence(3.0), audio, silence(1)])))
    if (DEMO / "sample.wav").exists():
        inputs.append(("demo sample", load_audio(DEMO / "sample.wav")))
    loaded = run.load()
    t = pipeline.Transcriber(loaded, TranscribeOptions(vad=False, word_timestamps=True))
    policy = Policy()
    print(f"\n## onsets of real speech ({run.label} word timing, map off)")
    lags = []
    for name, audio in inputs:
        path = tmp / "onset.wav"
        sf.write(path, audio, RATE, subtype="FLOAT")
        words = [w for s in t.transcribe(str(path)).segments for w in s.words]
        found = runs(speech_map(audio, detector), policy)
        previous_end = -10.0
        for w in words:
            if w.start - previous_end >= 1.0:  # a word after a pause
                after = [a * FRAME_SECONDS for a, _ in found if a * FRAME_SECONDS >= w.start - 1]
                if after and after[0] < w.end:
                    lags.append(after[0] - w.start)
                    print(
                        f"  {after[0] - w.start:+.3f} {w.word.strip()!r} at {w.start:.2f} [{name}]"
                    )
            previous_end = w.end
    v = np.array(lags)
    print(
        f"  n {len(v)} p50 {np.median(v):+.3f} p95 {np.percentile(v, 95):+.3f} max {v.max():+.3f}"
    )


def long_readings() -> list[dict]:
    """Readings longer than a window with no pause long enough to end the stretch (0.2-1.2
    s between sentences), so that windows are cut inside speech: every sentence and the
    paragraph of a language, twice over, at a normal and a brisk pace, clean and in noise."""
    rng = np.random.default_rng(1)
    items = []
    for lang, voices in VOICES.items():
        texts = (SENTENCES[lang] + [PARAGRAPHS[lang]]) * 2
        for v, voice in enumerate(voices):
            for speed in (160, 190):
                pieces = [silence(1.0)]
                for text in texts:
                    pieces += [speak(text, voice, speed), silence(float(rng.uniform(0.2, 1.2)))]
                audio = np.concatenate(pieces)
                for snr in (None, 10):
                    items.append(
                        {
                            "name": f"{voice} reading speed {speed} snr {snr}",
                            "lang": lang,
                            "audio": with_noise(audio, snr, "white", v + 11),
                            "reference": " ".join(texts),
                        }
                    )
    return items


def doubled_readings() -> list[dict]:
    """Every sentence, the paragraph and the word list of a language said twice running
    (0.2-1.0 s apart), at a normal and a brisk pace, clean and in noise: speech that
    repeats itself across a window, where a loop and the speech look alike to the gzip
    ratio."""
    rng = np.random.default_rng(7)
    items = []
    for lang, voices in VOICES.items():
        texts = [*SENTENCES[lang], PARAGRAPHS[lang], " ".join(WORDS[lang])]
        for v, voice in enumerate(voices):
            for speed in (150, 185):
                pieces, said = [silence(1.0)], []
                for text in texts:
                    audio = speak(text, voice, speed)
                    for _ in range(2):
                        pieces += [audio, silence(float(rng.uniform(0.2, 1.0)))]
                        said.append(text)
                for snr in (None, 10):
                    items.append(
                        {
                            "name": f"{voice} doubled {speed} snr {snr}",
                            "lang": lang,
                            "audio": with_noise(np.concatenate(pieces), snr, "white", v + 5),
                            "reference": " ".join(said),
                        }
                    )
    return items


def transcribe_in_order(loaded, paths: list[str], lang: str, policy: Policy) -> list:
    """The transcripts of `paths` (one language), in the order given: they come as their
    inputs finish (a short reading before a longer one begun earlier)."""
    results = []
    t = pipeline.Transcriber(loaded, TranscribeOptions(language=lang, policy=policy))
    t.run(paths, results.append, print)
    by_path = {result.path: result for result in results}
    return [by_path[path] for path in paths]


def readings_on_disk(
    run: ModelRun, items: list[dict], tmp: Path, question: str, by: str
) -> tuple[object, list[dict], list[str]]:
    """The model loaded (in the run's mode), the readings it can transcribe (English alone
    for an .en model) written under `tmp`, and the heading of `question`'s table, by `by`."""
    loaded = run.load()
    items = transcribable(items, loaded.tokenizer)
    minutes = sum(len(i["audio"]) for i in items) / RATE / 60
    print(f"\n## {question} ({run.label}, map on; {len(items)} readings, {minutes:.1f} min):")
    print(f"   reference words deleted / inserted, by {by}")
    paths = []
    for n, item in enumerate(items):
        paths.append(str(tmp / f"{question}{n}.wav"))
        sf.write(paths[-1], item["audio"], RATE, subtype="FLOAT")
    return loaded, items, paths


def draw_evidence(run: ModelRun, tmp: Path, minimums: tuple[int, ...] = (1, 2, 3, 99)) -> None:
    """Words lost and added, against each reading's reference, with each
    repeat_min_attempts (99: never, faster-whisper's rule: a draw that passes is kept),
    over the long readings and the doubled ones (map on)."""
    import jiwer

    items = long_readings() + doubled_readings()
    loaded, items, paths = readings_on_disk(run, items, tmp, "draws", "repeat_min_attempts")
    for minimum in minimums:
        policy = Policy(repeat_min_attempts=minimum)
        deleted = inserted = words = 0
        for lang in sorted({i["lang"] for i in items}):
            chosen = [n for n, i in enumerate(items) if i["lang"] == lang]
            results = transcribe_in_order(loaded, [paths[n] for n in chosen], lang, policy)
            for n, result in zip(chosen, results, strict=True):
                ref = normalised(items[n]["reference"])
                out = jiwer.process_words(ref, normalised(result.text))
                deleted, inserted = deleted + out.deletions, inserted + out.insertions
                words += len(ref.split())
        print(f"  at least {minimum}: deleted {deleted}, inserted {inserted} of {words} words")


def cut_evidence(
    run: ModelRun, tmp: Path, slacks: tuple[float, ...] = (0.5, 0.35, 0.25, 0.15, 0.0)
) -> None:
    """Words lost and added, against each reading's reference, with each slack for a
    window whose last stretch its end cut off (map on)."""
    import jiwer

    items = long_readings()
    loaded, items, paths = readings_on_disk(run, items, tmp, "cuts", "cut_end_slack_seconds")
    real = pipeline.judge
    cut_off: set[tuple[int, int]] = set()
    silent: list[str] = []  # windows judged silent: with the map on, each holds speech

    def spy(window, attempts, *args, **kwargs):  # the judge is pure: watching it is safe
        if window.cut_off:
            cut_off.add((window.source, window.index))
        verdict = real(window, attempts, *args, **kwargs)
        if verdict.silent:
            silent.append(f"{window.speech_seconds:.1f} s of speech, {len(attempts)} attempts")
        return verdict

    for slack in slacks:
        policy = Policy(cut_end_slack_seconds=slack)
        deleted = inserted = words = 0
        notes = []
        for lang in sorted({i["lang"] for i in items}):
            chosen = [n for n, i in enumerate(items) if i["lang"] == lang]
            pipeline.judge = spy
            try:
                results = transcribe_in_order(loaded, [paths[n] for n in chosen], lang, policy)
            finally:
                pipeline.judge = real
            for n, result in zip(chosen, results, strict=True):
                ref, hyp = normalised(items[n]["reference"]), normalised(result.text)
                out = jiwer.process_words(ref, hyp)
                deleted += out.deletions
                inserted += out.insertions
                words += len(ref.split())
                rw, hw = ref.split(), hyp.split()
                for a in out.alignments[0]:
                    if a.type == "delete":
                        notes.append(f"- {' '.join(rw[a.ref_start_idx : a.ref_end_idx])!r}")
                    elif a.type == "insert":
                        notes.append(f"+ {' '.join(hw[a.hyp_start_idx : a.hyp_end_idx])!r}")
                    else:
                        continue
                    before = " ".join(rw[max(0, a.ref_start_idx - 4) : a.ref_start_idx])
                    notes[-1] += f" after {before!r} [{items[n]['name']}]"
        print(
            f"  slack {slack:.2f}: deleted {deleted}, inserted {inserted} of {words} words "
            f"({len(cut_off)} windows cut off)"
        )
        for note in notes:
            print(f"    {note}")
        print(f"    windows judged silent: {silent or 'none'}")
        silent.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none")
    parser.add_argument(
        "--only",
        choices=[
            "detector",
            "level",
            "text",
            "ends",
            "spans",
            "cuts",
            "draws",
            "repeats",
            "tolerance",
        ],
        default=None,
    )
    args = parser.parse_args()
    detector = load_detector()
    items = corpus() if args.only not in ("cuts", "draws") else []
    if items:
        print(f"{len(items)} inputs, {sum(len(i['audio']) for i in items) / RATE / 60:.1f} min\n")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "detector"):
            onsets_and_short(items, detector, Policy())
            base = ModelRun(str(REPO / "models" / "base"), args.dtype, args.quantize)
            real_onsets(base, detector, Path(tmp))
        if args.only in (None, "level"):
            level_evidence(items, detector, Policy())
        models = [] if args.only == "level" else args.model or [str(REPO / "models" / "tiny.en")]
        for run in (ModelRun(m, args.dtype, args.quantize) for m in models):
            if args.only in (None, "text"):
                text_evidence(run, items, Path(tmp))
            if args.only in (None, "ends"):
                end_evidence(run, items, Path(tmp))
            if args.only in (None, "spans"):
                span_evidence(run, items, Path(tmp))
            if args.only in (None, "cuts"):
                cut_evidence(run, Path(tmp))
            if args.only in (None, "draws"):
                draw_evidence(run, Path(tmp))
            if args.only in (None, "repeats"):
                heard = repeated_readings() + [
                    {"name": name, "lang": "en", "audio": audio, "reference": ""}
                    for name, audio in non_speech().items()
                ]
                repeat_evidence(run, items + heard, Path(tmp))
            if args.only in (None, "tolerance"):
                heard = repeated_readings() + long_readings() + doubled_readings()
                tolerance_evidence(run, items + heard, Path(tmp))


if __name__ == "__main__":
    main()
