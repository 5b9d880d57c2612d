"""Tools around the engine: they measure it or feed it, and are never part of a transcription.

* `bench`     - speed and memory per model x dtype, each configuration in a child process
                (`python -m whisper_cli.tools.bench --child`: what `whisper-cli bench` runs).
* `evaluate`  - word (or character) error rate of a manifest of reference transcripts.
* `reference` - transformers' Whisper on the same windows, the reference `bench` compares to.
* `convert`   - the CTranslate2 (faster-whisper) importer into the Hugging Face layout.
* `names`     - HF parameter names -> openai-whisper's (the ggml writer, the test reference).

They live apart so that the engine stays small and reads in one pass: the transcription
path (options, audio, speech, windows, pipeline, decoding, model) never imports this
package. The tools take dtype names, the default model, the audio front end's constants and
model facts from the engine's modules (`dtypes`, `options`, `features`, `config`), never from
copies of their own. Two entry points reach in, both lazily: the CLI's `bench`, `eval` and `convert`
commands, and `loading`, which imports `convert` when a model path is a CTranslate2 directory.
"""
