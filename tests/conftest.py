"""Session fixtures for the pipeline and CLI tests: the real models, loaded once each.

`models/tiny.en` and `models/base` are loaded in f32 on the CPU the first time a test
asks for them and shared by every later test (skipped locally, failed under CI=true,
when `make models` has not been run). `transcriber` builds a `Transcriber` over one of
them with the given options; `cached_cli_models` makes in-process CLI runs reuse the
loaded models instead of reading the weights again on every invocation. The kernel cache
of the whole session is a file of its own (`isolated_kernels_cache`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from util import real_model

# The kernels of the suite's models: torch's reference everywhere, but for half-precision
# linear layers and convolutions their float32 upcast (as exact as a half GEMM accumulating
# in float32, and fast on CPUs without native half GEMMs, where the reference takes
# seconds per window), and for a bf16 decode step's attention the C kernel (where it
# builds: kernels.attention_candidates), so that every bf16 test runs it.
SUITE_KERNELS = "f32-upcast,fused"


@pytest.fixture(scope="session", autouse=True)
def isolated_kernels_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The kernel cache of the whole session, in a folder of its own: no test reads the
    choices timed by an earlier run (under whatever load that machine had), and none
    writes into the user's ~/.cache/whisper-cli.

    Models load with a plan that times nothing (SUITE_KERNELS), so every test runs the
    kernels it was given, whatever this machine's timings; a test of the timed choices
    sets WHISPER_CLI_KERNELS itself."""
    path = tmp_path_factory.mktemp("kernels") / "kernels.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WHISPER_CLI_KERNELS_CACHE", str(path))
        patch.setenv("WHISPER_CLI_KERNELS", SUITE_KERNELS)
        yield path


def _load(name: str):
    from whisper_cli import loading
    from whisper_cli.dtypes import resolve_policy

    # The real loader, also while `cached_cli_models` has replaced it.
    load_model = getattr(loading.load_model, "__wrapped__", loading.load_model)
    return load_model(str(real_model(name)), resolve_policy("f32", "cpu"))


@pytest.fixture(scope="session")
def tiny_en():
    """models/tiny.en (English-only), f32 on the CPU."""
    return _load("tiny.en")


@pytest.fixture(scope="session")
def base_model():
    """models/base (multilingual), f32 on the CPU."""
    return _load("base")


@pytest.fixture
def transcriber() -> Callable:
    """`transcriber(loaded, **options)`: a Transcriber with those TranscribeOptions."""
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    def make(loaded, **options):
        return Transcriber(loaded, TranscribeOptions(**options))

    return make


@pytest.fixture
def cached_cli_models(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """CLI runs in this test get the session's f32 CPU models for models/tiny.en and base.

    Only the weights are reused: the CLI still resolves the name, builds its own
    Transcriber and renders its own output. Any other model, dtype or quantization loads for real.
    """
    import whisper_cli.loading as loading

    real_load = loading.load_model
    fixtures = {"tiny.en": "tiny_en", "base": "base_model"}

    def load_model(name: str, policy, options=None):
        path = Path(name).expanduser()
        plain_f32 = policy.name == "f32" and policy.quantize == "none"
        if path.is_dir() and plain_f32 and policy.device.type == "cpu":
            for model, fixture in fixtures.items():
                if path.resolve() == real_model(model).resolve():
                    cached = request.getfixturevalue(fixture)
                    return type(cached)(**{**vars(cached), "name": name})
        return real_load(name, policy, options)

    load_model.__wrapped__ = real_load
    monkeypatch.setattr(loading, "load_model", load_model)
