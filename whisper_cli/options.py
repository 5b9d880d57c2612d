"""Transcription options, the policy (every threshold of a run, with its provenance) and
the defaults a run takes when the user names none (the model per device, compile auto).

Values marked "Silero", "openai-whisper" or "faster-whisper" are those projects' own
defaults, kept because users compare with them and because they were tuned on far more
audio than we hold. Values of our own say what they were measured on; none was fitted to
the clips the tests assert on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import SubtitleOptions

TASKS = ("transcribe", "translate")  # translate: into English

# The most tokens a window decodes: half the decoder's text context (448 positions), as
# openai-whisper does (its sample_len); the other half holds the prompt.
MAX_NEW_TOKENS = 224


def default_model(device_type: str) -> str:
    """The model of a run that names none: turbo on CUDA, base otherwise.

    Asked where a model is loaded (loading.load_model, for the device it loads on), and
    by bench, which names the model of each child before the child starts.
    """
    return "turbo" if device_type == "cuda" else "base"


COMPILE_CHOICES = ("auto", "on", "off")


def check_compile(choice: str) -> None:
    """`--compile`'s value is one of COMPILE_CHOICES (a usage error otherwise)."""
    if choice not in COMPILE_CHOICES:
        raise WhisperCliError(f"invalid --compile {choice!r}; choose auto, on or off")


def use_compile(choice: str, device_type: str) -> bool:
    """`--compile auto|on|off` on a device: auto compiles the decode step on CUDA only."""
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def silero_neg_threshold(vad_threshold: float) -> float:
    """Where speech ends for a start threshold, by Silero's rule (get_speech_timestamps)."""
    return max(vad_threshold - 0.15, 0.01)


@dataclass(frozen=True)
class Policy:
    """Every threshold of a transcription (library: `TranscribeOptions(policy=Policy(...))`)."""

    # --- the speech map (Silero VAD 6.2, 32 ms frames) --------------------------------------
    # A frame starts speech at P >= vad_threshold and speech goes on while P stays at or
    # above vad_neg_threshold (hysteresis). Silero's defaults: 0.5, and for the second
    # its own rule, silero_neg_threshold(vad_threshold), which None (the default) takes.
    # dataclasses.replace keeps a derived value: give None with a new vad_threshold.
    vad_threshold: float = 0.5
    vad_neg_threshold: float | None = None
    # The detector hears a quiet input brought up to this peak level (dBFS), by at most
    # detector_max_gain_db (speech.LevelGain; None: as it is). Silero's scores fall with
    # the level while Whisper still hears the words. scripts/calibrate_speech.py --only
    # level (eSpeak, 4 languages, 5 voices, and the demo sample, each stored as 16-bit at
    # a peak of L dBFS; the speech frames found at its own level found again): without a
    # gain 0.98 of them at -30, 0.85 at -40, 0.45 at -50, 0.08 at -60, none at -70; with
    # this one 0.990, 0.991, 0.985, 0.971 and 0.890. The onsets of the inputs at their
    # own level (419): at most 0.10 s late, as without a gain. Of its non-speech (clicks,
    # knocks, bursts, beeps, music, hum, noise; at their level, 30 and 50 dB down) and
    # 16-bit silence, dithered or not, only the music 30 dB down made a stretch of speech
    # (0.2 s). A target of -30 made none, but jfk.flac stored at -55 and -60 dBFS lost
    # its soft first word ("And"), recall at -60 was 0.95, and the demo sample's first
    # "Hello?" was heard 0.03 s late, as 0.09 s of speech. +60 dB found less at -70 and
    # -80 (16-bit steps, lifted, mask the speech). A gain looking 2 s ahead (the room
    # before a first word scored at the speech's gain) heard that "Hello?" late at -20
    # too, and lost jfk's "And" at -30.
    detector_target_dbfs: float | None = -20.0
    detector_max_gain_db: float = 50.0
    # A quiet section (speech.QuietSection: the input quiet_drop_db or more below its
    # loudest level for quiet_hold_seconds, from a sound quiet_room_db over the room) is
    # heard again from a fresh detector state at its own gain, and what that hearing calls
    # speech for min_speech_seconds running is added to the map (None: not heard again).
    # scripts/calibrate_speech.py --only level (eSpeak and the demo sample, after 6 s of a
    # chord, music, noise or a loud talker at -1 dBFS; speech frames found at its own
    # level found again): after 1 s of silence, speech at -35 dBFS 0.96-0.97 (without:
    # 0.79-0.92) and at -50 0.95-0.96 (0.04-0.41), its first speech found at most 3.4 s
    # late (31 s); straight on over a -60 dBFS floor, at -35 0.93-0.97 (0.03-0.36; at -50,
    # under the floor's peaks, none but 0.40 after the talker). The level rows, the 419
    # onsets and every non-speech row the same as without it, and no stretch of speech in
    # non-speech after a loud talker. 15 dB gave the same; 25 dB lost speech at -20
    # straight after a chord or music (0.88-0.89, from 0.96-0.97); a hold of 0.5 s about
    # the same as 1 s.
    quiet_drop_db: float | None = 20.0
    quiet_hold_seconds: float = 1.0
    quiet_room_db: float = 10.0
    # Speech shorter than this is a click or a breath, not a word: Silero's default
    # min_speech_duration_ms (250) ...
    min_speech_seconds: float = 0.25
    # ... unless it scores at least this somewhere: a short word said clearly ("yes", a
    # name) is speech however short. scripts/calibrate_speech.py: short words (eSpeak's
    # yes/no/hi/stop/two/oui/non/ja/nein, 5 voices, 0 and -20 dB) peak at 0.98-1.0; of
    # clicks, knocks, 50-200 ms noise bursts, beeps, music, hum and noise, only music made
    # a short stretch, peaking at 0.62.
    short_speech_threshold: float = 0.8
    # Pauses shorter than this stay inside the audio Whisper sees (it was trained on
    # natural pauses); longer ones are cut out, leaving the lead and tail below.
    # faster-whisper's VadOptions default (2000 ms).
    min_silence_seconds: float = 2.0
    # Audio kept before each stretch of speech: the detector's onset lags the first
    # sound of a soft consonant. scripts/calibrate_speech.py: by at most 0.10 s over
    # eSpeak's 418 onsets (5 voices, 4 languages, 0 and -20 dB, in noise) and the demo
    # sample's (0.10 s against its reference times), with the detector's gain (above)
    # as without it; word timing with the map off dates a first word after silence
    # 0.4-1.1 s before the detector's onset, but that is word timing stretching the
    # word over the silence. Longer is not free: Whisper dates a
    # window's first segment at the window's start when it opens on silence (eSpeak's
    # "And so it begins" after 5 s of silence: 0.97 s early with a 1 s lead). 0.6 s is
    # six times the measured lag, and bounds that error.
    speech_lead_seconds: float = 0.6
    # Audio kept after each stretch: faster-whisper's speech_pad_ms default (400).
    speech_tail_seconds: float = 0.4
    # A stretch of speech longer than a window is cut at its least speech-like frame in
    # the last this-many seconds before the 30 s limit (a pause between words or phrases).
    cut_search_seconds: float = 6.0
    # Text over non-speech (judge.py): a segment is dropped only when less than
    # text_min_speech_seconds of speech frames lie under it, widened by
    # text_speech_margin_seconds either side (the decoder's timestamps are that far off),
    # and the decoder doubts it too. scripts/calibrate_speech.py (eSpeak word lists,
    # sentences and short words in 4 languages, 0 and -20 dB, clean and in noise, and the
    # demo sample; 36 min): real segments held as little as 0.00 s of speech within
    # their own span (base dated "Thunder" in noise 0.3 s off), 0.13 s within 0.5 s of
    # it, and 0.29 s within 1 s (tiny.en and base alike). So: 1 s, and under 0.1 s.
    text_min_speech_seconds: float = 0.1
    text_speech_margin_seconds: float = 1.0
    # The no-end rule: a decode may not end while at least min_speech_seconds of speech
    # lie after its latest timestamp, not counting the first end_slack_seconds of a
    # stretch that runs on through it (the model dates an utterance's end early; held
    # open for the rest of what it has just written, it writes that again).
    # scripts/calibrate_speech.py, map off and no hold: in windows whose words were all
    # there, speech ran on after the last timestamp by up to 0.48 s (tiny.en, 30
    # windows) and 0.42 s (base, 27). A longer slack loses words: at 1 s tiny.en ended
    # the long-form test's licence before "notice shall"; at 0.5 s the demo sample's
    # last utterance, dated 0.99 s early by tiny.en with the map off, is written twice
    # (a duplicate is the lesser fault). Speech after a pause always counts.
    end_slack_seconds: float = 0.5
    # ... where the text written so far ends a sentence (its last text token ends in ".",
    # "?", "!" or another script's full stop, tokenizer.SENTENCE_MARKS): an utterance the
    # model takes for finished. Text that stops mid-sentence ("... behind the curtain" with
    # "on the left" still running) is not an utterance's end dated early, and gets
    # open_end_slack_seconds. scripts/calibrate_speech.py ends (the corpus above, map off
    # and no hold), the last text of each window: of those that end a sentence (tiny.en
    # 47, base 83), 11 had speech running on after them by more than 0.3 s (up to 2.0 s),
    # 5 of them with every word there and 2 more with their last sentence whole (base:
    # "... called him back." and "... auf dem Tisch.", 0.74 s each); of those that do not
    # (tiny.en 31, base 56), every one with speech running on past 0.1 s had left words
    # out at its end (base: a word list's last word at 0.32 and 0.42 s, paragraphs cut
    # short at 1.9 and 4.7 s). Measured loss without it: base on 10 min of the shared
    # clips in another order, a window ended "... behind the curtain" with "on the left"
    # (0.72 s of speech) unwritten and no other window holding it. So: no slack.
    open_end_slack_seconds: float = 0.0
    # ... and of a window's last stretch where the window's end cut it off (a stretch too
    # long for one window, cut at a short pause, or the input's end: windows.Window.cut_off).
    # There the model leaves words out (it learnt to omit an utterance that runs past its
    # window) more than it dates them early, and no other window holds them: on the
    # long-form benchmark's input tiny.en ended a window cut 40 ms after "on the left"
    # before those words, 0.7 s of speech (test_no_word_lost). scripts/calibrate_speech.py
    # cuts (eSpeak readings of 50-60 s, pauses of 0.2-1.2 s, 3 English voices, 2 paces,
    # clean and in noise; 14 windows cut off): tiny.en wrote the same words at every slack
    # from 0.5 down to 0.15, base the same at 0.5 and 0.15; tiny.en at 0 wrote one word
    # more before a cut, and an invented "Thank you." before another. So 0.15: the least
    # measured that invented nothing.
    cut_end_slack_seconds: float = 0.15
    # The no-skip rule: a segment of n text tokens may not close past more than
    # segment_speech_seconds + n * segment_speech_per_token_seconds of speech, nor the next
    # one open past more than gap_speech_seconds of it: speech a timestamp passes over is
    # never written (unbounded, tiny.en closes a 7-token sentence at its window's end and
    # skips the 22 s of speech after it).
    # scripts/calibrate_speech.py (spans, rule off; eSpeak word lists, sentences and
    # paragraphs at a normal and a slow pace in English, French, German and Spanish, 7
    # voices, clean, -20 dB and in noise, and the demo sample; tiny.en on the English
    # ones, base on all): a real segment held 0.26-0.29 s of speech a text token at the
    # median and 0.61 s at the 99th percentile, never over 1 s a token (the largest, a
    # lone word at -20 dB: 0.93 s); a gap between two segments held at most 0.86 s (base,
    # German at -20 dB). The limits below are about twice the first, 1.7 times the last;
    # with them the rule changed no reference word found there, for either model.
    segment_speech_seconds: float = 2.0
    segment_speech_per_token_seconds: float = 1.0
    gap_speech_seconds: float = 1.5
    # The language of an input is detected from its probabilities pooled over up to this
    # much speech at its start (openai-whisper detects on the first 30 s).
    language_seconds: float = 30.0

    # --- decoding guards: openai-whisper's defaults -------------------------------------------
    # A window is "no speech" when P(no speech) > no_speech_threshold and its average
    # log-prob < logprob_threshold; it gives no text and never falls back.
    no_speech_threshold: float = 0.6
    logprob_threshold: float = -1.0
    # A window's text compressing above this (gzip) is repetitive: it falls back.
    compression_ratio_threshold: float = 2.4
    # A segment that repeats an earlier segment of its window word for word (or consecutive
    # ones: base with int8 weights split the sentence it then repeated into 9 s and 2 s) is
    # dropped when its span is under this fraction of the speech under them (the map's;
    # their spans with --no-vad): the same words said in a third of the time are the
    # decoder counting one repeat too many, not speech. (Their spans hold pauses: base
    # dated "on the left." over 3.4 s for 0.8 s of speech, and the same words said again
    # in 1.0 s were lost.)
    # Measured: base wrote jfk's 22-word sentence once more in the 0.58 s left of a window
    # after saying it in 11 s (0.05), and a sixth wizard sentence into the last 1.0 s of
    # five said 5 s apart (0.2); eSpeak's repeats (calibrate_speech.py --only repeats),
    # each said at one pace, keep the fraction near 1. A third leaves people who repeat
    # themselves twice as fast.
    repeat_min_span_fraction: float = 1 / 3
    # A repeat (the rule above) may differ from the words it repeats in this share of its
    # own words, rounded down (changed, added or left out): base with int8 weights, held
    # to AVX2, wrote jfk's sentence a third time in the 0.58 s left of a window, "asked
    # not" for "ask not" (compare_cpu's 10 min: 22 words invented). Under 10 words a
    # repeat must be word for word: there one word changed is as likely other words
    # ("No, no." then "No, you."). The time is the evidence; the words only say what is
    # repeated. scripts/calibrate_speech.py --only tolerance (its corpus, the repeated,
    # long and doubled readings, map on; reference words found, words past the
    # reference's counts, at shares 0 / 0.1 / 0.2): base f32 6843 / 6843 / 6842 found of
    # 10931, 4044 / 4033 / 4023 past (0.1 dropped one garbled French segment, 11 words
    # all past the reading's counts); tiny.en f32 the same at every share (4654 of 5607).
    # With int8 weights held to AVX2: base 6910 / 6910 / 6909 found, 4052 / 4052 / 4045
    # past (0.2 dropped a German line said twice); tiny.en the same at every share. bf16 +
    # int8 natively (Intel Xeon with AMX): both models the same at every share (tiny.en
    # 4637, base 6822 found). So a tenth: no reference word lost in any of the six, where
    # a fifth lost one in two.
    repeat_max_changed_share: float = 0.1
    # The same rule across a cut inside speech (judge.echoed_words): the words that end a
    # window's last segment and begin the next window's text are dropped from the first
    # when they lie over under repeat_min_span_fraction of the speech they take in the
    # second, and they are at least this many words. One word said on both sides of a
    # pause ("no. | No,") is as likely said twice, and a window's last word is the one
    # word timing places least well (it runs into the window's end).
    echo_min_words: int = 2
    # A window whose attempts repeat what was heard (judge.repeats_speech: confident, ended
    # by themselves, speech under every piece) and fail on their gzip ratio alone, until a
    # later draw passes: where at least this many attempts repeated so, the draw stands
    # against them on its log-prob (judge.best) instead of being kept outright. Speech
    # that repeats itself repeats at every temperature until a draw leaves part of it out:
    # tiny.en in bf16 + int8 held to AVX2 kept a T=1.0 draw that left 37 of a window's 71
    # words out (compare_cpu's 10 min). scripts/calibrate_speech.py --only draws (the long
    # readings and the same texts said twice running, clean and at 10 dB SNR, map on),
    # reference words deleted / inserted at 1, 2, 3 and never (faster-whisper's rule):
    # base f32 295 / 426, 308 / 425, 346 / 421, 362 / 421 of 7824; tiny.en f32 26 / 132,
    # then 26 / 135 at every other. tiny.en bf16 + int8 (natively, /tmp/s61 runs of the
    # same readings) 30 / 140 at 1 against 31 / 137 never: the one attempt that looped
    # over speech ("the web-a-turned code" once more than said, then the words at T=0.2)
    # cost 9 words invented. So 1: the fewest words lost, for about as many invented.
    # The same question in that mode held to AVX2 (--dtype bf16 --quantize int8): 31 / 133
    # of 3984 at every count, these readings not reaching the case.
    repeat_min_attempts: int = 1
    # Temperatures tried in turn on a window that fails the checks above (or loops).
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    seed: int = 0  # sampling at temperature > 0 is seeded: the same run gives the same text

    # --- the repetition guard (on the device, during the decode) -------------------------------
    # Every loop_check_every steps, a row whose last max(min_loop_span, 3 * period) tokens
    # repeat with a period up to max_loop_period is stopped (and falls back). A loop of 32
    # tokens is longer than any run of one word or phrase in speech.
    loop_check_every: int = 8
    max_loop_period: int = 16
    min_loop_span: int = 32

    def __post_init__(self) -> None:
        if self.vad_neg_threshold is None:
            neg = silero_neg_threshold(self.vad_threshold)
            object.__setattr__(self, "vad_neg_threshold", neg)
        if not 0.0 < self.vad_neg_threshold <= self.vad_threshold < 1.0:
            raise ValueError("need 0 < vad_neg_threshold <= vad_threshold < 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be a non-empty list of values >= 0")
        for name in (
            "min_speech_seconds",
            "min_silence_seconds",
            "speech_lead_seconds",
            "speech_tail_seconds",
            "text_min_speech_seconds",
            "text_speech_margin_seconds",
            "end_slack_seconds",
            "open_end_slack_seconds",
            "cut_end_slack_seconds",
            "segment_speech_seconds",
            "segment_speech_per_token_seconds",
            "gap_speech_seconds",
            "repeat_min_span_fraction",
            "detector_max_gain_db",
            "quiet_hold_seconds",
            "quiet_room_db",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 <= self.repeat_max_changed_share < 1.0:
            raise ValueError("repeat_max_changed_share must be in [0, 1)")
        if self.echo_min_words < 1:
            raise ValueError("echo_min_words must be >= 1")
        if self.repeat_min_attempts < 1:
            raise ValueError("repeat_min_attempts must be >= 1")
        if self.quiet_drop_db is not None and self.quiet_drop_db <= 0:
            raise ValueError("quiet_drop_db must be > 0 (or None)")


# The latency bound of a run with live input (a pipe on stdin) that sets none: the text of
# an utterance is due this long after its first speech was read (plus a decode). Shorter
# bounds cut shorter windows, which give the model less context; see the README's
# streaming section for the figures behind the value.
LIVE_LATENCY_SECONDS = 3.0


def run_latency(latency: float | None, live: bool) -> float | None:
    """The latency bound of a run: as given (inf: none), else LIVE_LATENCY_SECONDS when
    an input is live (files are read faster than real time: no bound)."""
    if latency is None:
        return LIVE_LATENCY_SECONDS if live else None
    return None if latency == float("inf") else latency


def parse_latency(text: str) -> float | None:
    """`--latency auto|off|SECONDS` as TranscribeOptions.latency (a usage error if invalid)."""
    choice = text.strip().lower()
    if choice == "auto":
        return None
    if choice == "off":
        return float("inf")
    try:
        seconds = float(choice)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise WhisperCliError(f"invalid --latency {text!r}: auto, off or seconds >= 0")
    return seconds


# With refill, a run holds this many batches of windows: more rows refilled per batch that
# drains at a run's end, against a longer wait before the run's text is written (and its
# windows' encoder outputs held meanwhile).
RUN_BATCHES = 4


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: detect per input (or per window if multilingual)
    multilingual: bool = False  # detect the language of every window
    task: str = "transcribe"
    timestamps: bool = True
    batch_size: int = 16
    max_new_tokens: int = MAX_NEW_TOKENS
    initial_prompt: str | None = None
    channel: str | int | None = None
    compile: bool = False
    # Continuous batching: a run holds RUN_BATCHES batches of windows, and each row that
    # finishes takes the next window at once (engine.py), instead of the batch stepping
    # until its last row ends. The same text either way. None: where the step is compiled
    # (a step costs the same at 1 row as at 16 there); the eager CPU step drops finished
    # rows instead, and refills cost it the waiting windows' encoder outputs held for no
    # time saved (docs/speed.md). Off under a latency bound (a window waits for its run).
    refill: bool | None = None
    # The speech map decides which audio is decoded (windows), and is evidence for text
    # over non-speech. Off: every window of the input is decoded, as plain Whisper does,
    # and only the decoder's own guards drop text; the map still keeps a decode from
    # ending while speech remains, and weights language detection.
    vad: bool = True
    policy: Policy = Policy()
    word_timestamps: bool = False  # words with times (one alignment pass per batch)
    # Seconds a window may wait for its batch (see run_latency): None decides by the
    # input (a bound for live input, none for files), inf never bounds.
    latency: float | None = None

    def __post_init__(self) -> None:
        if self.latency is not None and not self.latency >= 0:
            raise ValueError("latency must be >= 0 seconds")


def check_options(options: TranscribeOptions) -> None:
    """Run-level checks that need no model (the CLI and bench make them before loading one)."""
    if options.task not in TASKS:
        raise WhisperCliError(f"invalid task {options.task!r}; choose {' or '.join(TASKS)}")
    if options.batch_size < 1:
        raise WhisperCliError("--batch-size must be at least 1")
    if options.max_new_tokens < 1:
        raise WhisperCliError("--max-new-tokens must be at least 1")
    if options.language is not None and options.multilingual:
        raise WhisperCliError(
            f"--multilingual detects the language of every window; it contradicts "
            f"--language {options.language}"
        )


@dataclass(frozen=True)
class RunOptions:
    """Every option of a transcription as a command line gives it, before any device is
    known: built once from the flags that transcribe, batch, bench and eval share.

    `decoding` holds the pipeline's options but for `compile`, which depends on the
    device: `for_device` resolves it from the `compile` choice here.
    """

    model: str | None = None  # None: default_model of the device the model loads on
    dtype: str = "auto"
    quantize: str = "none"  # one of dtypes.QUANTIZE_CHOICES
    device: str = "auto"
    compile: str = "auto"  # one of COMPILE_CHOICES
    decoding: TranscribeOptions = TranscribeOptions()
    fmt: str = "txt"  # one of formats.FORMAT_CHOICES: a format, or "all"
    subtitles: SubtitleOptions = dataclasses.field(default_factory=SubtitleOptions)

    def check(self) -> None:
        """Everything that can be refused without a model (a WhisperCliError)."""
        check_compile(self.compile)
        check_options(self.decoding)
        self.subtitles.check(self.decoding.word_timestamps)

    def with_latency(self, latency: float | None) -> RunOptions:
        """These options with TranscribeOptions.latency set (transcribe's --latency)."""
        return dataclasses.replace(
            self, decoding=dataclasses.replace(self.decoding, latency=latency)
        )

    def for_device(self, device_type: str) -> TranscribeOptions:
        """The pipeline's options on a device type ("cpu", "cuda")."""
        return dataclasses.replace(self.decoding, compile=use_compile(self.compile, device_type))
