"""whisper-cli: fast, exact Whisper speech-to-text on the command line."""

__version__ = "0.1.0"
