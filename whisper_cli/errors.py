"""The one exception type of the library; the CLI turns it into a message and exit code."""

from __future__ import annotations

import warnings

# Exit codes shared by the CLI and the library's error kinds.
EXIT_OK = 0
EXIT_INPUT_FAILED = 1  # one or more inputs failed; the others completed
EXIT_USAGE = 2  # run-level error before any work started
EXIT_INTERRUPTED = 130  # SIGINT
EXIT_BROKEN_PIPE = 141  # stdout closed by its reader (`| head`): 128 + SIGPIPE, as `cat` exits


class WhisperCliError(Exception):
    """An error the user can act on. ``exit_code`` says how the CLI exits on it.

    Run-level problems (bad model, bad option, unsupported dtype) use EXIT_USAGE;
    problems with one input file use EXIT_INPUT_FAILED and name the file.
    """

    def __init__(self, message: str, *, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class InputError(WhisperCliError):
    """A problem with one input (missing, unreadable, not audio, too short)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}", exit_code=EXIT_INPUT_FAILED)
        self.path = path
        self.problem = problem


class WhisperCliWarning(RuntimeWarning):
    """Something the user should know about a run that still succeeds (the CLI prints
    each as one ``whisper-cli: warning:`` line; ``--quiet`` hides them)."""


class DecoderMessage(WhisperCliWarning):
    """What a C decoder (libmpg123, FFmpeg) printed while reading an input that then
    decoded fine; the CLI shows these only with ``--verbose``."""


# Decoder chatter is for debugging: hidden unless asked for (the CLI shows it with -v).
warnings.filterwarnings("ignore", category=DecoderMessage)
