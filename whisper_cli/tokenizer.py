"""Whisper's tokenizer: text <-> ids through `tokenizers`, special ids looked up by name.

Special ids are never hard-coded: large-v3 shifts them by one (it added a language),
and older vocabularies call `<|nospeech|>` `<|nocaptions|>`. Timestamp tokens may be
missing from tokenizer.json: they are the ids after `<|notimestamps|>`, one per 0.02 s,
and are handled by id alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from whisper_cli.errors import WhisperCliError

TIME_PRECISION = 0.02  # seconds per timestamp token
_LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    sot_prev: int
    translate: int
    transcribe: int
    no_timestamps: int
    no_speech: int

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


class Tokenizer:
    """Encodes prompts and decodes generated ids for one Whisper vocabulary."""

    def __init__(self, path: Path, multilingual: bool) -> None:
        from tokenizers import Tokenizer as HFTokenizer  # a light import, but keep --help fast

        if not path.is_file():
            raise WhisperCliError(f"model directory {path.parent} has no {path.name}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise WhisperCliError(f"malformed {path}: {exc}") from exc
        self.special = SpecialTokens(
            eot=self._require("<|endoftext|>"),
            sot=self._require("<|startoftranscript|>"),
            sot_prev=self._require("<|startofprev|>"),
            translate=self._require("<|translate|>"),
            transcribe=self._require("<|transcribe|>"),
            no_timestamps=self._require("<|notimestamps|>"),
            no_speech=self._require("<|nospeech|>", "<|nocaptions|>"),
        )
        # Language tokens sit between <|startoftranscript|> and <|translate|>. English-only
        # vocabularies list them too, but their models never learnt them.
        self.language_ids: dict[str, int] = {}
        for token_id in range(self.special.sot + 1, self.special.translate):
            match = _LANGUAGE_TOKEN.match(self._tok.id_to_token(token_id) or "")
            if match and multilingual:
                self.language_ids[match.group(1)] = token_id

    def _require(self, *names: str) -> int:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise WhisperCliError(f"tokenizer has no {' or '.join(names)} token")

    @property
    def is_multilingual(self) -> bool:
        return len(self.language_ids) > 0

    def language_id(self, code: str) -> int:
        if code not in self.language_ids:
            raise WhisperCliError(
                f"unknown language {code!r}; this model knows: "
                f"{', '.join(sorted(self.language_ids)) or 'English only'}"
            )
        return self.language_ids[code]

    def language_of(self, token_id: int) -> str:
        for code, value in self.language_ids.items():
            if value == token_id:
                return code
        raise WhisperCliError(f"token {token_id} is not a language token")

    def prompt(
        self,
        language: str | None,
        task: str,
        timestamps: bool,
        previous: tuple[int, ...] = (),
    ) -> list[int]:
        """The decoder prompt: [<|startofprev|> prev...] <|sot|> [lang task] [<|notimestamps|>]."""
        ids: list[int] = []
        if previous:
            ids += [self.special.sot_prev, *previous]
        ids.append(self.special.sot)
        if self.is_multilingual:
            ids.append(self.language_id(language or "en"))
            ids.append(self.special.translate if task == "translate" else self.special.transcribe)
        if not timestamps:
            ids.append(self.special.no_timestamps)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Plain text tokens (no specials), as used for an initial prompt."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        """Text of the text tokens among `ids` (specials and timestamps dropped)."""
        return self._tok.decode([i for i in ids if i < self.special.eot])
