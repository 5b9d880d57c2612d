"""`whisper-cli batch`: manifests, shards, resuming, faults, and the Ray engine.

The local-engine tests run in-process on the session's models (`cached_cli_models`). The
Ray tests share one local cluster (`ray.init(num_cpus=2, include_dashboard=False)`) whose
CPU actors load models/tiny.en themselves; every good input's outputs must equal those
of `whisper-cli transcribe` on the same file, byte for byte (JSON without its timings).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import soundfile as sf
from typer.testing import CliRunner
from util import IN_CI, jsonl_records, real_model, shared_clip

from whisper_cli.batch import (
    BatchConfig,
    Item,
    parse_shard,
    read_manifest,
    run_batch,
    shard_items,
)
from whisper_cli.cli import app
from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import FORMATS
from whisper_cli.pipeline import TranscribeOptions

CLIPS = ("jfk.flac", "stereo_diarization.wav", "hotwords.mp3", "multilingual.mp3")


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def tiny() -> str:
    return str(real_model("tiny.en"))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Copies of the shared clips and one corrupt file, in one folder (so their outputs go
    directly into -o), as a text manifest of absolute paths."""
    folder = tmp_path_factory.mktemp("manifest")
    for name in CLIPS:
        shutil.copy(shared_clip(name), folder / name)
    corrupt = folder / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 8)
    paths = [str(folder / name) for name in CLIPS] + [str(corrupt)]
    path = folder / "inputs.txt"
    path.write_text("".join(f"{p}\n" for p in paths))
    return path


@pytest.fixture(scope="module")
def transcribed(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`whisper-cli transcribe GOOD_FILES --format all -o DIR` (the outputs to match).

    One run for all files: an input's outputs do not depend on which other inputs share
    its batches (test_cli and test_reliability compare runs of one and several inputs).
    """
    out = tmp_path_factory.mktemp("transcribed")
    good = manifest_paths(manifest)[:-1]
    result = cli("transcribe", *good, "-m", tiny(), "-f", "all", "-o", str(out), "-q")
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def local_run(manifest: Path, tmp_path_factory: pytest.TempPathFactory):
    """`whisper-cli batch MANIFEST --format all` with the local engine."""
    out = tmp_path_factory.mktemp("local") / "out"
    result = cli("batch", str(manifest), "-o", str(out), "-m", tiny(), "-f", "all")
    return result, out


def manifest_paths(manifest: Path) -> list[str]:
    return manifest.read_text().split()


def summary(out: Path, name: str = "summary.jsonl") -> dict[str, dict]:
    lines = (out / name).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len({r["path"] for r in records}) == len(records), "one line per input"
    return {r["path"]: r for r in records}


def comparable(path: Path) -> str | dict:
    """A file's content; JSON and JSONL without the wall-clock timings."""
    text = path.read_text()
    if path.suffix in (".json", ".jsonl"):
        (data,) = jsonl_records(text) if path.suffix == ".jsonl" else [json.loads(text)]
        data.pop("timings")
        return data
    return text


def outputs(out: Path) -> dict[str, str | dict]:
    return {
        p.name: comparable(p) for p in sorted(out.iterdir()) if not p.name.startswith("summary")
    }


def assert_written_like_transcribe(out: Path, transcribed: Path, paths: list[str]) -> None:
    """Every file's outputs as `whisper-cli transcribe FILE --format all` writes them."""
    for path in paths:
        for fmt in FORMATS:
            name = f"{Path(path).stem}.{fmt}"
            assert comparable(out / name) == comparable(transcribed / name), name


def assert_no_partial_files(out: Path) -> None:
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temp files left"


# --- manifests and shards --------------------------------------------------------------


def test_manifest_kinds(tmp_path: Path) -> None:
    (tmp_path / "audio" / "sub").mkdir(parents=True)
    for name in ("b.wav", "sub/a.flac", "notes.txt"):
        (tmp_path / "audio" / name).write_bytes(b"")
    found = read_manifest(str(tmp_path / "audio"))
    assert [it.key for it in found] == ["b.wav", "sub/a.flac"]  # recursive, audio only
    assert found[1].path == str(tmp_path / "audio" / "sub" / "a.flac")
    assert [it.output for it in found] == ["b", "sub/a"]  # the tree below the directory

    text = tmp_path / "list.txt"
    text.write_text("# clips\nx.wav\n\n/abs/y.mp3\nx.wav\ns3://bucket/z.flac\n")
    with pytest.raises(WhisperCliError, match="s3fs"):
        read_manifest(str(text))  # the s3 filesystem package is not installed here
    text.write_text("# clips\nx.wav\n\n/abs/y.mp3\nx.wav\n")
    found = read_manifest(str(text))
    assert [it.path for it in found] == [str(tmp_path / "x.wav"), "/abs/y.mp3"]
    # Below the folder that holds them all: here the filesystem's root.
    assert [it.output for it in found] == [f"{tmp_path.relative_to('/')}/x", "abs/y"]
    text.write_text("calls/a/x.wav\ncalls/b/x.wav\n")
    assert [it.output for it in read_manifest(str(text))] == ["a/x", "b/x"]
    text.write_text("memory://bucket/2024/a/x.wav\nmemory://bucket/2024/b/y.wav\n")
    assert [it.output for it in read_manifest(str(text))] == ["a/x", "b/y"]

    jsonl = tmp_path / "list.jsonl"
    jsonl.write_text(
        '{"path": "a.wav", "language": "de", "task": "translate", "ref": "..."}\n'
        '{"path": "b.wav"}\n'
        '{"path": "c/b.wav", "output": "calls/./2024/b"}\n'
    )
    assert read_manifest(str(jsonl)) == [
        Item(str(tmp_path / "a.wav"), "a.wav", "de", "translate", "a"),
        Item(str(tmp_path / "b.wav"), "b.wav", output="b"),
        Item(str(tmp_path / "c/b.wav"), "c/b.wav", output="calls/2024/b"),
    ]
    for bad in ("../x", "calls/../../x", "/tmp/x", ".", ""):
        jsonl.write_text(f'{{"path": "a.wav"}}\n{{"path": "b.wav", "output": "{bad}"}}\n')
        with pytest.raises(WhisperCliError, match=r'line 2: "output" .* outside --output-dir'):
            read_manifest(str(jsonl))
    jsonl.write_text('{"path": "a.wav"}\n{"path": "b.wav", "task": "summarise"}\n')
    with pytest.raises(WhisperCliError, match=r"line 2: invalid task 'summarise'"):
        read_manifest(str(jsonl))
    jsonl.write_text('{"path": "a.wav"}\n{"file": "b.wav"}\n')
    with pytest.raises(WhisperCliError, match=r'line 2: expected an object with a "path"'):
        read_manifest(str(jsonl))


def test_shards_are_disjoint_and_cover_the_manifest(tmp_path: Path) -> None:
    items = [Item(f"/data/{i}.wav", f"{i}.wav") for i in range(500)]
    for count in (1, 3, 8):
        shards = [shard_items(items, (i, count)) for i in range(count)]
        keys = [it.key for shard in shards for it in shard]
        assert sorted(keys) == sorted(it.key for it in items)  # disjoint and covering
        assert all(len(s) > 500 / count / 2 for s in shards)  # no shard left (nearly) empty
        # Stable: by name, whatever the order or the folder the manifest is read from.
        moved = [Item(f"/mnt{it.path}", it.key) for it in reversed(items)]
        assert [{it.key for it in shard_items(moved, (i, count))} for i in range(count)] == [
            {it.key for it in s} for s in shards
        ]
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "1", "-1/3", "a/b", "0/0"):
        with pytest.raises(WhisperCliError, match="--shard"):
            parse_shard(bad)


@pytest.mark.usefixtures("cached_cli_models")
def test_shard_runs_into_one_directory(tmp_path: Path) -> None:
    """Two shard jobs into one directory: each its own summary, together the manifest."""
    manifest = tmp_path / "m.txt"
    names = [f"{tmp_path}/missing{i}.wav" for i in range(12)]  # fail fast: no decoding
    manifest.write_text("\n".join(names))
    out = tmp_path / "out"
    parts = []
    for i in range(2):
        result = cli("batch", str(manifest), "-o", str(out), "-m", tiny(), "--shard", f"{i}/2")
        assert result.exit_code == 1, result.stderr
        parts.append(set(summary(out, f"summary.{i}-of-2.jsonl")))
    assert parts[0] and parts[1] and not parts[0] & parts[1]
    assert parts[0] | parts[1] == set(names)
    assert not (out / "summary.jsonl").exists()


# --- the local engine ------------------------------------------------------------------


def test_local_engine_writes_like_transcribe(manifest: Path, transcribed: Path, local_run) -> None:
    result, out = local_run
    assert result.exit_code == 1, result.stderr  # the corrupt input failed, alone
    *good, corrupt = manifest_paths(manifest)
    assert f"whisper-cli: error: {corrupt}: " in result.stderr
    # tiny.en runs past --max-new-tokens in the German half of multilingual.mp3
    assert "4 written, 1 with warnings, 1 failed" in result.stderr
    records = summary(out)
    assert list(records) == manifest_paths(manifest)  # in manifest order
    assert records[corrupt]["status"] == "failed" and corrupt in records[corrupt]["error"]
    for path in good:
        r = records[path]
        assert (r["status"], r["error"], r["language"]) == ("ok", None, "en"), r
        assert r["duration"] > 3 and r["wall"] > 0
    assert_written_like_transcribe(out, transcribed, good)
    assert_no_partial_files(out)


@pytest.mark.usefixtures("cached_cli_models")
def test_local_engine_resumes(manifest: Path, local_run, tmp_path: Path) -> None:
    """A second run redoes only what is missing: here the corrupt input, failed again."""
    _, done = local_run
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "jfk.srt").unlink()  # as if killed between jfk's formats
    (out / ".jfk.srt.abc123.tmp").write_text("1\n00:00")  # and while writing one
    before = summary(out)
    again = cli("batch", str(manifest), "-o", str(out), "-m", tiny(), "-f", "all")
    assert again.exit_code == 1
    assert "3 of 5 input(s) already done, 2 to transcribe" in again.stderr
    after = summary(out)
    jfk = next(p for p in manifest_paths(manifest) if p.endswith("/jfk.flac"))
    assert {p: r for p, r in after.items() if p != jfk} == {
        p: r for p, r in before.items() if p != jfk
    }
    assert (
        after[jfk]["status"] == "ok"
        and (out / "jfk.srt").read_text() == (done / "jfk.srt").read_text()
    )
    assert_no_partial_files(out)


@pytest.mark.usefixtures("cached_cli_models")
def test_per_input_language_and_task(tmp_path: Path) -> None:
    """JSONL options: an input that asks tiny.en to translate fails alone, with the reason."""
    jfk = str(tmp_path / "jfk.flac")
    shutil.copy(shared_clip("jfk.flac"), jfk)
    copy = tmp_path / "jfk2.flac"
    shutil.copy(jfk, copy)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        json.dumps({"path": jfk, "language": "en"})
        + "\n"
        + json.dumps({"path": str(copy), "task": "translate"})
        + "\n"
    )
    out = tmp_path / "out"
    result = cli("batch", str(manifest), "-o", str(out), "-m", tiny())
    assert result.exit_code == 1
    records = summary(out)
    assert records[jfk]["status"] == "ok"
    assert records[str(copy)]["status"] == "failed"
    assert "English-only model; it cannot translate" in records[str(copy)]["error"]
    assert (out / "jfk.txt").exists() and not (out / "jfk2.txt").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus tree whose two files share a name: a/x.wav ("And so my fellow Americans")
    and b/x.wav ("ask not what your country can do for you"), cut from jfk.flac."""
    root = tmp_path_factory.mktemp("corpus")
    audio, rate = sf.read(shared_clip("jfk.flac"))
    for folder, (start, end) in (("a", (0.0, 3.5)), ("b", (3.5, 8.5))):
        (root / folder).mkdir()
        sf.write(root / folder / "x.wav", audio[int(start * rate) : int(end * rate)], rate)
    return root


def assert_mirrored(out: Path, fmt: str = "txt") -> None:
    """Each x.wav of the corpus transcribed into its own folder below out."""
    assert "Americans" in (out / "a" / f"x.{fmt}").read_text()
    assert "country" in (out / "b" / f"x.{fmt}").read_text()
    assert not (out / f"x.{fmt}").exists()


@pytest.mark.usefixtures("cached_cli_models")
def test_batch_mirrors_the_manifests_tree(corpus: Path, tmp_path: Path) -> None:
    """a/x.wav and b/x.wav go to out/a/x.* and out/b/x.*, whatever the kind of manifest;
    a second run skips both."""
    (tmp_path / "list.txt").write_text(f"{corpus}/a/x.wav\n{corpus}/b/x.wav\n")
    (tmp_path / "list.jsonl").write_text(
        json.dumps({"path": f"{corpus}/a/x.wav"}) + "\n" + json.dumps({"path": f"{corpus}/b/x.wav"})
    )
    for n, manifest in enumerate(
        (str(corpus), *(str(tmp_path / m) for m in ("list.txt", "list.jsonl")))
    ):
        out = tmp_path / f"out{n}"
        result = cli("batch", manifest, "-o", str(out), "-m", tiny())
        assert result.exit_code == 0, result.stderr
        # Progress at the run's scale: seconds here, not "0.00 h".
        assert "whisper-cli: 2/2 inputs (0 failed), 8.5 s audio, RTFx " in result.stderr
        assert re.search(
            r"2 written, 0 failed, 0 already done, 8\.5 s of audio in [\d.]+ s", result.stderr
        )
        assert_mirrored(out)
        records = summary(out)
        assert [r["status"] for r in records.values()] == ["ok", "ok"], manifest
    again = cli("batch", str(corpus), "-o", str(out), "-m", tiny())
    assert again.exit_code == 0, again.stderr
    assert "2 of 2 input(s) already done, 0 to transcribe" in again.stderr
    assert [r["status"] for r in summary(out).values()] == ["ok", "ok"]


def test_batch_refuses_an_output_outside_its_directory(corpus: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "list.jsonl"
    manifest.write_text(
        json.dumps({"path": f"{corpus}/a/x.wav"})
        + "\n"
        + json.dumps({"path": f"{corpus}/b/x.wav", "output": "../x"})
        + "\n"
    )
    out = tmp_path / "out"
    result = cli("batch", str(manifest), "-o", str(out), "-m", tiny())
    assert result.exit_code == 2
    assert f"{manifest}, line 2: \"output\" '../x' would be written outside" in result.stderr
    assert not out.exists() and not (tmp_path / "x.txt").exists()


def test_batch_still_refuses_two_inputs_of_one_name(tmp_path: Path) -> None:
    """a/x.wav and a/x.mp3: one would overwrite the other, mirrored or not."""
    manifest = tmp_path / "list.txt"
    manifest.write_text("a/x.wav\na/x.mp3\n")
    result = cli("batch", str(manifest), "-o", str(tmp_path / "out"), "-m", tiny())
    assert result.exit_code == 2
    assert "a/x.wav and " in result.stderr and "would both be written to" in result.stderr
    assert str(tmp_path / "out" / "x.txt") in result.stderr


@pytest.mark.usefixtures("cached_cli_models")
def test_fsspec_urls(tmp_path: Path) -> None:
    """A manifest and inputs behind URLs (fsspec's memory filesystem), read into the worker."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/clips/jfk.flac", shared_clip("jfk.flac").read_bytes())
    fs.pipe("/clips/list.txt", b"jfk.flac\nmissing.flac\n")
    out = tmp_path / "out"
    result = cli("batch", "memory://clips/list.txt", "-o", str(out), "-m", tiny(), "-f", "json")
    assert result.exit_code == 1, result.stderr
    records = summary(out)
    assert records["memory://clips/jfk.flac"]["status"] == "ok"
    assert (
        "memory://clips/missing.flac: cannot read"
        in records["memory://clips/missing.flac"]["error"]
    )
    written = json.loads((out / "jfk.json").read_text())
    assert written["path"] == "memory://clips/jfk.flac"
    assert "ask not what your country can do for you" in written["text"]

    result = cli("batch", "s3://bucket/list.txt", "-o", str(out), "-m", tiny())
    assert result.exit_code == 2
    assert "s3fs" in result.stderr and "Traceback" not in result.stderr


def test_usage_errors(manifest: Path, tmp_path: Path, monkeypatch) -> None:
    out = str(tmp_path / "out")
    result = cli("batch", str(manifest), "-o", out, "--workers", "2")
    assert result.exit_code == 2 and "need --engine ray" in result.stderr
    result = cli("batch", str(tmp_path / "nowhere.txt"), "-o", out)
    assert result.exit_code == 2 and "cannot read manifest" in result.stderr
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    result = cli("batch", str(manifest), "-o", out, "--engine", "ray")
    assert result.exit_code == 2 and "pip install 'whisper-cli[ray]'" in result.stderr


# --- the Ray engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """A local two-CPU cluster, shared by the Ray tests (the batch runs reuse it)."""
    if IN_CI:
        import ray
    else:
        ray = pytest.importorskip("ray", reason="pip install 'whisper-cli[ray]'")
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error")
    yield ray
    ray.shutdown()


@pytest.mark.slow  # ~40 s on an idle 2-core machine: two runs of fresh actors
def test_ray_engine(ray_cluster, manifest: Path, transcribed: Path, local_run, tmp_path) -> None:
    """Same outputs as transcribe and the local engine; interrupted, then resumed."""
    *good, corrupt = manifest_paths(manifest)
    out = tmp_path / "ray"

    # Interrupted after the first input is written (as Ctrl-C stops the CLI's callbacks),
    # one input per Ray batch.
    def stop(record) -> None:
        if record.status == "ok":
            raise KeyboardInterrupt

    config = BatchConfig(str(manifest), out, "all", tiny(), engine="ray")
    with pytest.raises(KeyboardInterrupt):
        run_batch(config, lambda device: TranscribeOptions(batch_size=1), stop)
    assert_no_partial_files(out)
    complete = {p for p in good if all((out / f"{Path(p).stem}.{f}").exists() for f in FORMATS)}
    assert 1 <= len(complete) < len(good), complete
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.stem != "summary"}

    result = cli(
        "batch", str(manifest), "-o", str(out), "-m", tiny(), "-f", "all", "--engine", "ray"
    )
    assert result.exit_code == 1, result.stderr
    missing = len(good) + 1 - len(complete)
    assert f"{len(complete)} of 5 input(s) already done, {missing} to transcribe" in result.stderr
    # multilingual.mp3 has a warning (text cut), if it is among those left to do
    assert re.search(rf"{missing - 1} written, (1 with warnings, )?1 failed", result.stderr)
    records = summary(out)
    assert list(records) == manifest_paths(manifest)
    assert records[corrupt]["status"] == "failed"
    assert {p for p in good if records[p]["status"] == "ok"} | complete == set(good)
    for name, mtime in written.items():
        if name.split(".")[0] in {Path(p).stem for p in complete}:
            assert (out / name).stat().st_mtime_ns == mtime, f"{name} was written again"
    assert_no_partial_files(out)
    assert_written_like_transcribe(out, transcribed, good)

    _, local = local_run
    assert outputs(local) == outputs(out)
    assert summary(local)[corrupt] == records[corrupt]


def test_ray_worker_that_cannot_start_is_a_run_level_error(ray_cluster, manifest, tmp_path):
    """The actors' model load fails: exit 2 with the loader's own message, no traceback."""
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    out = tmp_path / "out"
    result = cli("batch", str(manifest), "-o", str(out), "-m", str(not_a_model), "--engine", "ray")
    assert result.exit_code == 2, result.stderr
    assert f"error: model directory {not_a_model} is missing config.json" in result.stderr
    assert "Traceback" not in result.stderr
    assert summary(out) == {}  # nothing was done, nothing is claimed


@pytest.mark.slow  # ~40 s: a Ray cluster of its own starts, and its actor loads the model
def test_ray_engine_mirrors_the_tree_and_is_quiet(corpus: Path, tmp_path: Path) -> None:
    """`batch --engine ray -q` as a user runs it, in a process (and local cluster) of its
    own: nothing on stderr, from whisper-cli or from Ray's C++ core (which writes to the
    process's stderr directly, and once per process)."""
    if not IN_CI:
        pytest.importorskip("ray", reason="pip install 'whisper-cli[ray]'")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1]),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    args = [
        "batch",
        str(corpus),
        "-o",
        str(out),
        "-m",
        tiny(),
        "--engine",
        "ray",
        "--workers",
        "1",
        "-q",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "whisper_cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert_mirrored(out)


def our_ray_actors() -> list[int]:
    """Pids of the batch actors of the cluster this process started (raylet's children)."""

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            pid = int(entry.name)
            if cmdline.startswith(b"ray::WhisperWorker") and os.getpid() in (
                parent(pid),
                parent(parent(pid)),
            ):
                found.append(pid)
        except (ValueError, OSError):
            continue
    return found


@pytest.mark.slow  # ~30 s: a second actor starts and loads the model
def test_ray_actor_killed_mid_run_is_restarted(ray_cluster, manifest, transcribed, tmp_path):
    """SIGKILL the actor once an input is written: Ray restarts it and retries its batch."""
    *good, corrupt = manifest_paths(manifest)
    out = tmp_path / "out"
    killed: list[int] = []

    def kill_the_actor() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            if out.is_dir() and any(p.suffix == ".tsv" for p in out.iterdir()):
                for pid in our_ray_actors():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_actor, daemon=True)
    killer.start()
    args = ["batch", str(manifest), "-o", str(out), "-m", tiny(), "-f", "all"]
    result = cli(*args, "--engine", "ray", "--batch-size", "1")
    killer.join(timeout=1)
    assert killed, "no actor was killed"
    assert result.exit_code == 1, result.stderr
    records = summary(out)
    assert list(records) == manifest_paths(manifest)
    assert [records[p]["status"] for p in good] == ["ok"] * len(good)
    assert records[corrupt]["status"] == "failed"
    assert_written_like_transcribe(out, transcribed, good)
    assert_no_partial_files(out)


# --- one option model: batch takes transcribe's transcription options --------------------


def _params(command: str) -> dict[str, object]:
    import typer.main

    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


def test_batch_takes_every_transcription_option_of_transcribe() -> None:
    """The two commands' options, but each one's own, are the same flags, with the same
    defaults and help: a transcription option added to one is in the other."""
    transcribe_only = {"inputs", "recursive", "skip_existing", "verbose", "latency"}
    batch_only = {"manifest", "engine", "ray_address", "workers", "gpus_per_worker", "shard"}
    transcribe, batch = _params("transcribe"), _params("batch")
    assert set(transcribe) - transcribe_only == set(batch) - batch_only
    assert {"word_timestamps", "max_line_width", "max_line_count", "highlight_words"} <= set(batch)
    for name in set(transcribe) & set(batch) - {"output_dir"}:  # -o: a folder of its own
        t, b = transcribe[name], batch[name]
        assert (t.opts, t.default, t.help) == (b.opts, b.default, b.help), name


@pytest.mark.usefixtures("cached_cli_models")
def test_batch_word_timestamps_give_word_level_json(tmp_path: Path) -> None:
    manifest = tmp_path / "inputs.txt"
    manifest.write_text(f"{shared_clip('jfk.flac')}\n")
    out = tmp_path / "out"
    result = cli(
        "batch", str(manifest), "-o", str(out), "-m", tiny(), "-f", "all", "--word-timestamps",
        "--max-line-width", "20", "--max-line-count", "1",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    segments = json.loads((out / "jfk.json").read_text())["segments"]
    words = [w for s in segments for w in s["words"]]
    assert [w["word"].strip(" ,.") for w in words[:5]] == ["And", "so", "my", "fellow", "Americans"]
    for s in segments:
        assert all(s["start"] <= w["start"] <= w["end"] <= s["end"] for w in s["words"]), s
    cues = (out / "jfk.srt").read_text().split("\n\n")
    text_lines = [c.splitlines()[2:] for c in cues if c.strip()]
    assert all(len(lines) == 1 and len(lines[0]) <= 20 for lines in text_lines), text_lines
