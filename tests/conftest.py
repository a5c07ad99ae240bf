"""Shared fixtures: the embedded model (loaded once per session) and tiny random models; the CLI in-process."""
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` hands whole files to two workers (--dist loadfile, --no-loadscope-reorder), each file to whichever
# worker frees first, in collection order. xdist's own order (most tests first) left test_ray.py, few tests but
# 2.5 minutes, to run alone at the end; the files that take longest go first (their own times in make test,
# --junitxml, 2026-12-02 with tiny_built: 197, 183, 167, 122, 102, 92, 89, 84 s). A stale list costs balance,
# never a test.
LONGEST_FILES = ["test_method_contract.py", "test_catalogue.py", "test_build.py", "test_run.py", "test_s3.py",
                 "test_report.py", "test_methods.py", "test_ray.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))   # stable: a file's order is kept


@pytest.fixture(scope="session")
def answerer():
    """The embedded SmolLM2-135M-Instruct with its engine and template."""
    from kvf.pipeline.workflows.weights import load_answerer
    torch.manual_seed(0)
    return load_answerer(None)


@pytest.fixture(scope="session")
def short_docs():
    return ["Zorvan Pellick was born in the city of Quillmarsh, a river town known for its glass.",
            "Quillmarsh is the capital of the Drelvan province, famous for its salt mines.",
            "The Kettar mountains lie north of the Ossel sea and are home to wild goats."]


# SmolLM2-135M-Instruct's shape, transformers' default initialisation (std 0.02). A larger one makes
# the 30 random layers chaotic: bf16 rounding alone then moves logits as far as reuse does, and the
# bf16 oracle could not fail (measured on an H100: init 0.06 gives bf16 noise 7.3 against reuse's 7.6;
# 0.02 gives 0.032 against 1.46).
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def tiny_config(family: str, **overrides):
    """A small random decoder of each supported family, built from a config (no download)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if family == "llama":
        config = LlamaConfig(**common, head_dim=16)
    elif family == "llama3rope":
        config = LlamaConfig(**common, head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "mistral":
        config = MistralConfig(**common, head_dim=16, sliding_window=None)
    elif family == "qwen2":
        config = Qwen2Config(**common)  # q/k/v projections carry a bias
    elif family == "qwen3":
        config = Qwen3Config(**common, head_dim=16)  # per-head q/k RMSNorm
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def tiny_llama_dir(path, tokenizer=None, **overrides):
    """A 2-layer random Llama saved to path with SmolLM2's tokenizer (the embedded model's chunks and prompts, at
    a fraction of its compute): for what does not depend on the model's weights. overrides: tiny_config's. 2,048
    positions: a synthetic question's chat prompt passes tiny_config's 512."""
    from transformers import AutoModelForCausalLM
    if tokenizer is None:
        from kvf.pipeline.workflows.weights import open_model
        tokenizer = open_model(None).tokenizer
    torch.manual_seed(0)
    config = tiny_config("llama", **{"vocab_size": 49152, "num_hidden_layers": 2, "max_position_embeddings": 2048,
                                     **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32, attn_implementation="sdpa")
    # Random init leaves biases at zero; make Qwen2's qkv bias count in the test.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


FAMILIES = ["llama", "llama3rope", "mistral", "qwen2", "qwen3"]


def stored_prefix_kvs(engine, prompt):
    """Each chunk's `prefix` KV, with the build-time extras of every method that has a hook."""
    from kvf.pipeline.fusion.methods import METHODS
    from kvf.pipeline.fusion.sources import InMemoryKV
    hooks = [cls for cls in METHODS.values() if cls.extras_hook is not None]
    kvs, extras = [], []
    for seg in prompt.chunk_segments:
        attention = []
        kvs.append(engine.chunk_kv(seg, prompt.prefix_ids, None, attention_out=attention))
        chunk_extras = {}
        for cls in hooks:
            chunk_extras.update(cls.extras_hook(attention, [prompt.n_prefix], list(prompt.prefix_ids)))
        extras.append(chunk_extras)
    return InMemoryKV(kvs, extras)


def oracle_method(name):
    """The method at its compute-everything setting: ratio 1 with its oracle_knobs."""
    from kvf.pipeline.fusion.methods import METHODS, get_method
    cls = METHODS[name]
    return get_method(name, 1.0, **cls.oracle_knobs)


def recomputes_chunks(method) -> bool:
    """Methods that never recompute a chunk token equal full prefill on one chunk only."""
    return method.ratio_is_knob or method.fixed_ratio == 1.0


def build_synthetic(root, model: str | None = None):
    """A synthetic prepared dataset (3 questions, 3 passages each) at root/data and its workspace at root/ws
    (64-token chunks, prefix variant) built by `model` (None: the embedded one) -> root."""
    import io
    from rich.console import Console
    from kvf.pipeline.data.synthetic import make_synthetic
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    make_synthetic(root / "data", n_questions=3, passages_per_question=3, seed=1)
    build_cache(BuildOptions(corpus=root / "data" / "corpus", workspace=root / "ws", chunk_tokens=64,
                             variants=("prefix",), n_neighbours=2, model=model), Console(file=io.StringIO()))
    return root  # session-wide: pytest removes it at the end of a passing session (tmp_path_retention_policy)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """`build_synthetic` by the embedded model."""
    return build_synthetic(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def tiny_built(tmp_path_factory):
    """`build_synthetic` by a `tiny_llama_dir` of the embedded model's 30 layers (root/model: pass it as the run's
    model): the same chunks, prompts and layer-dependent knob limits (cacheblend's --check-layer), for runs whose
    checks do not need trained weights (records, settings, sharing, resuming, flags, errors). Initialised at std 0.1,
    its answers depend on the passages: at transformers' 0.02 all three questions got one answer and reuse never
    parted from full; at 0.1 reuse parts from full in 6 of 15 answers and ratio 1 keeps KL to full at 2e-8."""
    root = tmp_path_factory.mktemp("tiny-run")
    model = tiny_llama_dir(root / "model", num_hidden_layers=30, initializer_range=0.1)
    return build_synthetic(root, model=str(model))


def model_of(root) -> str:
    """The tiny model a build under `root` (tiny_built, test_ray's corpus) was made by: root/model."""
    return str(root / "model")


def run_cli(args, capsys, monkeypatch) -> tuple[int, str, str]:
    """The real `kvf` entry point (main() and its error wrapper), in-process -> (exit code, stdout, stderr)."""
    from kvf.cli.main import main
    monkeypatch.setattr(sys, "argv", ["kvf", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


def probe_verdict(code: int, err: str, prefix: str = "kvf: error:") -> str | None:
    """The probes' rule (make probe-flags, make probe-files): None when the command ran, or refused in one line
    starting with `prefix`; else what was wrong (a traceback, an internal error, or several lines)."""
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 0:
        return None
    if "Traceback" in err or "internal error" in err:
        return err.strip()[-400:]
    if len(lines) != 1 or not lines[0].startswith(prefix):
        return f"{len(lines)} lines: {' | '.join(lines)[-400:]}"
    return None


def tree(root, leave_out=None) -> dict:
    """Every file and folder under root but leave_out -> its size and modification time (a write, an atomic
    replace or a truncation changes them), a folder -> None. os.scandir: half pathlib's time, for every command.
    With changed(): a refused command changed nothing (make probe-files, the bad-input catalogue)."""
    found = {}
    for entry in os.scandir(root):
        if entry.path == str(leave_out):
            continue
        if entry.is_dir(follow_symlinks=False):
            found[entry.path] = None
            found.update(tree(entry.path, leave_out))
        else:
            stat = entry.stat(follow_symlinks=False)
            found[entry.path] = (stat.st_size, stat.st_mtime_ns)
    return found


def changed(before: dict, after: dict) -> str | None:
    """None when two trees are alike, else what a refused command made, removed or rewrote."""
    paths = sorted(str(p) for p in before.keys() | after.keys() if before.get(p, "gone") != after.get(p, "gone"))
    return f"refused, yet it changed {', '.join(paths[:3])}" if paths else None


def assert_one_line(code: int, err: str, *fragments: str) -> str:
    """A failed command's stderr is one line, 'kvf: ...', holding every fragment, with no traceback -> that line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("kvf: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


RAISING_METHOD_ERROR = "line 9 (a method file of KVF_METHOD_PATH) raised RuntimeError: no rows today; fix the method"


def write_raising_method(folder):
    """A method of one's own (a KVF_METHOD_PATH folder) whose selection raises: boom.py line 9."""
    folder.mkdir()
    (folder / "boom.py").write_text(
        "from kvf.pipeline.fusion.methods import FusionMethod, register\n\n\n@register\nclass Boom(FusionMethod):\n"
        "    name, summary = 'boom', 'raises'\n\n    def initial_chunk_rows(self, prompt):\n"
        "        raise RuntimeError('no rows today')\n")
