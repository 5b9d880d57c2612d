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

# The languages of Whisper's vocabularies (large-v3 added yue), by their English names,
# so that `--language German` works as well as `--language de`. Which of them a model
# knows is read from its tokenizer; this table only turns names into codes.
LANGUAGE_NAMES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian",
    "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian",
    "sw": "swahili", "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala",
    "km": "khmer", "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans",
    "oc": "occitan", "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi",
    "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen",
    "nn": "nynorsk", "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish",
    "my": "myanmar", "bo": "tibetan", "tl": "tagalog", "mg": "malagasy", "as": "assamese",
    "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa", "ba": "bashkir",
    "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}  # fmt: skip
# Other names people use for some of them.
_LANGUAGE_ALIASES = {
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht", "pushto": "ps",
    "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si",
    "castilian": "es", "mandarin": "zh", "farsi": "fa", "letzeburgesch": "lb",
    "norwegian bokmal": "no", "bokmal": "no", "filipino": "tl", "javanese": "jw",
}  # fmt: skip
_CODE_OF_NAME = {name: code for code, name in LANGUAGE_NAMES.items()} | _LANGUAGE_ALIASES


def language_code(value: str) -> str:
    """A language code or English name, any case ("EN", "English", "german") -> its code.

    A usage error if it is neither; whether a given model knows the language is
    checked later, against its tokenizer.
    """
    key = " ".join(value.replace("_", " ").split()).lower()
    if key in LANGUAGE_NAMES:
        return key
    if key in _CODE_OF_NAME:
        return _CODE_OF_NAME[key]
    raise WhisperCliError(
        f"unknown language {value!r}; give a code or an English name "
        "(en or English, de or German, ...)"
    )


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

    def sentence_ends(self) -> list[int]:
        """The text tokens whose text ends a sentence: its last mark, past closing quotes
        and brackets, one of SENTENCE_MARKS ("." "?" "!" "..." and their forms in other
        scripts). One batch decode of the vocabulary (some 40 ms)."""
        texts = self._tok.decode_batch([[i] for i in range(self.special.eot)])
        return [i for i, text in enumerate(texts) if _ends_sentence(text)]

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        """Text of the text tokens among `ids` (specials and timestamps dropped)."""
        return self._tok.decode([i for i in ids if i < self.special.eot])


# Marks that end a sentence (Latin, CJK full-width, Arabic, Devanagari, Armenian,
# Ethiopic, Myanmar, Khmer), and what may close after them. (timing.SENTENCE_END_MARKS
# is openai-whisper's narrower set, kept as it has it so that word times compare.)
SENTENCE_MARKS = frozenset(
    ".?!\u2026"  # Latin, and the ellipsis
    "\u3002\uff1f\uff01\uff0e"  # CJK and full-width
    "\u061f\u06d4\u0964\u0965\u0589\u1362\u104b\u17d4"  # Arabic, Urdu, Devanagari, ...
)
_CLOSERS = "\"'\u201d\u2019\u00bb)]}\u300d\u300f\uff09"


def _ends_sentence(text: str) -> bool:
    core = text.rstrip().rstrip(_CLOSERS).rstrip()
    return bool(core) and core[-1] in SENTENCE_MARKS
