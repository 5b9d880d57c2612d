"""Transcribe a manifest of inputs into an output directory: resumable, shardable, on Ray.

A manifest (a directory, a text file of paths, or JSONL with `path` and optional
`language`/`task`/`output`) becomes a list of items, each with the name of its outputs
below the output directory: the outputs mirror the manifest's tree. `--shard I/N` keeps
a stable part of it; items whose outputs all exist are skipped. The rest go to a
`Worker`, which holds one loaded model and runs the existing pipeline, writing each
input's outputs itself as soon as it is decoded. The local engine runs one Worker in
this process; the Ray engine runs one per actor and hands the actors batches of items
(audio is read inside the actor, never shipped through the object store). Either way every
input ends as one line of `summary.jsonl`: written ("ok") or "failed" with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import posixpath
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from whisper_cli.errors import InputError, WhisperCliError
from whisper_cli.formats import SubtitleOptions
from whisper_cli.inputs import AUDIO_EXTENSIONS
from whisper_cli.options import TASKS
from whisper_cli.outputs import OutputPlan, temp_files, write_atomic
from whisper_cli.results import TranscriptWarning

if TYPE_CHECKING:
    from whisper_cli.loading import LoadedModel
    from whisper_cli.pipeline import TranscribeOptions, Transcriber
    from whisper_cli.results import Transcript

ENGINES = ("local", "ray")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# An actor that dies (killed, out of host memory, a crash in native code) is restarted and
# the batch it held is run again, this many times each; a batch that still fails is
# listed as failed input by input instead of failing the run.
ACTOR_RESTARTS = 3
BATCH_RETRIES = 3
# Batches handed to a Ray actor ahead of the one it runs: it starts the next one at once.
IN_FLIGHT = 2


@dataclass(frozen=True)
class Item:
    """One input of the manifest."""

    path: str  # as the manifest names it, joined to the manifest's folder when relative
    key: str  # what --shard hashes: the name inside the manifest (same on every machine)
    language: str | None = None  # overrides --language for this input
    task: str | None = None  # overrides --task for this input
    # Its outputs' name below --output-dir, without the format's extension ("a/x" for
    # a/x.wav); None: the input's stem.
    output: str | None = None


@dataclass(frozen=True)
class Record:
    """One line of summary.jsonl."""

    path: str
    status: str  # "ok": outputs written; "failed": see error; "skipped": outputs existed
    error: str | None = None
    duration: float | None = None  # seconds of audio
    language: str | None = None
    wall: float | None = None  # seconds this input took to decode
    # "ok" with warnings: written, but something was lost or is missing (the transcript's)
    warnings: tuple[TranscriptWarning, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Record:
        data = json.loads(line)
        found = tuple(TranscriptWarning(**w) for w in data.pop("warnings", None) or ())
        return cls(**data, warnings=found)


@dataclass(frozen=True)
class WorkerSpec:
    """What a Worker needs to build itself, on this machine or on any node of a cluster."""

    model: str | None  # None: the default model of the device the worker loads on
    dtype: str
    device: str
    options: TranscribeOptions
    plan: OutputPlan
    quantize: str = "none"


@dataclass(frozen=True)
class BatchProgress:
    done: int  # inputs finished in this run, failed ones included
    failed: int
    total: int  # inputs to process in this run (skipped ones not counted)
    audio_seconds: float  # audio decoded in this run
    elapsed: float  # seconds since the first input was handed out


@dataclass(frozen=True)
class BatchConfig:
    manifest: str
    output_dir: Path
    fmt: str  # as --format takes it (one format or "all")
    model: str | None  # None: the default of the device it loads on (options.default_model)
    dtype: str = "auto"
    quantize: str = "none"
    device: str = "auto"
    engine: str = "local"
    ray_address: str | None = None
    workers: int | None = None  # Ray actors; default: one per G GPUs, or one per node
    gpus_per_worker: float | None = None  # default: 1 where the cluster has GPUs, else 0
    shard: tuple[int, int] | None = None  # (I, N): this job's part of N
    subtitles: SubtitleOptions = field(default_factory=SubtitleOptions)  # word-timed cues


@dataclass(frozen=True)
class BatchReport:
    total: int  # inputs of this shard of the manifest
    skipped: int
    processed: int
    failed: int
    summary: Path
    audio_seconds: float = 0.0  # audio decoded in this run
    with_warnings: int = 0  # inputs written in this run whose records carry warnings
    elapsed: float = 0.0  # seconds from the first input handed out to the last one done


# --- manifests ---------------------------------------------------------------------------


def read_manifest(manifest: str) -> list[Item]:
    """The inputs a manifest names, in its order, each once.

    A directory (searched recursively for audio files, sorted), a JSONL file (`.jsonl`,
    or a first line that is a JSON object) with `path` and optional `language`, `task`
    and `output`, or a text file of paths (blank lines and `#` comments ignored). Relative
    paths are relative to the manifest's folder. fsspec URLs (s3://, gs://, ...) work for
    the manifest and for its entries where fsspec and that filesystem's package are
    installed.

    Each input's outputs keep its path relative to the directory, or to the folder that
    holds all the file's entries (a URL's path counts from below its bucket), so that
    a/x.wav and b/x.wav of one corpus go to a/x.* and b/x.*; a JSONL `output` names them
    itself.
    """
    items = _directory_items(manifest) if _is_dir(manifest) else _file_items(manifest)
    seen: set[str] = set()
    unique = []
    for item in items:
        if item.path not in seen:
            seen.add(item.path)
            unique.append(item)
    for item in unique:
        if _is_url(item.path):
            _filesystem(item.path)  # a missing filesystem package is a run-level error
    return unique


def _directory_items(root: str) -> list[Item]:
    if _is_url(root):
        fs, base = _filesystem(root)
        found = [p for p in fs.find(base) if _is_audio(p)]
        base = base.rstrip("/")
        keys = [(fs.unstrip_protocol(p), posixpath.relpath(p, base)) for p in sorted(found)]
    else:
        root_path = Path(root)
        found = sorted(p for p in root_path.rglob("*") if p.is_file() and _is_audio(p.name))
        if not found:
            raise WhisperCliError(f"{root}: directory contains no audio files")
        keys = [(str(p), p.relative_to(root_path).as_posix()) for p in found]
    return [Item(path, key, output=posixpath.splitext(key)[0]) for path, key in keys]


def _mirrored(items: list[Item]) -> list[Item]:
    """Items named by their path below the folder all of them lie in (but those that name
    their outputs themselves)."""
    unnamed = [_tree_path(it.path) for it in items if it.output is None]
    if not unnamed:
        return items
    root = posixpath.commonpath([posixpath.dirname(p) for p in unnamed])
    names = iter(posixpath.splitext(posixpath.relpath(p, root))[0] for p in unnamed)
    return [
        it if it.output is not None else dataclasses.replace(it, output=next(names)) for it in items
    ]


def _tree_path(path: str) -> str:
    """Where an entry lies in the tree its outputs mirror: a URL's path below its bucket,
    a local file's absolute path."""
    if _is_url(path):
        return "/" + urllib.parse.urlsplit(path).path.lstrip("/")
    return Path(os.path.abspath(path)).as_posix()


def _file_items(manifest: str) -> list[Item]:
    try:
        if _is_url(manifest):
            fs, path = _filesystem(manifest)
            with fs.open(path, "r", encoding="utf-8") as f:
                text = f.read()
        else:
            text = Path(manifest).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WhisperCliError(f"cannot read manifest {manifest}: {_reason(exc)}") from exc
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    jsonl = manifest.lower().endswith(JSONL_SUFFIXES) or (lines and lines[0][1].startswith("{"))
    items = [
        _jsonl_item(manifest, n, line) if jsonl else Item(_join(manifest, line), line)
        for n, line in lines
    ]
    if not items:
        raise WhisperCliError(f"manifest {manifest} names no inputs")
    return _mirrored(items)


def _jsonl_item(manifest: str, number: int, line: str) -> Item:
    where = f"{manifest}, line {number}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WhisperCliError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
        raise WhisperCliError(f'{where}: expected an object with a "path" string')
    for name in ("language", "task", "output"):
        if entry.get(name) is not None and not isinstance(entry[name], str):
            raise WhisperCliError(f'{where}: "{name}" must be a string')
    task = entry.get("task")
    if task is not None and task not in TASKS:
        raise WhisperCliError(f"{where}: invalid task {task!r}; choose {' or '.join(TASKS)}")
    output = entry.get("output")
    if output is not None:
        output = _output_name(where, output)
    path = entry["path"]
    return Item(_join(manifest, path), path, entry.get("language"), task, output)


def _output_name(where: str, name: str) -> str:
    """A JSONL entry's `output`, normalized: a relative name that stays inside -o."""
    normal = posixpath.normpath(name.replace("\\", "/"))
    if posixpath.isabs(normal) or os.path.isabs(name) or normal.split("/")[0] in ("..", "."):
        raise WhisperCliError(
            f'{where}: "output" {name!r} would be written outside --output-dir; '
            "give a relative name such as calls/2024/x"
        )
    return normal


def _join(manifest: str, entry: str) -> str:
    """URLs and absolute paths as they are; others from the manifest's folder."""
    if _is_url(entry) or os.path.isabs(entry):
        return entry
    if _is_url(manifest):
        return posixpath.join(posixpath.dirname(manifest), entry)
    return os.path.join(os.path.dirname(manifest), entry)


def shard_items(items: list[Item], shard: tuple[int, int] | None) -> list[Item]:
    """Shard I of N: the items whose key hashes to I (stable across runs and machines)."""
    if shard is None:
        return items
    index, count = shard
    return [it for it in items if _shard_of(it.key, count) == index]


def _shard_of(key: str, count: int) -> int:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` with 0 <= I < N (0-based, as Slurm array and Kubernetes job indexes are)."""
    index, sep, count = text.partition("/")
    if not (sep and index.strip().isdigit() and count.strip().isdigit()):
        raise WhisperCliError(f"invalid --shard {text!r}; expected I/N, e.g. 0/4")
    i, n = int(index), int(count)
    if n < 1 or i >= n:
        raise WhisperCliError(f"invalid --shard {text!r}: needs 0 <= I < N")
    return i, n


# --- the run ---------------------------------------------------------------------------


def run_batch(
    config: BatchConfig,
    make_options: Callable[[str], TranscribeOptions],
    on_record: Callable[[Record], None] | None = None,
    on_progress: Callable[[BatchProgress], None] | None = None,
    on_log: Callable[[str], None] | None = None,
) -> BatchReport:
    """Transcribe the config's manifest (this shard of it) into its output directory.

    ``make_options(device_type)`` gives the TranscribeOptions for a device type ("cpu" or
    "cuda"). Run-level problems raise WhisperCliError before any input is processed.
    """
    if config.engine not in ENGINES:
        raise WhisperCliError(f"invalid engine {config.engine!r}; choose local or ray")
    if config.engine == "local" and (
        config.ray_address or config.workers is not None or config.gpus_per_worker is not None
    ):
        raise WhisperCliError("--ray-address, --workers and --gpus-per-worker need --engine ray")
    log = on_log or (lambda message: None)
    if config.engine == "ray":
        _import_ray()  # before any work: it may not be installed
    # The workers' plan names no outputs: each item carries its own name to its worker.
    plan = OutputPlan.make(  # always "several" inputs
        config.fmt, config.output_dir, [], n_inputs=2, subtitles=config.subtitles
    )
    items = read_manifest(config.manifest)
    named = _named(plan, items)
    named.check_distinct([it.path for it in items])  # over the whole manifest: every shard
    items = shard_items(items, config.shard)
    summary = summary_path(config.output_dir, config.shard)
    previous = _read_summary(summary)
    records: dict[str, Record] = {}
    todo: list[Item] = []
    for item in items:
        if named.is_done(item.path):
            kept = previous.get(item.path)
            records[item.path] = (
                kept if kept and kept.status == "ok" else Record(item.path, "skipped")
            )
        else:
            todo.append(item)
    if records:
        log(f"{len(records)} of {len(items)} input(s) already done, {len(todo)} to transcribe")
    # Inputs with the same language and task share a Transcriber: keep them together.
    todo.sort(key=_options_key)

    config.output_dir.mkdir(parents=True, exist_ok=True)
    _write_summary(summary, [records[it.path] for it in items if it.path in records])
    failed = warned = 0
    audio = 0.0
    started = time.perf_counter()
    with open(summary, "a", encoding="utf-8") as out:

        def record(r: Record) -> None:
            nonlocal failed, warned, audio
            records[r.path] = r
            failed += r.status == "failed"
            warned += r.status == "ok" and bool(r.warnings)
            audio += r.duration or 0.0
            out.write(r.to_json() + "\n")
            out.flush()
            if on_record is not None:
                on_record(r)
            if on_progress is not None:
                done = len(records) - (len(items) - len(todo))
                on_progress(
                    BatchProgress(done, failed, len(todo), audio, time.perf_counter() - started)
                )

        if todo:
            engine = _run_local if config.engine == "local" else _run_ray
            engine(config, plan, make_options, todo, record, log)
        for item in todo:
            if item.path not in records:  # its batch failed past Ray's retries
                record(
                    Record(
                        item.path,
                        "failed",
                        f"{item.path}: its worker died {BATCH_RETRIES + 1} times "
                        "(see the Ray logs of the run)",
                    )
                )
    _write_summary(summary, [records[it.path] for it in items])
    elapsed = time.perf_counter() - started
    return BatchReport(
        len(items),
        len(items) - len(todo),
        len(todo),
        failed,
        summary,
        audio_seconds=audio,
        elapsed=elapsed,
        with_warnings=warned,
    )


def summary_path(output_dir: Path, shard: tuple[int, int] | None) -> Path:
    """summary.jsonl, or summary.I-of-N.jsonl: shards writing one directory never collide."""
    name = "summary.jsonl" if shard is None else f"summary.{shard[0]}-of-{shard[1]}.jsonl"
    return output_dir / name


def _read_summary(path: Path) -> dict[str, Record]:
    """The records of an earlier run; a line cut short by a kill is ignored."""
    records: dict[str, Record] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = Record.from_json(line)
            except (ValueError, TypeError):
                continue
            records[record.path] = record
    return records


def _write_summary(path: Path, records: Iterable[Record]) -> None:
    try:
        write_atomic(path, "".join(r.to_json() + "\n" for r in records))
    except OSError as exc:
        raise WhisperCliError(f"cannot write {path}: {_reason(exc)}") from exc


def _options_key(item: Item) -> tuple[str, str]:
    return item.language or "", item.task or ""


def _named(plan: OutputPlan, items: Iterable[Item]) -> OutputPlan:
    """The plan with these items' outputs named as the manifest names them."""
    return plan.with_names({it.path: it.output for it in items if it.output is not None})


# --- the worker: one model, many inputs --------------------------------------------------


class Worker:
    """Holds one loaded model; transcribes items and writes their outputs.

    Built once per Ray actor (WhisperWorker) or once in this process (the local engine). Items
    that override the language or task get a Transcriber of their own, built on first use
    and kept: TranscribeOptions are fixed per Transcriber, the model is shared by all.
    """

    def __init__(self, spec: WorkerSpec, loaded: LoadedModel | None = None) -> None:
        if loaded is None:
            from whisper_cli import loading
            from whisper_cli.dtypes import resolve_policy

            policy = resolve_policy(spec.dtype, spec.device, spec.quantize)
            loaded = loading.load_model(spec.model, policy, spec.options)
        self.spec = spec
        self.loaded = loaded
        self._transcribers: dict[tuple[str | None, str | None], Transcriber | WhisperCliError] = {}

    def process(self, items: list[Item], on_record: Callable[[Record], None]) -> None:
        """Transcribe the items, group by group of options; each ends as one record."""
        groups: dict[tuple[str | None, str | None], list[Item]] = {}
        for item in items:
            groups.setdefault((item.language, item.task), []).append(item)
        for key, group in groups.items():
            self._process_group(key, group, on_record)

    def _transcriber(self, key: tuple[str | None, str | None]) -> Transcriber:
        from whisper_cli.pipeline import Transcriber

        if key not in self._transcribers:
            language, task = key
            options = dataclasses.replace(
                self.spec.options,
                language=language or self.spec.options.language,
                task=task or self.spec.options.task,
            )
            try:
                self._transcribers[key] = Transcriber(self.loaded, options)
            except WhisperCliError as exc:  # e.g. a language this model does not know
                self._transcribers[key] = exc
        found = self._transcribers[key]
        if isinstance(found, WhisperCliError):
            raise found
        return found

    def _process_group(
        self, key: tuple[str | None, str | None], items: list[Item], on_record: Callable
    ) -> None:
        plan = _named(self.spec.plan, items)
        # Temp files of these outputs are left by a worker killed while writing them; this
        # call may be the retry of its batch.
        for item in items:
            for stale in (t for p in plan.paths(item.path) for t in temp_files(p)):
                stale.unlink(missing_ok=True)
        finished: set[str] = set()

        def finish(record: Record) -> None:
            finished.add(record.path)
            on_record(record)

        with tempfile.TemporaryDirectory(prefix="whisper-cli-") as scratch:
            local = _Localized(items, Path(scratch))
            for path, error in local.errors:
                finish(Record(path, "failed", error))

            def on_result(t: Transcript) -> None:
                t = dataclasses.replace(t, path=local.original[t.path])
                plan.emit(t, sys.stdout)
                wall = t.timings.get("wall")
                finish(Record(t.path, "ok", None, t.duration, t.language, wall, t.warnings))

            def on_error(err: InputError) -> None:
                path = local.original.get(err.path, err.path)
                finish(Record(path, "failed", f"{path}: {err.problem}"))

            try:
                self._transcriber(key).run(local.paths, on_result, on_error)
            except WhisperCliError as exc:  # cannot write the outputs, bad language, ...
                message = exc.message
            except Exception as exc:  # a bug: keep the run going, name it in the summary
                message = f"internal error: {type(exc).__name__}: {exc}"
            else:
                return
            for item in items:
                if item.path not in finished:
                    finish(Record(item.path, "failed", message))


class _Localized:
    """Items as local paths for the pipeline: URLs are first copied into ``scratch``."""

    def __init__(self, items: list[Item], scratch: Path) -> None:
        self.paths: list[str] = []
        self.original: dict[str, str] = {}  # local path -> the item's path
        self.errors: list[tuple[str, str]] = []
        for n, item in enumerate(items):
            local = item.path
            if _is_url(item.path):
                local = str(scratch / f"{n}-{posixpath.basename(item.path)}")
                try:
                    fs, remote = _filesystem(item.path)
                    fs.get_file(remote, local)
                except (OSError, WhisperCliError) as exc:
                    self.errors.append((item.path, f"{item.path}: cannot read: {_reason(exc)}"))
                    continue
            self.paths.append(local)
            self.original[local] = item.path


# --- engines -------------------------------------------------------------------------------


def _run_local(config, plan, make_options, todo, record, log) -> None:
    from whisper_cli import loading
    from whisper_cli.dtypes import resolve_policy

    policy = resolve_policy(config.dtype, config.device, config.quantize)
    options = make_options(policy.device.type)
    started = time.perf_counter()
    loaded = loading.load_model(config.model, policy, options)
    log(
        f"model {loaded.name} ({loaded.path}), dtype {policy.name}, device {policy.device} "
        f"[{time.perf_counter() - started:.1f} s]"
    )
    spec = WorkerSpec(loaded.name, config.dtype, config.device, options, plan, config.quantize)
    worker = Worker(spec, loaded)
    size = _files_per_call(spec.options.batch_size, len(todo), 1)
    for start in range(0, len(todo), size):
        worker.process(todo[start : start + size], record)


def _files_per_call(batch_size: int, n_inputs: int, workers: int) -> int:
    """Inputs handed to a worker at a time (and whose URLs are copied to its disk at once).

    As many as windows per batch, so that short files still fill a batch; fewer where
    that would leave a worker without any.
    """
    return max(1, min(batch_size, math.ceil(n_inputs / workers)))


def _import_ray():
    # Off unless the user turned them on: no usage report leaves the machine, no dashboard.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise WhisperCliError(
            "--engine ray needs Ray: pip install 'whisper-cli[ray]' (or 'ray')"
        ) from None
    return ray


def _run_ray(config, plan, make_options, todo, record, log) -> None:
    ray = _import_ray()
    with _ray_session(ray, config.ray_address, log):
        sizing = _size_actors(ray, config)
        log(
            f"Ray: {sizing.workers} worker(s), {sizing.cpus:g} CPU and {sizing.gpus:g} GPU "
            f"each, model loaded once per worker"
        )
        device = config.device
        if device == "auto":
            device = "cuda" if sizing.gpus > 0 else "cpu"
        elif device.startswith("cuda") and sizing.gpus == 0:
            raise WhisperCliError("--device cuda with --engine ray needs --gpus-per-worker")
        device_type = "cuda" if device.startswith("cuda") else "cpu"
        spec = WorkerSpec(
            config.model, config.dtype, device, make_options(device_type), plan, config.quantize
        )
        per_call = _files_per_call(spec.options.batch_size, len(todo), sizing.workers)
        batches = [todo[start : start + per_call] for start in range(0, len(todo), per_call)]
        # A restarted actor runs its constructor again with the arguments it was created
        # with. Ray keeps those safe only when they travel inside the creation task itself
        # (ray-project/ray#53727): the spec is a few small values (names, options, the
        # plan without any input's name), never an object in the object store.
        actor = ray.remote(
            num_cpus=sizing.cpus,
            num_gpus=sizing.gpus,
            max_restarts=ACTOR_RESTARTS,
            max_task_retries=BATCH_RETRIES,
        )(WhisperWorker)
        actors = [actor.remote(spec) for _ in range(min(sizing.workers, len(batches)))]
        try:
            _dispatch(ray, actors, batches, record)
        finally:
            for a in actors:  # also those still busy when the run is interrupted
                ray.kill(a)


def _dispatch(ray, actors: list, batches: list[list[Item]], record: Callable) -> None:
    """Hand the batches out to the actors, IN_FLIGHT at a time each, as they finish theirs.

    A batch whose actor died past its restarts and retries is dropped (run_batch lists its
    inputs as failed), and that actor is given no more.
    """
    pending = list(reversed(batches))
    running: dict = {}  # ObjectRef of a call -> the actor that runs it

    def submit(a) -> None:
        if pending:
            running[a.process.remote(pending.pop())] = a

    for _ in range(IN_FLIGHT):
        for a in actors:
            submit(a)
    while running:
        (done,), _ = ray.wait(list(running), num_returns=1)
        a = running.pop(done)
        try:
            records = ray.get(done)
        except ray.exceptions.ActorDiedError:
            continue
        if isinstance(records, str):
            raise WhisperCliError(records)
        for r in records:
            record(r)
        submit(a)


@dataclass(frozen=True)
class _Sizing:
    workers: int
    cpus: float
    gpus: float


def _size_actors(ray, config: BatchConfig) -> _Sizing:
    """How many actors, with what resources each, from the cluster's resources.

    GPU: G GPUs and one CPU (reading and resampling audio) per actor, as many actors as
    the cluster's GPUs hold. CPU only: one actor per node by default; the CPUs are shared
    out evenly (torch runs as many threads as the CPUs Ray gives it, via
    OMP_NUM_THREADS), within what the smallest node has.
    """
    resources = ray.cluster_resources()
    gpus = config.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if resources.get("GPU", 0) > 0 else 0.0
    if gpus < 0:
        raise WhisperCliError("--gpus-per-worker must be 0 or more")
    if gpus > 0:
        workers = config.workers or max(1, int(resources.get("GPU", 0) // gpus))
        sizing = _Sizing(workers, 1.0, gpus)
    else:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        node_cpus = min((n["Resources"].get("CPU", 1) for n in nodes), default=1)
        workers = config.workers or max(1, len(nodes))
        cpus = max(1, min(node_cpus, resources.get("CPU", 1) // workers))
        sizing = _Sizing(workers, float(cpus), 0.0)
    # A pool that cannot all start would wait for resources that never come.
    for name, each in (("GPU", sizing.gpus), ("CPU", sizing.cpus)):
        have = resources.get(name, 0)
        if sizing.workers * each > have:
            raise WhisperCliError(
                f"{sizing.workers} worker(s) with {each:g} {name} each need "
                f"{sizing.workers * each:g} {name}s; the Ray cluster has {have:g}"
            )
    return sizing


@contextlib.contextmanager
def _ray_session(ray, address: str | None, log: Callable[[str], None]) -> Iterator[None]:
    """Connect to the cluster at ``address``, or start a local one; reuse one already up."""
    if ray.is_initialized():
        yield
        return
    # Ray's own notices stay in its log files; the run's progress and errors are
    # reported by whisper-cli.
    kwargs = {"log_to_driver": False, "logging_level": "error"}
    if address is None:
        kwargs["include_dashboard"] = False  # a cluster of our own: no dashboard
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise WhisperCliError(f"cannot connect to the Ray cluster at {address}: {exc}") from None
    log(f"Ray {'cluster at ' + address if address else 'local cluster started'}")
    try:
        yield
    finally:
        ray.shutdown()


class WhisperWorker:
    """A Worker as a Ray actor.

    One that cannot start (model not found, dtype or device unsupported) answers every
    batch with the error, which the driver raises as a run-level error: Ray only passes
    on the text of an exception raised while an actor starts.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.error: str | None = None
        try:
            self.worker = Worker(spec)
        except WhisperCliError as exc:
            self.error = exc.message

    def process(self, items: list[Item]) -> list[Record] | str:
        """The items' records; or, from an actor that could not start, why."""
        if self.error is not None:
            return self.error
        records: list[Record] = []
        self.worker.process(items, records.append)
        return records


# --- paths and URLs -------------------------------------------------------------------


def _is_url(path: str) -> bool:
    return "://" in path


def _is_dir(path: str) -> bool:
    if _is_url(path):
        fs, base = _filesystem(path)
        return fs.isdir(base)
    return Path(path).is_dir()


def _is_audio(name: str) -> bool:
    return posixpath.splitext(name)[1].lower() in AUDIO_EXTENSIONS


def _filesystem(url: str):
    """(filesystem, path) for an fsspec URL; a clear error where a package is missing."""
    protocol = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise WhisperCliError(
            f"{url}: reading {protocol}:// URLs needs fsspec and its {protocol} package "
            "(e.g. pip install fsspec s3fs, or gcsfs for gs://)"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec names the package to install
        raise WhisperCliError(f"{url}: {exc}") from None
    except ValueError as exc:  # an unknown protocol
        raise WhisperCliError(f"{url}: {exc}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, WhisperCliError):
        return exc.message
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


__all__ = [
    "BatchConfig",
    "BatchProgress",
    "BatchReport",
    "Item",
    "Record",
    "Worker",
    "WorkerSpec",
    "parse_shard",
    "read_manifest",
    "run_batch",
    "shard_items",
]
