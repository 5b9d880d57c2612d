"""The CLI as it runs in a terminal: stderr (and stdout, unless redirected) on a real pty.

Every interactive run crashed once (the progress bar formatted a total of None) while all
in-process and piped tests passed: these tests run the installed console script with a
pseudo-terminal as its controlling output, as a user types the command.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from test_cli import JFK_PHRASE, whisper_cli_command
from test_longform import english
from util import REPO, real_model, shared_clip

HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


class Terminal:
    """What a command run under `sh -c` on a fresh pty wrote there, and how it exited."""

    def __init__(self, command: str, *, interrupt_after: str | None = None, cols: int = 100):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, cols, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols)}
        for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
            env.pop(name, None)
        proc = subprocess.Popen(
            ["sh", "-c", command],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        received = b""
        deadline = time.monotonic() + 600
        interrupted = False
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not data:
                    break
                received += data
            if (
                interrupt_after is not None
                and not interrupted
                and interrupt_after.encode() in received
            ):
                os.killpg(proc.pid, signal.SIGINT)
                interrupted = True
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        self.returncode = proc.wait(timeout=60)
        os.close(master)
        self.raw = received.decode("utf-8", "replace")
        self.text = _ANSI.sub("", self.raw)

    def assert_bar_drawn_and_cursor_restored(self) -> None:
        assert HIDE_CURSOR in self.raw, self.text  # the bar was drawn (Rich hides the cursor)
        assert "s audio" in self.text and "transcribing" in self.text, self.text
        assert self.raw.rfind(SHOW_CURSOR) > self.raw.rfind(HIDE_CURSOR), self.raw[-500:]
        assert "internal error" not in self.text and "Traceback" not in self.text, self.text


def exe() -> str:
    return shlex.join(whisper_cli_command())


def tiny() -> str:
    return shlex.quote(str(real_model("tiny.en")))


def jfk() -> str:
    return shlex.quote(str(shared_clip("jfk.flac")))


def test_transcript_on_the_terminal_with_the_progress_bar() -> None:
    term = Terminal(f"exec {exe()} transcribe {jfk()} --model {tiny()}")
    assert term.returncode == 0, term.text
    term.assert_bar_drawn_and_cursor_restored()
    assert JFK_PHRASE in english(term.text)


def test_redirected_stdout_holds_the_transcript_while_the_bar_draws(tmp_path: Path) -> None:
    out = tmp_path / "jfk.srt"
    term = Terminal(f"exec {exe()} transcribe {jfk()} --model {tiny()} -f srt > {out}")
    assert term.returncode == 0, term.text
    term.assert_bar_drawn_and_cursor_restored()
    srt = out.read_text()
    assert srt.startswith("1\n00:00:00,000 --> ") and JFK_PHRASE in english(srt)
    assert "-->" not in term.text  # the subtitles went to the file, not the terminal


def test_stdin_input_on_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    term = Terminal(f"cat {jfk()} | {exe()} transcribe - --model {tiny()} > {out}")
    assert term.returncode == 0, term.text
    term.assert_bar_drawn_and_cursor_restored()
    assert JFK_PHRASE in english(out.read_text())


def test_several_files_a_failure_and_the_summary_on_a_terminal(tmp_path: Path) -> None:
    hotwords = shlex.quote(str(shared_clip("hotwords.mp3")))
    missing = tmp_path / "missing.wav"
    term = Terminal(f"exec {exe()} transcribe {jfk()} {missing} {hotwords} --model {tiny()}")
    assert term.returncode == 1, term.text
    term.assert_bar_drawn_and_cursor_restored()
    assert f"==> {shared_clip('jfk.flac')} <==" in term.text
    assert f"==> {shared_clip('hotwords.mp3')} <==" in term.text
    assert JFK_PHRASE in term.text  # (english() would drop the text between <== and ==>)
    assert f"whisper-cli: error: {missing}: no such file" in term.text
    assert re.search(r"whisper-cli: 2 written, 1 failed, 15 s of audio in [\d.]+ s", term.text)


def test_ctrl_c_on_a_terminal_restores_the_cursor(tmp_path: Path) -> None:
    long = tmp_path / "long.flac"
    import numpy as np
    import soundfile as sf

    samples, rate = sf.read(shared_clip("jfk.flac"), dtype="float32")
    sf.write(long, np.concatenate([samples] * 12), rate)  # 2 min: still decoding at Ctrl-C
    term = Terminal(f"exec {exe()} transcribe {long} --model {tiny()}", interrupt_after="s audio")
    assert term.returncode == 130, term.text
    assert HIDE_CURSOR in term.raw
    assert term.raw.rfind(SHOW_CURSOR) > term.raw.rfind(HIDE_CURSOR), term.raw[-500:]
    assert "whisper-cli: interrupted" in term.text


PROGRESS_WITHOUT_TOTAL = """
import time
from whisper_cli.cli import _Terminal
from whisper_cli.pipeline import Progress

term = _Terminal(quiet=False, verbose=False)
with term.progress(1, None):  # a stream whose length no header gives
    for i in range(1, 4):
        term.update(Progress(audio_done=30.0 * i, audio_total=0.0, elapsed=0.2 * i))
        time.sleep(0.3)
    term.warning("a warning while the bar is drawn")
print("done")
"""


def test_progress_bar_without_a_known_total(tmp_path: Path) -> None:
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS_WITHOUT_TOTAL)
    term = Terminal(f"exec {shlex.quote(sys.executable)} {script}")
    assert term.returncode == 0, term.text
    assert "90 s audio" in term.text and "150.0x real time" in term.text, term.text
    assert "whisper-cli: warning: a warning while the bar is drawn" in term.text
    assert term.raw.rfind(SHOW_CURSOR) > term.raw.rfind(HIDE_CURSOR)
    assert term.text.rstrip().endswith("done")


def _long_speech(path: Path) -> float:
    """The shared clips one after another, twice the long one: about 2.5 min of speech."""
    import numpy as np
    import soundfile as sf

    from whisper_cli.audio import SAMPLE_RATE, load_audio

    names = ("jfk.flac", "multilingual.mp3", "hotwords.mp3", "multilingual.mp3", "jfk.flac")
    samples = np.concatenate([load_audio(shared_clip(n)) for n in names])
    sf.write(path, samples, SAMPLE_RATE)
    return len(samples) / SAMPLE_RATE


def test_progress_moves_while_one_long_input_decodes(tmp_path: Path) -> None:
    """One input whose windows all fit one batch: the figure moves during that batch."""
    long = tmp_path / "long.wav"
    seconds = _long_speech(long)
    assert 140 < seconds < 160
    out = tmp_path / "out.txt"
    term = Terminal(f"exec {exe()} transcribe {long} --model {tiny()} > {out}")
    assert term.returncode == 0, term.text
    term.assert_bar_drawn_and_cursor_restored()
    assert "loading model" in term.text  # the stage before decoding has a line of its own
    shown = re.findall(r"(\d+)/(\d+) s audio", term.text)
    assert shown and {int(total) for _, total in shown} == {round(seconds)}, term.text[-2000:]
    moving = {int(done) for done, _ in shown if 0 < int(done) < round(seconds)}
    assert len(moving) >= 3, sorted(moving)
    assert "ask not what your country" in out.read_text()
