"""Find a model (directory, alias, hub id, CTranslate2 dir) and load it strictly.

This is the one place weights enter the process: every checkpoint key must match a
parameter of our modules by name and shape, and every floating tensor is cast to the
run dtype here, once (the linear layers' weights quantized here, once, under
`--quantize int8`). The model's kernel plan is made here too, once its weights are in
place, and handed to it: the model never chooses, times or caches a kernel as it runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from whisper_cli import kernels
from whisper_cli.config import MULTILINGUAL_VOCAB_SIZE, GenerationConfig, ModelConfig
from whisper_cli.dtypes import DtypePolicy, cast_weight, ieee_float32
from whisper_cli.errors import WhisperCliError
from whisper_cli.model import Reach, Whisper
from whisper_cli.options import TranscribeOptions, default_model
from whisper_cli.tokenizer import Tokenizer

ALIASES: dict[str, str] = {
    "tiny": "openai/whisper-tiny",
    "tiny.en": "openai/whisper-tiny.en",
    "base": "openai/whisper-base",
    "base.en": "openai/whisper-base.en",
    "small": "openai/whisper-small",
    "small.en": "openai/whisper-small.en",
    "medium": "openai/whisper-medium",
    "medium.en": "openai/whisper-medium.en",
    "large-v2": "openai/whisper-large-v2",
    "large-v3": "openai/whisper-large-v3",
    "large-v3-turbo": "openai/whisper-large-v3-turbo",
    "turbo": "openai/whisper-large-v3-turbo",
}
# What a hub download fetches: configs, tokenizer and the weights in one format.
_HUB_PATTERNS = ["*.json", "model*.safetensors"]
_HUB_FALLBACK_PATTERNS = ["*.json", "pytorch_model*.bin"]
_TIED_KEYS = ("proj_out.weight",)  # the output projection shares the token embedding


def home_dir() -> Path:
    """Where imported models live (WHISPER_CLI_HOME, else ~/.cache/whisper-cli)."""
    env = os.environ.get("WHISPER_CLI_HOME")
    return Path(env) if env else Path.home() / ".cache" / "whisper-cli"


def model_search_dirs() -> list[Path]:
    """Folders searched for an alias already imported: $WHISPER_CLI_MODELS, ./models, home."""
    dirs = [Path(p) for p in os.environ.get("WHISPER_CLI_MODELS", "").split(os.pathsep) if p]
    return [*dirs, Path("models"), home_dir() / "models"]


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / name).is_file()
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    )


def resolve_model(name: str) -> Path:
    """A local Hugging Face directory for `name`; imports or downloads as needed.

    Order: an existing path (HF or CTranslate2 directory), an alias already imported
    under that name, the hub cache, then a download. Never a silent switch to
    another model.
    """
    path = Path(name).expanduser()
    if path.exists():
        return _local_dir(path)
    if name in ALIASES:
        for folder in model_search_dirs():
            if is_hf_dir(folder / name):
                return folder / name
        return _from_hub(ALIASES[name], alias=name)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return _from_hub(name, alias=None)
    raise WhisperCliError(
        f"unknown model {name!r}: not a directory, an alias ({', '.join(ALIASES)}) "
        "or a hub id (org/name)"
    )


def _local_dir(path: Path) -> Path:
    from whisper_cli.tools.convert import convert_ct2, is_ct2_dir

    if not path.is_dir():
        raise WhisperCliError(f"model path {path} is not a directory")
    if is_hf_dir(path):
        return path
    if is_ct2_dir(path):
        # Imported once into the home cache, keyed by the absolute source path.
        key = str(path.resolve()).strip("/").replace("/", "--")
        out = home_dir() / "imported" / key
        if not is_hf_dir(out):
            convert_ct2(path, out)
        return out
    missing = "config.json" if not (path / "config.json").is_file() else "model weights"
    raise WhisperCliError(
        f"model directory {path} is missing {missing} (expected a Hugging Face Whisper "
        "directory with config.json and model.safetensors, or a CTranslate2 directory)"
    )


def _from_hub(repo_id: str, alias: str | None) -> Path:
    from huggingface_hub import snapshot_download

    errors = []
    for local_only in (True, False):
        for patterns in (_HUB_PATTERNS, _HUB_FALLBACK_PATTERNS):
            try:
                path = Path(
                    snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_only)
                )
            except Exception as exc:  # hub errors have many types; report the last
                errors.append(exc)
                continue
            if is_hf_dir(path):
                return path
    hint = f" (alias {alias!r})" if alias else ""
    raise WhisperCliError(
        f"model {repo_id}{hint} is neither in the Hugging Face cache nor downloadable "
        f"({type(errors[-1]).__name__}: {str(errors[-1]).splitlines()[0] if errors else ''}). "
        "Use --model DIR with a local model directory, or run `make models` to import "
        "the offline test models into ./models"
    )


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint as stored: safetensors, sharded, or pytorch_model.bin."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    legacy = model_dir / "pytorch_model.bin"
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                state.update(load_file(model_dir / shard))
            return state
        if legacy.is_file():
            return torch.load(legacy, map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as exc:
        raise WhisperCliError(f"cannot read the weights in {model_dir}: {exc}") from exc
    raise WhisperCliError(f"model directory {model_dir} has no model.safetensors")


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys as our module names them: drop "model." and the tied projection."""
    out = {}
    embed = state.get("model.decoder.embed_tokens.weight")
    for key, tensor in state.items():
        if key in _TIED_KEYS:
            if embed is not None and not torch.equal(tensor, embed):
                raise WhisperCliError(f"{key} is not tied to the token embedding")
            continue
        out[key.removeprefix("model.")] = tensor
    return out


def load_weights(model: Whisper, state: dict[str, torch.Tensor], policy: DtypePolicy) -> None:
    """Strict load: every key present, none unexpected, every shape equal; cast once (and,
    with `--quantize int8`, the linear layers' weights quantized once)."""
    state = _normalise_keys(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise WhisperCliError(f"checkpoint is missing key(s): {', '.join(missing[:5])}")
    if unexpected:
        raise WhisperCliError(f"checkpoint has unexpected key(s): {', '.join(unexpected[:5])}")
    for key, param in expected.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise WhisperCliError(
                f"shape mismatch for {key}: checkpoint {tuple(state[key].shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
    int8: set[str] = set()
    if policy.quantize == "int8":
        from whisper_cli.quantize import int8_keys, quantize_linears

        int8 = int8_keys(model)
    # A weight to be quantized is never cast: it enters as int8 only (a placeholder without
    # memory holds its place until its layer is swapped).
    cast = {
        k: torch.empty(v.shape, dtype=policy.dtype, device="meta")
        if k in int8
        else cast_weight(v, policy)
        for k, v in state.items()
    }
    model.load_state_dict(cast, strict=True, assign=True)
    if int8:  # from the checkpoint's tensors
        quantize_linears(model, state, policy)


@dataclass(frozen=True)
class LoadedModel:
    model: Whisper
    tokenizer: Tokenizer
    config: ModelConfig
    generation: GenerationConfig
    policy: DtypePolicy
    path: Path
    name: str


def load_model(
    name: str | None, policy: DtypePolicy, options: TranscribeOptions | None = None
) -> LoadedModel:
    """Resolve, read and build a model in the policy's dtype and device, with the kernel
    plan of runs with `options` (default: the default options; see plan_kernels); no name:
    the default model of that device (options.default_model), decided here and nowhere
    else on the transcription path, so a Ray worker picks the default of its own device."""
    if name is None:
        name = default_model(policy.device.type)
    model_dir = resolve_model(name)
    config = ModelConfig.load(model_dir)
    generation = GenerationConfig.load(model_dir)
    multilingual = generation.is_multilingual
    if multilingual is None:
        multilingual = config.vocab_size >= MULTILINGUAL_VOCAB_SIZE
    tokenizer = Tokenizer(model_dir / "tokenizer.json", multilingual=multilingual)
    with torch.device("meta"):
        model = Whisper(config)  # no memory, no random init: weights are assigned below
    load_weights(model, read_checkpoint(model_dir), policy)
    model.eval().requires_grad_(False)
    ieee_float32(policy)
    plan_kernels(model, policy, run_reach(options or TranscribeOptions(), config, tokenizer))
    return LoadedModel(model, tokenizer, config, generation, policy, model_dir, name)


def run_reach(options: TranscribeOptions, config: ModelConfig, tokenizer: Tokenizer) -> Reach:
    """The shapes a run with `options` reaches (model.Reach): its prompt, which an initial
    prompt may grow to the whole text context; the prompt and max_new_tokens with the end
    of text; the alignment pass with word timestamps."""
    longest = config.max_target_positions
    prompt = len(tokenizer.prompt(None, options.task, timestamps=False))
    if options.initial_prompt:
        prompt = longest
    text = min(prompt + options.max_new_tokens + 1, longest)
    return Reach(prompt, text, options.word_timestamps)


def plan_kernels(
    model: Whisper, policy: DtypePolicy, reach: Reach, mode: str | None = None
) -> kernels.KernelPlan:
    """Give `model` (its weights in place) the kernel plan of its dtype and device for
    the shapes of `reach`: each choice read from the kernel cache, or timed now where the
    cache has none (then saved there); `mode`: WHISPER_CLI_KERNELS when None. Shapes
    outside the reach (a longer prompt, say) run the reference kernels. With int8 weights,
    each layer gets the forms of its weight the plan chose (quantize.prepare_forms)."""
    calls = list(model.kernel_calls(reach))
    plan = kernels.build_plan(calls, policy.dtype, policy.device, mode=mode)
    model.use_plan(plan)
    if policy.quantize == "int8":
        from whisper_cli.quantize import prepare_forms

        prepare_forms(model, plan, calls)
    return plan
