"""A reference run of transformers' Whisper on the windows whisper-cli decodes, for `bench`.

The reference sees the same audio cut into the same windows (`cut_windows`, from the same
speech map), in batches of
the same size, in the same dtype and on the same device, and decodes greedily with the same
timestamp mode and token budget; only the model code, the feature extractor and the
generation loop are transformers' own. Its texts should therefore match whisper-cli's
wherever the model reads a window to its end. Where it ends early with speech left,
transformers seeks there and decodes the remainder again on its own, while whisper-cli
goes on in the same decode (the speech map's no-end rule, decoding.py): words near such
a point may differ, and the comparison counts them. Temperature fallback is whisper-cli's
alone: a window that falls back may differ too.

transformers is imported here only, and lazily: the rest of whisper-cli never needs it.
"""

from __future__ import annotations

import difflib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.errors import WhisperCliError
from whisper_cli.speech import load_detector
from whisper_cli.tokenizer import Tokenizer
from whisper_cli.windows import Window, cut_windows


@dataclass(frozen=True)
class ReferenceResult:
    """One timed transformers run over all windows."""

    name: str  # "transformers <version>"
    wall_s: float  # windows -> features -> generate -> text, after a one-batch warm-up
    text: str
    windows: int
    batches: int


@dataclass(frozen=True)
class TextComparison:
    identical: bool  # equal after whitespace normalisation
    word_differences: int  # words inserted, deleted or replaced (0 when identical)
    words: int
    reference_words: int


def normalise_whitespace(text: str) -> str:
    return " ".join(text.split())


def compare_texts(ours: str, reference: str) -> TextComparison:
    """Whitespace-only normalisation: case and punctuation differences count as differences."""
    a, b = normalise_whitespace(ours).split(), normalise_whitespace(reference).split()
    diffs = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op != "equal":
            diffs += max(i2 - i1, j2 - j1)
    return TextComparison(a == b, diffs, len(a), len(b))


def run_reference(
    model_dir: Path,
    *,
    blocks: Callable[[], Iterable[np.ndarray]],
    dtype: torch.dtype,
    device: torch.device,
    batch_size: int,
    max_new_tokens: int,
    timestamps: bool,
    language: str | None,
) -> ReferenceResult:
    """Decode the audio of ``blocks()`` (16 kHz mono blocks) with transformers, timed.

    ``language`` must be given for a multilingual model (whisper-cli's per-input guess),
    so that transformers does not detect a language per window on its own.
    """
    try:
        import transformers
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    except ImportError as exc:
        raise WhisperCliError(
            "--against transformers needs the transformers package (pip install transformers)"
        ) from exc

    transformers.logging.set_verbosity_error()  # its generate() warns on every batch
    transformers.utils.logging.disable_progress_bar()
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    extractor = _feature_extractor(WhisperFeatureExtractor, model_dir, model.config.num_mel_bins)
    tokenizer = Tokenizer(model_dir / "tokenizer.json", multilingual=False)  # decoding only

    def decode_batch(batch: list[Window]) -> list[str]:
        features = extractor(
            [w.audio for w in batch], sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features.to(device=device, dtype=dtype)
        kwargs = {"language": language, "task": "transcribe"} if language else {}
        with torch.inference_mode():
            out = model.generate(
                input_features=features,
                return_timestamps=timestamps,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                **kwargs,
            )
        return [tokenizer.decode(row) for row in out.tolist()]

    sync = _synchronizer(device)
    detector = load_detector()
    decode_batch(next(_batches(cut_windows(blocks(), detector), batch_size)))  # warm-up
    sync()
    started = time.perf_counter()
    texts: list[str] = []
    windows = batches = 0
    for batch in _batches(cut_windows(blocks(), detector), batch_size):
        texts.extend(decode_batch(batch))
        windows += len(batch)
        batches += 1
    sync()
    wall = time.perf_counter() - started
    name = f"transformers {transformers.__version__}"
    return ReferenceResult(name, wall, "".join(texts).strip(), windows, batches)


def _feature_extractor(cls, model_dir: Path, n_mels: int):
    # Random-weight test directories may lack preprocessor_config.json; the defaults are
    # Whisper's, with the model's number of mel bins.
    if (model_dir / "preprocessor_config.json").is_file():
        return cls.from_pretrained(model_dir)
    return cls(feature_size=n_mels)


def _batches(windows: Iterator[Window], size: int) -> Iterator[list[Window]]:
    while batch := list(itertools.islice(windows, size)):
        yield batch


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
