"""The command line: shell use in a real subprocess, then every option of `transcribe`.

In-process runs go through Typer's CliRunner; `cached_cli_models` lets them reuse the
session's models/tiny.en and models/base (the CLI still resolves the name, builds its
Transcriber and renders output itself). Tests about finding a model load it for real.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import soundfile as sf
from conftest import SUITE_KERNELS
from test_formats import assert_monotonic, parse_srt, parse_vtt
from test_longform import clip, count_phrase, english, wer
from typer.testing import CliRunner
from util import REPO, jsonl_records, real_model, shared_clip

from whisper_cli.cli import app
from whisper_cli.formats import FORMATS

JFK_PHRASE = "ask not what your country can do for you"


def tiny() -> str:
    return str(real_model("tiny.en"))


def jfk() -> str:
    return str(shared_clip("jfk.flac"))


def cli(*args: str):
    """`whisper-cli ARGS` in-process; stdout and stderr kept apart."""
    return CliRunner().invoke(app, list(args))


def transcribe(*args: str):
    """`whisper-cli transcribe ARGS`, which must succeed."""
    result = cli("transcribe", *args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    return result


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("whisper-cli: warning:")]


def usage_error(result, *words: str) -> None:
    """Exit 2 with one `whisper-cli: error:` line that mentions every word."""
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    text = re.sub(r"\s+", " ", result.stderr)
    for word in words:
        assert word in text, (word, result.stderr)


# --- shell use: the installed console script in a subprocess ---------------------------------


def whisper_cli_command() -> list[str]:
    script = Path(sys.executable).with_name("whisper-cli")
    return [str(script)] if script.exists() else [sys.executable, "-m", "whisper_cli"]


def shell(command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, shell=True, capture_output=True, text=True, timeout=600, cwd=REPO, **kwargs
    )


# A process that ends through cli._exit; argv: how ("fast": cli._exit, "normal":
# sys.exit), whether a non-daemon thread still runs ("thread") and the status.
_EXIT_PROBE = """
import atexit, os, sys, threading, time
from whisper_cli import cli

class Teardown:  # its __del__ runs only in the interpreter's teardown of this module
    def __del__(self):
        os.write(2, b"teardown\\n")

kept = Teardown()
atexit.register(lambda: os.write(2, b"atexit\\n"))
sys.stdout.write("unflushed")
how, thread, status = sys.argv[1:]
if thread == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), os.write(2, b"thread\\n"))).start()
(cli._exit if how == "fast" else sys.exit)(int(status))
"""


@pytest.mark.parametrize(
    ("how", "thread", "teardown"),
    [("fast", "none", False), ("fast", "thread", True), ("normal", "none", True)],
)
def test_the_exit_skips_only_the_interpreters_teardown(how, thread, teardown) -> None:
    """cli._exit ends as a normal exit does (atexit handlers, stdout flushed, the status,
    a running thread waited for: then it is a normal exit), less the teardown of modules
    after it (torch's ~0.5 s). The normal case shows that the probe sees a teardown."""
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_PROBE, how, thread, "3"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 3
    assert proc.stdout == "unflushed"
    lines = proc.stderr.splitlines()
    assert "atexit" in lines
    assert ("thread" in lines) == (thread == "thread")
    assert ("teardown" in lines) == teardown, proc.stderr


@pytest.fixture(scope="module")
def jfk_txt(tiny_en) -> str:
    """jfk.flac with tiny.en as the txt format prints it (in-process, for comparison)."""
    from whisper_cli.formats import render
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    return render(Transcriber(tiny_en, TranscribeOptions()).transcribe(jfk()), "txt")


def test_stdin_pipe_prints_only_the_transcript(jfk_txt: str) -> None:
    exe = shlex.join(whisper_cli_command())
    proc = shell(
        f"cat {shlex.quote(jfk())} | {exe} transcribe - --format txt --model {shlex.quote(tiny())}"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == jfk_txt  # the same bytes as reading the file; nothing else
    assert JFK_PHRASE in english(proc.stdout)
    assert "whisper-cli: model" in proc.stderr  # logs go to stderr


def test_jsonl_over_three_inputs_is_three_json_lines() -> None:
    names = ["jfk.flac", "hotwords.mp3", "stereo_diarization.wav"]
    paths = [str(shared_clip(n)) for n in names]
    proc = subprocess.run(
        [*whisper_cli_command(), "transcribe", *paths, "-f", "jsonl", "-m", tiny(), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["path"]: r for r in jsonl_records(proc.stdout)}
    assert len(records) == 3
    assert set(records) == set(paths)
    assert JFK_PHRASE in english(records[paths[0]]["text"])
    for record in records.values():
        assert record["model"] == tiny() and record["dtype"] == "f32"
        assert record["segments"] and record["duration"] > 3


def test_format_all_writes_every_format_that_parses(tmp_path: Path) -> None:
    out = tmp_path / "out"
    paths = [jfk(), str(shared_clip("hotwords.mp3"))]
    proc = subprocess.run(
        [*whisper_cli_command(), "transcribe", *paths, "-f", "all", "-o", str(out), "-m", tiny()],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{stem}.{fmt}" for stem in ("jfk", "hotwords") for fmt in FORMATS
    )
    for stem in ("jfk", "hotwords"):
        txt = (out / f"{stem}.txt").read_text()
        record = json.loads((out / f"{stem}.json").read_text())
        assert jsonl_records((out / f"{stem}.jsonl").read_text()) == [record]
        for fmt, parse in (("srt", parse_srt), ("vtt", parse_vtt)):
            cues = parse((out / f"{stem}.{fmt}").read_text())
            assert_monotonic(cues)
            assert [text for _, _, text in cues] == txt.splitlines()
            assert cues[-1][1] <= record["duration"] * 1000
            assert [(s, e) for s, e, _ in cues] == [
                (round(s["start"] * 1000), round(s["end"] * 1000)) for s in record["segments"]
            ]
        tsv = (out / f"{stem}.tsv").read_text().splitlines()
        assert tsv[0] == "start\tend\ttext" and [r.split("\t")[2] for r in tsv[1:]] == (
            txt.splitlines()
        )
    assert JFK_PHRASE in english((out / "jfk.txt").read_text())


def test_help_is_fast_and_does_not_import_torch() -> None:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        proc = subprocess.run([*whisper_cli_command(), "--help"], capture_output=True, text=True)
        best = min(best, time.perf_counter() - started)
        assert proc.returncode == 0 and "transcribe" in proc.stdout
    assert best < 1.0, f"whisper-cli --help took {best:.2f} s"
    code = (
        "import sys\n"
        "import whisper_cli.cli as cli\n"
        "assert 'torch' not in sys.modules\n"
        "for args in (['--help'], ['transcribe', '--help']):\n"
        "    try:\n"
        "        cli.app(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "heavy = {'torch', 'numpy', 'soundfile', 'av', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--initial-prompt" in proc.stdout


# --- --model ------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The hub is never reached: snapshot_download fails (offline) and records its calls."""
    calls: list[dict] = []

    def snapshot_download(repo_id: str, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        raise OSError("offline: no network in this test")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("WHISPER_CLI_MODELS", raising=False)
    monkeypatch.setenv("WHISPER_CLI_HOME", str(tmp_path / "home"))
    return calls


def test_model_alias_resolves_to_the_models_folder(
    no_hub: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_model("tiny.en")
    monkeypatch.chdir(REPO)
    result = transcribe(jfk(), "--model", "tiny.en")
    assert "model tiny.en (models/tiny.en)" in result.stderr
    assert JFK_PHRASE in english(result.stdout)
    assert no_hub == []  # found in ./models without asking the hub


def test_unknown_alias_is_a_usage_error(no_hub: list) -> None:
    usage_error(
        cli("transcribe", jfk(), "--model", "tiny.xx"), "unknown model 'tiny.xx'", "tiny.en"
    )
    assert no_hub == []


@pytest.mark.parametrize(
    ("name", "repo"),
    [("someone/whisper-nothing", "someone/whisper-nothing"), ("small", "openai/whisper-small")],
)
def test_model_not_cached_and_not_downloadable(
    name: str, repo: str, no_hub: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./models/small here
    usage_error(cli("transcribe", jfk(), "--model", name), repo, "--model DIR", "make models")
    # The cache is asked first, then a download is tried.
    assert [c["local_files_only"] for c in no_hub][:1] == [True]
    assert False in [c["local_files_only"] for c in no_hub]


def test_model_from_the_hub_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def snapshot_download(repo_id: str, **kwargs):
        calls.append((repo_id, kwargs))
        return tiny()  # what the hub cache would hold

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    result = transcribe(jfk(), "--model", "openai/whisper-tiny.en", "-f", "json")
    assert calls[0][0] == "openai/whisper-tiny.en" and calls[0][1]["local_files_only"] is True
    assert len(calls) == 1
    record = json.loads(result.stdout)
    assert record["model"] == "openai/whisper-tiny.en"
    assert JFK_PHRASE in english(record["text"])


# --- --dtype and --device ---------------------------------------------------------------------


def test_dtype_bf16_runs_in_bf16_and_transcribes() -> None:
    result = transcribe(jfk(), "-m", tiny(), "--dtype", "bf16", "-f", "json", "-q")
    record = json.loads(result.stdout)
    assert record["dtype"] == "bf16"
    assert wer(clip("jfk.flac")["reference"], record["text"]) <= 0.1


@pytest.mark.usefixtures("cached_cli_models")
def test_dtype_f32_device_cpu_compile_off() -> None:
    args = ("--dtype", "f32", "--device", "cpu", "--compile", "off", "-f", "json")
    result = transcribe(jfk(), "-m", tiny(), *args)
    assert json.loads(result.stdout)["dtype"] == "f32"
    assert "dtype f32, device cpu" in result.stderr


def test_bad_dtype_and_missing_cuda_are_usage_errors() -> None:
    result = cli("transcribe", jfk(), "-m", tiny(), "--dtype", "f8")
    assert result.exit_code == 2 and "f8" in result.stderr
    import torch

    if not torch.cuda.is_available():
        usage_error(cli("transcribe", jfk(), "-m", tiny(), "--device", "cuda"), "no CUDA device")


# --- --language, --task, --multilingual -------------------------------------------------------


@pytest.mark.usefixtures("cached_cli_models")
def test_language_checks() -> None:
    usage_error(cli("transcribe", jfk(), "-m", tiny(), "--language", "de"), "English-only", "'de'")
    usage_error(
        cli("transcribe", jfk(), "-m", str(real_model("base")), "-l", "xx"),
        "unknown language 'xx'",
    )
    usage_error(
        cli("transcribe", jfk(), "-m", tiny(), "--task", "translate"), "English-only", "translate"
    )


@pytest.mark.usefixtures("cached_cli_models")
def test_base_reports_the_detected_language() -> None:
    result = transcribe(jfk(), "-m", str(real_model("base")), "-f", "json")
    record = json.loads(result.stdout)
    assert record["language"] == "en" and record["language_probability"] > 0.5
    assert re.search(r"jfk\.flac: language en \(p=0\.\d\d\)", result.stderr)
    assert JFK_PHRASE in english(record["text"])


# --- decoding options ---------------------------------------------------------------------------


@pytest.mark.usefixtures("cached_cli_models")
def test_no_timestamps_gives_one_segment_with_the_same_words() -> None:
    timed = json.loads(transcribe(jfk(), "-m", tiny(), "-f", "json").stdout)
    plain = json.loads(transcribe(jfk(), "-m", tiny(), "-f", "json", "--no-timestamps").stdout)
    assert len(timed["segments"]) >= 2
    assert [(s["start"], s["end"]) for s in plain["segments"]] == [(0.0, 11.0)]
    assert english(plain["text"]) == english(timed["text"])


@pytest.mark.usefixtures("cached_cli_models")
def test_batch_size_option() -> None:
    paths = [jfk(), str(shared_clip("hotwords.mp3")), str(shared_clip("stereo_diarization.wav"))]
    outputs = {
        size: transcribe(*paths, "-m", tiny(), "-f", "jsonl", "--batch-size", size).stdout
        for size in ("1", "2", "16")
    }

    def texts(stdout: str) -> dict:
        return {r["path"]: r["text"] for r in jsonl_records(stdout)}

    assert texts(outputs["1"]) == texts(outputs["2"]) == texts(outputs["16"])
    assert len(texts(outputs["1"])) == 3
    result = cli("transcribe", jfk(), "-m", tiny(), "--batch-size", "0")
    assert result.exit_code == 2


@pytest.mark.usefixtures("cached_cli_models")
def test_max_new_tokens_truncates_each_window() -> None:
    full = english(transcribe(jfk(), "-m", tiny()).stdout)
    short = english(transcribe(jfk(), "-m", tiny(), "--max-new-tokens", "5").stdout)
    # One token is the opening timestamp; the other four are the first words.
    assert short and full.startswith(short)
    assert 2 <= len(short.split()) <= 4
    # ... and says so: the rest of the window is missing.
    result = transcribe(jfk(), "-m", tiny(), "--max-new-tokens", "5")
    assert warning_lines(result.stderr) == [
        f"whisper-cli: warning: {jfk()}: 1 of 1 window(s) reached --max-new-tokens 5 before "
        "their end; the text after that is missing"
    ]
    assert cli("transcribe", jfk(), "-m", tiny(), "--max-new-tokens", "0").exit_code == 2


@pytest.mark.usefixtures("cached_cli_models")
def test_initial_prompt_teaches_a_name() -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    plain = transcribe(hotwords, "-m", tiny()).stdout
    prompted = transcribe(hotwords, "-m", tiny(), "--initial-prompt", "ComfyUI").stdout
    # Without the prompt tiny.en hears "comfyu eye"; with it, the product name (twice).
    assert count_phrase(plain, "comfyui") == 0
    assert count_phrase(prompted, "comfyui") == 2
    assert count_phrase(prompted, "then you go into your") == 1  # the rest is still there
    # base spells it "Confu i" unprompted; prompted, it writes the name exactly as given.
    base = str(real_model("base"))
    assert "ComfyUI" not in transcribe(hotwords, "-m", base, "-l", "en").stdout
    prompted = transcribe(hotwords, "-m", base, "-l", "en", "--initial-prompt", "ComfyUI").stdout
    assert prompted.count("ComfyUI") == 2


@pytest.mark.usefixtures("cached_cli_models")
def test_channel_picks_one_speaker() -> None:
    stereo = str(shared_clip("stereo_diarization.wav"))
    refs = clip("stereo_diarization.wav")
    left = transcribe(stereo, "-m", tiny(), "--channel", "left").stdout
    right = transcribe(stereo, "-m", tiny(), "--channel", "right").stdout
    assert wer(refs["reference_left"], left) <= 0.1
    assert wer(refs["reference_right"], right) <= 0.1
    assert transcribe(stereo, "-m", tiny(), "--channel", "1").stdout == right
    mixed = transcribe(stereo, "-m", tiny()).stdout  # both speakers at once
    assert wer(refs["reference_left"], mixed) > wer(refs["reference_left"], left)

    missing = cli("transcribe", stereo, "-m", tiny(), "--channel", "2")
    assert missing.exit_code == 1 and "has no channel 2" in missing.stderr
    usage_error(cli("transcribe", stereo, "-m", tiny(), "--channel", "centre"), "invalid channel")


@pytest.mark.usefixtures("cached_cli_models")
def test_silence_and_repetition_guards() -> None:
    everything_silent = ("--no-speech-threshold", "-1", "--logprob-threshold", "0")
    silent = transcribe(jfk(), "-m", tiny(), *everything_silent)
    assert silent.stdout == "" and f"whisper-cli: {jfk()}: no speech found" in silent.stderr
    dropped = transcribe(jfk(), "-m", tiny(), "--compression-ratio-threshold", "0")
    assert dropped.stdout == ""
    [line] = warning_lines(dropped.stderr)
    assert re.fullmatch(
        rf"whisper-cli: warning: {re.escape(jfk())}: \d segment\(s\) dropped as repetitive "
        r"\(above --compression-ratio-threshold 0, or earlier segments' words \(nearly\) "
        r"again in under 0\.33 of their time\)",
        line,
    )
    assert "no speech found" not in dropped.stderr  # there was speech; the guard dropped it
    # The defaults keep real speech.
    assert JFK_PHRASE in english(transcribe(jfk(), "-m", tiny()).stdout)


# --- output -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cached_cli_models")
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_on_stdout(fmt: str) -> None:
    out = transcribe(jfk(), "-m", tiny(), "--format", fmt, "-q").stdout
    if fmt == "txt":
        assert JFK_PHRASE in english(out)
        texts = out.splitlines()
    elif fmt in ("json", "jsonl"):
        (record,) = jsonl_records(out) if fmt == "jsonl" else [json.loads(out)]
        assert record["path"] == jfk() and record["language"] == "en"
        texts = [s["text"].strip() for s in record["segments"]]
    elif fmt == "tsv":
        rows = [row.split("\t") for row in out.splitlines()]
        assert rows[0] == ["start", "end", "text"]
        starts = [int(r[0]) for r in rows[1:]]
        assert starts == sorted(starts) and all(int(r[1]) <= 11000 for r in rows[1:])
        texts = [r[2] for r in rows[1:]]
    else:
        cues = (parse_srt if fmt == "srt" else parse_vtt)(out)
        assert_monotonic(cues)
        assert cues[0][0] == 0 and cues[-1][1] == 11000
        texts = [text for _, _, text in cues]
    assert JFK_PHRASE in english(" ".join(texts))


@pytest.mark.usefixtures("cached_cli_models")
def test_several_inputs_as_txt_have_headers() -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    out = transcribe(jfk(), hotwords, "-m", tiny(), "-q").stdout
    parts = re.split(r"^==> (.+) <==\n", out, flags=re.M)
    assert parts[0] == ""
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert set(sections) == {jfk(), hotwords}
    assert JFK_PHRASE in english(sections[jfk()])
    assert "folder" in english(sections[hotwords])


@pytest.mark.usefixtures("cached_cli_models")
def test_output_dir_one_format(tmp_path: Path) -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    result = transcribe(jfk(), hotwords, "-m", tiny(), "-f", "srt", "-o", str(tmp_path / "subs"))
    assert result.stdout == ""
    assert sorted(p.name for p in (tmp_path / "subs").iterdir()) == ["hotwords.srt", "jfk.srt"]
    assert_monotonic(parse_srt((tmp_path / "subs" / "jfk.srt").read_text()))


def _tree(root: Path) -> Path:
    """root/a.flac, root/notes.txt, root/sub/b.mp3 and root/nested/deeper/c.wav (links)."""
    (root / "sub").mkdir(parents=True)
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "a.flac").symlink_to(shared_clip("jfk.flac"))
    (root / "notes.txt").write_text("not audio")
    (root / "sub" / "b.mp3").symlink_to(shared_clip("hotwords.mp3"))
    (root / "nested" / "deeper" / "c.wav").symlink_to(shared_clip("stereo_diarization.wav"))
    return root


@pytest.mark.usefixtures("cached_cli_models")
def test_recursive(tmp_path: Path) -> None:
    root = _tree(tmp_path / "in")

    def paths(*flags: str) -> list[str]:
        out = transcribe(str(root), "-m", tiny(), "-f", "jsonl", "-q", *flags).stdout
        return sorted(r["path"] for r in jsonl_records(out))

    assert paths() == [str(root / "a.flac")]
    # Named twice (and once more through its directory): transcribed once.
    twice = transcribe(str(root / "a.flac"), str(root), "-m", tiny(), "-f", "jsonl")
    assert len(jsonl_records(twice.stdout)) == 1
    assert f"{root / 'a.flac'} is named more than once; transcribed once" in twice.stderr
    assert paths("--recursive") == [
        str(root / "a.flac"),
        str(root / "nested" / "deeper" / "c.wav"),
        str(root / "sub" / "b.mp3"),
    ]
    empty = cli("transcribe", str(root / "nested"), "-m", tiny(), "-q")
    assert empty.exit_code == 1 and "use --recursive" in empty.stderr
    # Outputs are named by stem: two inputs of one folder that would write the same file
    # are refused before any work, instead of one silently overwriting the other.
    (root / "sub" / "b.wav").symlink_to(shared_clip("stereo_diarization.wav"))
    clash = cli("transcribe", str(root), "-r", "-m", tiny(), "-o", str(tmp_path / "out"))
    usage_error(clash, "b.mp3", "b.wav", str(tmp_path / "out" / "sub" / "b.txt"))
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("cached_cli_models")
def test_skip_existing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    transcribe(jfk(), "-m", tiny(), "-o", str(out), "-f", "txt")
    (out / "jfk.txt").write_text("kept\n")
    again = transcribe(jfk(), "-m", tiny(), "-o", str(out), "-f", "txt", "--skip-existing")
    assert "skipping 1 input(s)" in again.stderr
    assert (out / "jfk.txt").read_text() == "kept\n"
    usage_error(cli("transcribe", jfk(), "-m", tiny(), "--skip-existing"), "--output-dir")


@pytest.mark.usefixtures("cached_cli_models")
def test_quiet_and_verbose() -> None:
    quiet = transcribe(jfk(), "-m", tiny(), "--quiet")
    assert quiet.stderr == ""
    assert JFK_PHRASE in english(quiet.stdout)

    verbose = transcribe(jfk(), "-m", tiny(), "--verbose")
    lines = re.findall(r"^\[ *([\d.]+) --> *([\d.]+)\] (.+)$", verbose.stderr, flags=re.M)
    assert len(lines) == len(verbose.stdout.splitlines()) >= 2
    assert [text for _, _, text in lines] == verbose.stdout.splitlines()
    starts = [float(start) for start, _, _ in lines]
    assert starts == sorted(starts) and float(lines[-1][1]) <= 11.0
    # The model's kernel plan, one line (the suite's: see conftest.SUITE_KERNELS).
    [plan] = [line for line in verbose.stderr.splitlines() if " kernels " in line]
    assert plan.startswith(f"whisper-cli: kernels {SUITE_KERNELS} (cpu, f32, ")
    assert re.search(r"attention (\w+ x\d+, )*sdpa x\d+", plan)


def test_usage_errors_before_any_work(tmp_path: Path) -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    usage_error(cli("transcribe", jfk(), hotwords, "-f", "srt", "-m", tiny()), "--output-dir")
    usage_error(cli("transcribe", jfk(), "-f", "all", "-m", tiny()), "--output-dir")
    usage_error(cli("transcribe", "-", "-", "-m", tiny()), "stdin")
    assert cli("transcribe", jfk(), "-f", "doc").exit_code == 2
    assert cli("transcribe").exit_code == 2  # no input
    # Checked before the model is even looked for.
    result = cli("transcribe", jfk(), hotwords, "-f", "vtt", "-m", "no-such-model")
    usage_error(result, "--format vtt", "--output-dir")
    assert "model" not in result.stderr.replace("--", "")


def test_debug_shows_the_traceback() -> None:
    plain = cli("transcribe", jfk(), "--model", "tiny.xx")
    debug = cli("transcribe", jfk(), "--model", "tiny.xx", "--debug")
    assert plain.exit_code == debug.exit_code == 2
    assert "Traceback" not in plain.stderr
    assert "Traceback" in debug.stderr and "unknown model" in debug.stderr


@pytest.mark.usefixtures("cached_cli_models")
def test_failed_input_exits_1_and_the_others_are_written(tmp_path: Path) -> None:
    bad = tmp_path / "broken.wav"
    bad.write_bytes(b"RIFF not really a wave file")
    right = tmp_path / "right.wav"
    audio, rate = sf.read(shared_clip("stereo_diarization.wav"))
    sf.write(right, audio[:, 1], rate)
    missing = str(tmp_path / "missing.wav")
    out = tmp_path / "out"
    result = cli("transcribe", jfk(), missing, str(bad), str(right), "-m", tiny(), "-o", str(out))
    assert result.exit_code == 1
    assert f"{missing}: no such file" in result.stderr
    assert f"{bad}:" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["jfk.txt", "right.txt"]
    assert JFK_PHRASE in english((out / "jfk.txt").read_text())
    assert count_phrase((out / "right.txt").read_text(), "horizon seems extremely distant") == 1


# --- damaged samples, output locations, messages, polish -----------------------------------


def _jfk_with(tmp_path: Path, name: str, damage) -> str:
    """jfk.flac as a float WAV with `damage(samples, rate)` applied (FLAC holds no NaN)."""
    samples, rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    damage(samples, rate)
    path = tmp_path / name
    sf.write(path, samples, rate, subtype="FLOAT")
    return str(path)


@pytest.mark.usefixtures("cached_cli_models")
@pytest.mark.parametrize(
    ("name", "damage", "affected"),
    [
        ("one_nan.wav", lambda x, r: x.__setitem__((5 * r, 0), np.nan), "1 non-finite sample"),
        ("inf_run.wav", lambda x, r: x.__setitem__(slice(3 * r, 3 * r + 100), np.inf), "100 "),
    ],
)
def test_non_finite_samples_keep_the_transcript(tmp_path: Path, name, damage, affected) -> None:
    path = _jfk_with(tmp_path, name, damage)
    result = transcribe(path, "-m", tiny())
    assert wer(clip("jfk.flac")["reference"], result.stdout) <= 0.1, result.stdout
    [line] = warning_lines(result.stderr)
    assert line.startswith(f"whisper-cli: warning: {path}: {affected}")
    assert "replaced by silence" in line


@pytest.mark.usefixtures("cached_cli_models")
def test_all_nan_input_is_an_input_error(tmp_path: Path) -> None:
    path = _jfk_with(tmp_path, "all_nan.wav", lambda x, r: x.fill(np.nan))
    result = cli("transcribe", path, "-m", tiny())
    assert result.exit_code == 1 and result.stdout == ""
    assert f"whisper-cli: error: {path}: has no finite sample (all are NaN or infinite)" in (
        result.stderr
    )


@pytest.fixture(scope="module")
def long_input(tmp_path_factory) -> Path:
    """Five minutes of speech (jfk tiled): hours of work if found only after decoding."""
    samples, rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    path = tmp_path_factory.mktemp("long") / "long.flac"
    sf.write(path, np.concatenate([samples] * 28), rate)
    return path


def _unwritable_dir(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A read-only directory, and the command prefix under which it is read-only for us."""
    from test_reliability import drop_file_access_prefix

    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    prefix = drop_file_access_prefix(folder)  # root writes anywhere unless it drops that
    if prefix is None:
        pytest.skip("running as root without setpriv: no directory is read-only")
    return folder, prefix


@pytest.mark.parametrize("where", ["read_only", "under_a_file"])
def test_unusable_output_dir_fails_before_the_model_loads(
    tmp_path: Path, long_input: Path, where: str
) -> None:
    prefix: tuple[str, ...] = ()
    if where == "read_only":
        out, prefix = _unwritable_dir(tmp_path)
        message = f"cannot write to output directory {out}: Permission denied"
    else:
        (tmp_path / "file").write_text("x\n")
        out = tmp_path / "file" / "out"
        message = f"cannot create output directory {out}: Not a directory"
    started = time.perf_counter()
    proc = subprocess.run(
        [*prefix, *whisper_cli_command(), "transcribe", str(long_input), "-m", tiny(), "-o", out],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    seconds = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"whisper-cli: error: {message}\n"  # no model line: never loaded
    assert seconds < 2.0, f"took {seconds:.1f} s"


@pytest.mark.usefixtures("cached_cli_models")
def test_recursive_output_dir_mirrors_the_input_tree(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    for month in ("jan", "feb"):
        (calls / month).mkdir(parents=True)
    (calls / "jan" / "call1.flac").symlink_to(shared_clip("jfk.flac"))
    (calls / "feb" / "call1.wav").symlink_to(shared_clip("stereo_diarization.wav"))
    (calls / "top.mp3").symlink_to(shared_clip("hotwords.mp3"))
    out = tmp_path / "out"
    result = transcribe(str(calls), "-r", "-m", tiny(), "-o", str(out), "-f", "txt")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.txt")) == [
        "feb/call1.txt",
        "jan/call1.txt",
        "top.txt",
    ]
    assert JFK_PHRASE in english((out / "jan" / "call1.txt").read_text())
    assert "curtain" in (out / "feb" / "call1.txt").read_text()
    assert "whisper-cli: 3 written, 0 failed, 20 s of audio in " in result.stderr


def test_decoder_chatter_stays_off_stderr() -> None:
    mp3 = str(shared_clip("multilingual.mp3"))
    command = [*whisper_cli_command(), "transcribe", mp3, "-m", tiny(), "--max-new-tokens", "8"]
    quiet = subprocess.run([*command, "-q"], capture_output=True, text=True, cwd=REPO)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "Permission" in quiet.stdout
    plain = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert "part2_3_length" not in plain.stderr and "error:" not in plain.stderr
    verbose = subprocess.run([*command, "-v"], capture_output=True, text=True, cwd=REPO)
    [said] = [line for line in verbose.stderr.splitlines() if "the decoder said" in line]
    assert said.startswith(f"whisper-cli: warning: {mp3}: the decoder said: [src/libmpg123/")


def test_f16_on_cpu_warns_once_as_one_line(tmp_path: Path) -> None:
    silent = tmp_path / "silent.wav"  # nothing to decode: the run is the model load
    sf.write(silent, np.zeros(16000, np.float32), 16000)
    command = [*whisper_cli_command(), "transcribe", str(silent), "-m", tiny(), "--dtype", "f16"]
    plain = subprocess.run([*command, "--device", "cpu"], capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    [line] = warning_lines(plain.stderr)
    assert line.startswith("whisper-cli: warning: f16 on CPU is slow")
    assert ".py:" not in plain.stderr and "RuntimeWarning" not in plain.stderr
    quiet = subprocess.run([*command, "--device", "cpu", "-q"], capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == ""


# --- item 8 of the interactive-use issue, one test each ----------------------------------------


def test_version_and_short_help() -> None:
    from whisper_cli import __version__

    version = cli("--version")
    assert version.exit_code == 0 and version.stdout == f"whisper-cli {__version__}\n"
    for args in (["-h"], ["transcribe", "-h"]):
        result = cli(*args)
        assert result.exit_code == 0 and "Usage: whisper-cli" in result.stdout


def test_help_has_panels_and_examples_and_fits_80_columns() -> None:
    proc = subprocess.run(
        [*whisper_cli_command(), "transcribe", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80", "TERM": "dumb"},
    )
    out = proc.stdout
    assert proc.returncode == 0
    for panel in ("Input and output", "Model and precision", "Decoding", "Guards", "Performance"):
        assert f"─ {panel}" in out, panel
    assert "Examples" in out and "whisper-cli transcribe talk.mp3 -f srt > talk.srt" in out
    assert "<bool>" not in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    import typer.main

    command = typer.main.get_command(app).commands["transcribe"]
    options = [o for p in command.params for o in p.opts if o.startswith("--")]
    assert len(options) >= 20
    for option in options:  # every option's name in full
        assert re.search(rf"{option}\b", out), option


@pytest.mark.usefixtures("cached_cli_models")
@pytest.mark.parametrize("language", ["EN", "English", "english"])
def test_language_names_and_any_case(language: str) -> None:
    result = transcribe(jfk(), "-m", tiny(), "--language", language, "-f", "json")
    assert json.loads(result.stdout)["language"] == "en"


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import whisper_cli.loading as loading

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", load_model)


@pytest.mark.usefixtures("no_model_load")
def test_bad_channel_language_and_missing_input_before_the_model_loads(tmp_path: Path) -> None:
    usage_error(cli("transcribe", jfk(), "-m", tiny(), "--channel", "centre"), "invalid channel")
    usage_error(cli("transcribe", jfk(), "-m", tiny(), "-l", "klingon"), "unknown language")
    missing = cli("transcribe", str(tmp_path / "missing.wav"), "-m", tiny())
    assert missing.exit_code == 1
    assert missing.stderr == f"whisper-cli: error: {tmp_path / 'missing.wav'}: no such file\n"
    stereo = str(shared_clip("stereo_diarization.wav"))
    no_channel = cli("transcribe", stereo, "-m", tiny(), "--channel", "2")
    assert no_channel.exit_code == 1 and "has no channel 2" in no_channel.stderr


@pytest.mark.usefixtures("cached_cli_models")
def test_contradictory_options_are_refused() -> None:
    usage_error(
        cli("transcribe", jfk(), "-m", tiny(), "--multilingual"), "English-only", "--multilingual"
    )
    base = str(real_model("base"))
    usage_error(
        cli("transcribe", jfk(), "-m", base, "--multilingual", "-l", "en"),
        "--multilingual",
        "contradicts --language en",
    )
    usage_error(cli("transcribe", jfk(), "-m", tiny(), "-q", "-v"), "--quiet and --verbose")


def test_vad_neg_threshold_is_the_policys_silero_rule() -> None:
    """The end-of-speech threshold follows --vad-threshold by Silero's rule (0.15 below,
    at least 0.01) in the policy itself: a library user gets what the CLI gets."""
    from whisper_cli.cli import run_options
    from whisper_cli.options import Policy

    assert Policy().vad_neg_threshold == 0.35
    assert Policy(vad_threshold=0.6).vad_neg_threshold == pytest.approx(0.45)
    assert Policy(vad_threshold=0.1).vad_neg_threshold == 0.01
    assert Policy(vad_threshold=0.6, vad_neg_threshold=0.5).vad_neg_threshold == 0.5
    assert run_options({"vad_threshold": 0.6}).decoding.policy == Policy(vad_threshold=0.6)
    assert run_options({}).decoding.policy == Policy()
    with pytest.raises(ValueError, match="vad_neg_threshold <= vad_threshold"):
        Policy(vad_threshold=0.005)


def test_full_disk_is_a_clear_error() -> None:
    exe = shlex.join(whisper_cli_command())
    proc = shell(f"{exe} transcribe {shlex.quote(jfk())} -m {shlex.quote(tiny())} -q > /dev/full")
    assert proc.returncode == 2
    assert proc.stderr == "whisper-cli: error: cannot write to stdout: No space left on device\n"


def test_closed_stdout_is_a_quiet_exit() -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    command = [*whisper_cli_command(), "transcribe", jfk(), hotwords, "-m", tiny()]
    proc = subprocess.Popen(
        [*command, "-f", "jsonl"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )
    proc.stdout.close()  # `| head -0`: the reader is gone before the first line
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141  # 128 + SIGPIPE, as `cat` and `grep` report it
    assert "error" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.usefixtures("cached_cli_models")
def test_same_file_twice_is_transcribed_once_and_runs_end_with_a_summary(tmp_path) -> None:
    hotwords = str(shared_clip("hotwords.mp3"))
    missing = str(tmp_path / "missing.wav")
    result = cli("transcribe", jfk(), hotwords, jfk(), missing, "-m", tiny(), "-f", "jsonl")
    assert result.exit_code == 1
    assert [r["path"] for r in jsonl_records(result.stdout)] == [jfk(), hotwords]
    assert f"whisper-cli: {jfk()} is named more than once; transcribed once" in result.stderr
    last = result.stderr.splitlines()[-1]
    assert re.fullmatch(r"whisper-cli: 2 written, 1 failed, 15 s of audio in [\d.]+ s", last)
    assert "written" not in transcribe(jfk(), "-m", tiny()).stderr  # one input: no summary


@pytest.mark.usefixtures("cached_cli_models")
def test_a_single_input_with_output_dir_says_what_it_wrote(tmp_path) -> None:
    """One input to stdout ends silently; to -o, with one line of what it wrote (not
    under -q)."""
    out = tmp_path / "out"
    result = transcribe(jfk(), "-m", tiny(), "-o", str(out))
    last = result.stderr.splitlines()[-1]
    assert re.fullmatch(r"whisper-cli: wrote 1 file, 11 s of audio in [\d.]+ (s|min)", last)
    result = transcribe(jfk(), "-m", tiny(), "-o", str(out), "-f", "all", "-q")
    assert result.stderr == ""
    assert sorted(p.name for p in out.iterdir()) == sorted(f"jfk.{f}" for f in FORMATS)
    result = transcribe(jfk(), "-m", tiny(), "-o", str(out / "all"), "-f", "all")
    assert re.search(rf"wrote {len(FORMATS)} files, 11 s of audio in ", result.stderr)


def test_durations_are_shown_at_the_runs_scale() -> None:
    from whisper_cli.cli import _duration

    assert [_duration(s) for s in (0, 4.24, 41, 59.7, 150, 599, 720, 3900)] == [
        "0.0 s",
        "4.2 s",
        "41 s",
        "1.0 min",
        "2.5 min",
        "10 min",
        "12 min",
        "1 h 05 min",
    ]


@pytest.mark.usefixtures("cached_cli_models")
def test_repetition_guard_cut_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real speech rarely loops with tiny.en; the decoder's flag is set on its real rows."""
    import dataclasses

    from whisper_cli.engine import Engine

    real = Engine.run

    def looping(self, *args, **kwargs):
        batch = real(self, *args, **kwargs)
        rows = [dataclasses.replace(row, looped=True) for row in batch.rows]
        return dataclasses.replace(batch, rows=rows)

    monkeypatch.setattr(Engine, "run", looping)
    result = transcribe(jfk(), "-m", tiny())
    assert warning_lines(result.stderr) == [
        f"whisper-cli: warning: {jfk()}: 1 window(s) kept repeating themselves at every "
        "temperature and were cut by the repetition guard; the rest of those windows is missing"
    ]
    assert "warning" not in transcribe(jfk(), "-m", tiny(), "-q").stderr


def test_cli_functions_stay_short_and_build_options_once() -> None:
    """The option model keeps the commands small: no dict(locals()), no long function."""
    import ast

    import whisper_cli.cli

    source = Path(whisper_cli.cli.__file__).read_text()
    assert "locals()" not in source
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []
