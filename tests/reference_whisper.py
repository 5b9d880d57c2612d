"""openai-whisper on whisper-cli's own weights: the word-timing reference (tests only).

Our modules keep the Hugging Face checkpoint names; openai-whisper has its own. The
loaded model's state dict is renamed to openai-whisper's and loaded strictly into its
`Whisper`, with the same alignment heads, so both run the very same f32 weights.
"""

from __future__ import annotations

import numpy as np
import torch

from whisper_cli.tools.names import openai_name


def reference_model(loaded):
    """openai-whisper's Whisper holding `loaded`'s weights and alignment heads (CPU, f32)."""
    from whisper.model import ModelDimensions, Whisper

    from whisper_cli.timing import alignment_heads

    cfg = loaded.config
    dims = ModelDimensions(
        n_mels=cfg.num_mel_bins,
        n_audio_ctx=cfg.max_source_positions,
        n_audio_state=cfg.d_model,
        n_audio_head=cfg.encoder_attention_heads,
        n_audio_layer=cfg.encoder_layers,
        n_vocab=cfg.vocab_size,
        n_text_ctx=cfg.max_target_positions,
        n_text_state=cfg.d_model,
        n_text_head=cfg.decoder_attention_heads,
        n_text_layer=cfg.decoder_layers,
    )
    model = Whisper(dims)
    state = {openai_name(k): v.float().cpu() for k, v in loaded.model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    mask = torch.zeros(cfg.decoder_layers, cfg.decoder_attention_heads, dtype=torch.bool)
    for layer, heads in alignment_heads(loaded).items():
        mask[layer, heads.cpu()] = True
    model.register_buffer("alignment_heads", mask.to_sparse(), persistent=False)
    return model.eval()


def reference_words(model, loaded, segments, mel, samples, offset, last_speech, language):
    """openai-whisper's add_word_timestamps for one window's segments: [(word, start, end)].

    segments: our Segment objects as decoded (times absolute, before word refinement);
    mel: (n_mels, 3000) float32, the window's log-mel.
    """
    from whisper.timing import add_word_timestamps
    from whisper.tokenizer import get_tokenizer

    multilingual = loaded.tokenizer.is_multilingual
    tokenizer = get_tokenizer(
        multilingual, language=language if multilingual else None, task="transcribe"
    )
    dicts = [
        {"seek": offset * 100, "start": s.start, "end": s.end, "tokens": list(s.tokens)}
        for s in segments
    ]
    add_word_timestamps(
        segments=dicts,
        model=model,
        tokenizer=tokenizer,
        mel=mel,
        num_frames=min(samples // 160, 3000),
        last_speech_timestamp=last_speech,
    )
    return [(w["word"], w["start"], w["end"]) for d in dicts for w in d["words"]], [
        (d["start"], d["end"]) for d in dicts
    ]


def boundary_errors(ours, theirs) -> np.ndarray:
    """|difference| in seconds of every word start and end; the words must be the same."""
    assert [w for w, _, _ in ours] == [w for w, _, _ in theirs]
    a = np.array([(s, e) for _, s, e in ours])
    b = np.array([(s, e) for _, s, e in theirs])
    return np.abs(a - b).ravel()
