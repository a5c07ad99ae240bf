"""The contract every registered method passes, parametrised over the registry (no hand-kept lists):
- at its compute-everything setting (ratio 1 with its oracle_knobs) it reproduces full prefill:
  first-token logits within 1e-3 and the same greedy answer on the embedded model, 1e-4 on a tiny
  model of every supported family; methods that never recompute a chunk token do so on one chunk;
- it recomputes exactly round(r * n) chunk tokens (within one per chunk where the paper says ceil);
- a method that declares `query_pass` gives the same bits when its first pass comes from a sweep's
  shared pass as when it runs alone, and is charged that pass's time;
- its knobs round-trip into run records, and `kvf run` has a flag for each of them;
- it reads no cache row that nothing wrote: over caches filled with NaN instead of zeros, its prefill,
  decoding and teacher forcing give the bits they give over zero-filled ones, at its default knobs and at the
  configurations named below (every method's named configurations among them, `-m kvfuse:tuned`), which at
  ratio 1 equal full prefill too;
- it says in one line what it recomputes (`summary`, printed by `kvf methods`), and the README's methods
  table has its row saying the same;
and ARCHITECTURE.md's example method, written in one file outside kvf, passes this contract and is found, with
its flags, by `kvf run`. A failed check says what to set (oracle_knobs, exact_budget, ratio_is_knob)."""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import (FAMILIES, RAISING_METHOD_ERROR, assert_one_line, model_of, oracle_method, recomputes_chunks,
                      stored_prefix_kvs, tiny_model, write_raising_method)
from kvf.errors import KvfError
from kvf.pipeline.fusion.engine import FusionEngine, recompute_budget
from kvf.pipeline.fusion.methods import METHODS, get_method, method_names
from kvf.pipeline.fusion.methods.base import flag_name, knob_types, register
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.model.forward import KVCache, Transformer
from kvf.pipeline.model.prompt import FusedPrompt, encode
from kvf.pipeline.workflows.run import parse_method_spec

NAMES = method_names()


@pytest.fixture(scope="module")
def embedded(answerer, short_docs):
    many = answerer.prompt([encode(answerer.tokenizer, d) for d in short_docs], "In which province was Zorvan Pellick born?")
    one = answerer.prompt([encode(answerer.tokenizer, short_docs[0])], "Where was Zorvan Pellick born?")
    cases = {}
    for key, prompt in (("many", many), ("one", one)):
        full = answerer.answer(prompt, get_method("full"), None, max_new_tokens=8)
        cases[key] = (prompt, stored_prefix_kvs(answerer.engine, prompt), full)
    return cases


@pytest.mark.parametrize("name", NAMES)
def test_compute_everything_equals_full_on_the_embedded_model(answerer, embedded, name):
    method = oracle_method(name)
    prompt, source, full = embedded["many" if recomputes_chunks(method) else "one"]
    got = answerer.answer(prompt, method, source, max_new_tokens=8)
    gap = (got.fused.logits - full.fused.logits).abs().max().item()
    assert gap <= 1e-3, f"{name} at ratio 1 with oracle_knobs={METHODS[name].oracle_knobs}: first-token logits {gap:.3g} " \
                        "from full prefill's; set oracle_knobs to the knobs that make it recompute every chunk token"
    assert got.text == full.text and got.text


NAMED = [(name, configuration) for name in NAMES for configuration in METHODS[name].configurations]


@pytest.mark.parametrize("name,configuration", NAMED)
def test_each_named_configuration_computing_everything_equals_full(answerer, embedded, name, configuration):
    """`-m kvfuse:tuned` at ratio 1 (with the method's oracle_knobs) is full prefill too: its knobs only choose rows."""
    knobs = {**parse_method_spec(f"{name}:{configuration}").knobs, **METHODS[name].oracle_knobs}
    prompt, source, full = embedded["many"]
    got = answerer.answer(prompt, get_method(name, 1.0, **knobs), source, max_new_tokens=8)
    assert (got.fused.logits - full.fused.logits).abs().max().item() <= 1e-3, (name, configuration)
    assert got.text == full.text and got.text


def tiny_case(family):
    engine = FusionEngine(Transformer(tiny_model(family, seed=3)))
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    many = FusedPrompt(ids(5), [ids(n) for n in (9, 14, 7)], ids(6))
    one = FusedPrompt(many.prefix_ids, many.chunk_segments[:1], many.question_ids)
    return engine, many, one


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_everything_equals_full_on_every_family(family):
    engine, many, one = tiny_case(family)
    for name in NAMES:
        method = oracle_method(name)
        prompt = many if recomputes_chunks(method) else one
        full = get_method("full").prefill(engine, prompt)
        got = method.prefill(engine, prompt, stored_prefix_kvs(engine, prompt))
        assert (got.logits - full.logits).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].ratio_is_knob])
@pytest.mark.parametrize("ratio", [0.1, 0.37])
def test_recomputes_its_budget(answerer, embedded, name, ratio):
    prompt, source, _ = embedded["many"]
    got = get_method(name, ratio).prefill(answerer.engine, prompt, source)
    budget = recompute_budget(ratio, prompt.n_chunk_tokens)
    slack = 0 if METHODS[name].exact_budget else len(prompt.chunk_segments)
    assert abs(got.recomputed_tokens - budget) <= slack, \
        f"{name} at ratio {ratio} recomputed {got.recomputed_tokens} chunk tokens, not round(r * n) = {budget} " \
        f"(exact_budget={METHODS[name].exact_budget}); a method whose count --ratio does not set says ratio_is_knob = False"


@pytest.mark.parametrize("name", [n for n in NAMES if not METHODS[n].ratio_is_knob])
def test_fixed_ratio_methods_record_their_fixed_ratio(answerer, embedded, name):
    prompt, source, _ = embedded["many"]
    method = get_method(name, 0.42)
    assert method.recompute_ratio == METHODS[name].fixed_ratio
    got = method.prefill(answerer.engine, prompt, source)
    expected = prompt.n_chunk_tokens - (len(prompt.chunk_segments[0]) if name == "prefix" else 0)
    assert got.recomputed_tokens == (expected if method.fixed_ratio == 1.0 else 0)


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].query_pass])
def test_a_shared_query_pass_gives_the_bits_of_a_lone_request(answerer, embedded, name):
    """Every ratio of a query_pass method, and reuse, on one shared pass == each run alone."""
    prompt, source, _ = embedded["many"]
    engine, shared = answerer.engine, {}
    ratios = [0.0, 0.15, 0.3] if METHODS[name].ratio_is_knob else [None]
    for ratio in ratios:
        alone = get_method(name, ratio).prefill(engine, prompt, source, max_new_tokens=4)
        fused, timings = answerer.prefill(prompt, get_method(name, ratio), source, 4, shared)
        assert torch.equal(fused.logits, alone.logits), (name, ratio)
        assert torch.equal(fused.cache.kv[:, :, :, : prompt.n_tokens], alone.cache.kv[:, :, :, : prompt.n_tokens])
        assert (fused.recomputed_tokens, fused.recomputed_token_layers) == (alone.recomputed_tokens,
                                                                            alone.recomputed_token_layers)
        assert fused.info["shared"] == ["query-pass"]
        assert timings["first_token"] >= shared["query-pass"].seconds  # each request pays the whole pass
    assert answerer.decode_many(prompt, [(fused, timings)], 4)[0].text == \
        answerer.answer(prompt, get_method(name, ratios[-1]), source, 4).text


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].uses_store and not METHODS[n].query_pass])
def test_a_shared_loaded_cache_gives_the_bits_of_a_lone_request(answerer, embedded, name):
    """A method that loads every chunk at contiguous positions starts, in a sweep, from a copy of the query pass's
    loaded cache: the same logits, cache and counts as loading alone, at every ratio; charged the loading."""
    prompt, source, _ = embedded["many"]
    engine, shared = answerer.engine, {}
    for ratio in ([0.15, 0.3, 1.0] if METHODS[name].ratio_is_knob else [None]):
        method = get_method(name, ratio)
        loads_everything = engine.loads_everything(method, method.plan(engine, prompt, source, 4), prompt)
        alone = method.prefill(engine, prompt, source, max_new_tokens=4)
        fused, timings = answerer.prefill(prompt, get_method(name, ratio), source, 4, shared)
        assert torch.equal(fused.logits, alone.logits), (name, ratio)
        assert torch.equal(fused.cache.kv[:, :, :, : prompt.n_tokens], alone.cache.kv[:, :, :, : prompt.n_tokens])
        assert (fused.recomputed_tokens, fused.recomputed_token_layers) == (alone.recomputed_tokens,
                                                                            alone.recomputed_token_layers)
        assert ("loaded-kv" in fused.info.get("shared", [])) == loads_everything
        if loads_everything:
            assert timings["first_token"] >= shared["query-pass"].loading_seconds  # each request pays the loading
            assert answerer.decode_many(prompt, [(fused, timings)], 4)[0].text == \
                answerer.answer(prompt, get_method(name, ratio), source, 4).text


def named_configurations(name: str) -> list[dict]:
    """The knobs of each configuration a method names (`-m kvfuse:tuned`), as an entry naming it plans them."""
    return [parse_method_spec(f"{name}:{configuration}").knobs for configuration in METHODS[name].configurations]


CONFIGURATIONS = {name: named_configurations(name) for name in NAMES}
CONFIGURATIONS["kvfuse"] += [{"hop_rows": 16, "hop_weight": 1.0}, {"propagate": "before"}, {"ape_temperature": 0.9},
                             {"budget_slope": 0.5}, {"select_unit": "chunks"}, {"requery": True}]
CONFIGURATIONS["cacheblend"] += [{"gradual": True}]


@contextlib.contextmanager
def caches_filled_with(fill: float):
    KVCache.fill = fill
    try:
        yield
    finally:
        KVCache.fill = 0.0


def fill_runs(answerer, prompt, source, name, fill) -> list[torch.Tensor]:
    """Every configuration of `name` at two ratios, as a sweep runs them over fresh caches filled with `fill`:
    prefilled on one shared query pass, decoded in one batch, full's answer teacher-forced over each."""
    with caches_filled_with(fill):
        full = answerer.answer(prompt, get_method("full"), None, max_new_tokens=6)
        ratios = [0.1, 0.37] if METHODS[name].ratio_is_knob else [None]
        shared = {}
        prefilled = [answerer.prefill(prompt, get_method(name, ratio, **knobs), source, 6, shared)
                     for knobs in [{}] + CONFIGURATIONS.get(name, []) for ratio in ratios]
        answers = answerer.decode_many(prompt, prefilled, 6, keep_logits=True)
        predicted = answerer.predictions_many(answers, full.token_ids)
    return ([full.fused.logits] + [fused.logits for fused, _ in prefilled] + [a.step_logits for a in answers]
            + predicted)


@pytest.mark.parametrize("name", NAMES)
def test_reads_no_cache_row_nothing_wrote(answerer, embedded, name):
    """Any read of a cache row that no load or pass wrote would differ between NaN and zeros (NaN != NaN, so a
    NaN that reaches any logit fails too); over zeros it would be a silent wrong answer."""
    prompt, source, _ = embedded["many"]
    over_zeros = fill_runs(answerer, prompt, source, name, 0.0)
    over_nan = fill_runs(answerer, prompt, source, name, float("nan"))
    for i, (a, b) in enumerate(zip(over_zeros, over_nan)):
        assert torch.equal(a, b), f"{name}: logits {i} differ over a cache filled with NaN: a row nothing wrote was read"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_reads_no_cache_row_nothing_wrote(family):
    """The same on a tiny model of every family (Mistral's sliding window decodes with a mask)."""
    engine, many, _ = tiny_case(family)
    source = stored_prefix_kvs(engine, many)

    def logits(fill):
        out = []
        with caches_filled_with(fill):
            for name in NAMES:
                fused = get_method(name, 0.37).prefill(engine, many, source, max_new_tokens=3)
                out.append(fused.logits)
                position = fused.next_position
                for _ in range(3):   # decoding, one token at a time, over the fused cache
                    out.append(engine.model.decode_step(int(out[-1].argmax()), position, fused.cache,
                                                        fused.calibration))
                    position += 1
        return out
    for i, (a, b) in enumerate(zip(logits(0.0), logits(float("nan")))):
        assert torch.equal(a, b), f"{family}: logits {i} differ over a cache filled with NaN"


def other_value(field, kind):
    """A valid value of a knob that is not its default (what a user could pass)."""
    meta, default = field.metadata, field.default
    if kind is bool:
        return not default
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != default)
    if default is None:
        return kind(meta["min"] if meta.get("min") is not None else 1)
    return default + 1 if kind is int else min(meta.get("max") or 1.0, default + 0.25)


# other values that keep every knob's non-default value valid together (propagate=off, the first other choice,
# would leave key_shift_scale no key to scale, which kvfuse refuses)
TOGETHER = {"kvfuse": {"propagate": "before"}}


def non_default_knobs() -> dict[str, dict]:
    out = {}
    for name in NAMES:
        cls = METHODS[name]
        types = knob_types(cls.Knobs)
        out[name] = {f.name: other_value(f, types[f.name]) for f in dataclasses.fields(cls.Knobs)}
        out[name].update(TOGETHER.get(name, {}))
    return out


def test_knobs_round_trip_into_run_records(tiny_built, tmp_path):
    from kvf.pipeline.workflows.run import RunOptions, run
    knobs = {k: v for per_method in non_default_knobs().values() for k, v in per_method.items()}
    out = tmp_path / "contract.jsonl"
    from rich.console import Console
    import io
    run(RunOptions(out=out, methods=NAMES, ratios=[0.3], dataset=tiny_built / "data", workspace=tiny_built / "ws",
                   limit=1, max_new_tokens=2, knobs=knobs, warmup=False, model=model_of(tiny_built)),
        Console(file=io.StringIO()))
    records = {json.loads(line)["method"]: json.loads(line) for line in out.read_text().splitlines()}
    assert set(records) == set(NAMES)
    for name, expected in non_default_knobs().items():
        settings = records[name]["settings"]
        for knob, value in expected.items():
            assert settings[knob] == value, (name, knob)
        assert settings["ratio"] == (0.3 if METHODS[name].ratio_is_knob else METHODS[name].fixed_ratio)


def test_every_knob_has_a_run_and_bench_flag():
    import typer
    from kvf.cli.main import app
    command = typer.main.get_command(app)
    for sub in ("run", "bench"):
        flags = {opt for p in command.commands[sub].params for opt in p.opts}
        for name in NAMES:
            for f in dataclasses.fields(METHODS[name].Knobs):
                assert flag_name(f.name) in flags, (sub, name, f.name)


@pytest.mark.parametrize("name", NAMES)
def test_summary_is_the_readme_row_and_kvf_methods_prints_it(name):
    from pathlib import Path
    from typer.testing import CliRunner
    from kvf.cli.main import app
    summary = METHODS[name].summary
    assert summary and "\n" not in summary, f"{name}: give the class a one-line summary"
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"| `{name}` | {summary.replace('|', chr(92) + '|')} |" in readme, f"README.md: no methods row for {name} saying its summary"
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
    for f in dataclasses.fields(METHODS[name].Knobs):                                  # the row's knobs column
        assert "--" + f.name.replace("_", "-") in row, f"README.md: {name}'s row does not list --{f.name.replace('_', '-')}"
    listed = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "400"}).output
    assert " ".join(summary.split()) in listed, name
    narrow = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "80"}).output   # one block per method there
    assert max(map(len, narrow.splitlines())) <= 80 and " ".join(summary.split()) in " ".join(narrow.split()), name
    detail = CliRunner().invoke(app, ["methods", name], env={"COLUMNS": "80"}).output   # one method: each knob's help
    assert max(map(len, detail.splitlines())) <= 80 and detail.split()[0] == name
    for f in dataclasses.fields(METHODS[name].Knobs):
        assert " ".join(f.metadata.get("help", "").split()) in " ".join(detail.split()), (name, f.name)
    assert f"methods/{name}.py" in "".join(detail.split())                              # and the file to read


def test_registry_rejects_a_second_method_of_the_same_name():
    class Impostor(METHODS["reuse"]):
        name = "reuse"
    with pytest.raises(KvfError, match="registered twice"):
        register(Impostor)
    assert METHODS["reuse"] is not Impostor


def test_out_of_range_knobs_name_the_flag():
    for name in NAMES:
        cls = METHODS[name]
        types = knob_types(cls.Knobs)
        for f in dataclasses.fields(cls.Knobs):
            if f.metadata.get("min") is not None and types[f.name] in (int, float):
                with pytest.raises(KvfError, match=flag_name(f.name)):
                    get_method(name, **{f.name: f.metadata["min"] - 1})
            if f.metadata.get("choices"):
                with pytest.raises(KvfError, match=flag_name(f.name)):
                    get_method(name, **{f.name: "no-such-choice"})


def recipe_method(folder):
    """ARCHITECTURE.md's example method ("Recipe: adding a method"), written as one file into folder."""
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "ARCHITECTURE.md").read_text()
    recipe = text[text.index("## Recipe: adding a method"):]
    code = recipe[recipe.index("```python\n") + len("```python\n"): recipe.index("```\n", recipe.index("```python"))]
    folder.mkdir()
    (folder / "mine.py").write_text(textwrap.dedent(code))
    return {**os.environ, "KVF_METHOD_PATH": str(folder), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_a_method_in_one_file_is_found_by_kvf_run_with_its_flags(tiny_built, tmp_path):
    env = recipe_method(tmp_path / "methods")
    kvf = [sys.executable, "-m", "kvf"]
    help_text = subprocess.run([*kvf, "run", "--help"], capture_output=True, text=True, env=env).stdout
    assert "--from-end" in help_text
    out = tmp_path / "mine.jsonl"
    proc = subprocess.run([*kvf, "run", "-d", tiny_built / "data", "-w", tiny_built / "ws", "--model",
                           model_of(tiny_built), "-m", "mine", "--from-end", "-r", "0.5",
                           "-n", "1", "--max-new-tokens", "2", "-o", out, "--no-show-answers"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text().splitlines()[0])
    assert record["method"] == "mine" and (record["settings"]["ratio"], record["settings"]["from_end"]) == (0.5, True)
    assert abs(record["recomputed_tokens"] - round(0.5 * record["chunk_tokens"])) <= len(record["chunk_ids"])


BROKEN_METHOD_FILES = {   # a method file of one's own that does not load: a traceback from the CLI's import was all
    "syntax.py": ("x = 1\ndef f(:\n", "syntax.py line 2: SyntaxError: invalid syntax"),
    "missing.py": ("import os\nimport no_such_package_kvf\n", "missing.py line 2: ModuleNotFoundError: No module named"),
    "unnamed.py": ("from kvf.pipeline.fusion.methods import FusionMethod, register\n@register\n"
                   "class Unnamed(FusionMethod):\n    summary = 'x'\n", "unnamed.py line 2: TypeError: Unnamed has no `name`"),
    "twice.py": ("from kvf.pipeline.fusion.methods import FusionMethod, register\n@register\n"
                 "class Full(FusionMethod):\n    name = 'full'\n", "method name 'full' is registered twice"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_METHOD_FILES))
def test_a_method_file_that_does_not_load_is_one_line_naming_it(tmp_path, name):
    text, expected = BROKEN_METHOD_FILES[name]
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / name).write_text(text)
    env = {**os.environ, "KVF_METHOD_PATH": str(tmp_path / "methods"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvf", "methods"], capture_output=True, text=True, env=env)
    assert_one_line(proc.returncode, proc.stderr, expected)
    if name != "twice.py":
        assert f"fix the method file, or move it out of {tmp_path / 'methods'}" in proc.stderr


def test_an_error_in_a_method_of_ones_own_is_blamed_on_its_file(tiny_built, tmp_path):
    """It was "internal error ... (please report it)": an error of kvf's, in a method kvf never saw."""
    write_raising_method(tmp_path / "methods")
    (tmp_path / "linked").symlink_to(tmp_path / "methods")   # a folder reached through a link is the same files
    env = {**os.environ, "KVF_METHOD_PATH": str(tmp_path / "linked"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvf", "run", "-d", tiny_built / "data", "-w", tiny_built / "ws",
                           "--model", model_of(tiny_built), "-m", "boom", "-r", "0.5", "-n", "1", "--max-new-tokens",
                           "2", "-o", tmp_path / "o.jsonl"],
                          capture_output=True, text=True, env=env)
    assert_one_line(proc.returncode, proc.stderr, f"{tmp_path / 'linked' / 'boom.py'} {RAISING_METHOD_ERROR}")
    assert proc.returncode == 1


def test_the_recipe_method_passes_the_contract(tmp_path):
    """The example a contributor copies passes every check of this file that runs on it, but the README row."""
    env = recipe_method(tmp_path / "methods")
    select = "(mine or every_family or run_and_bench_flag or out_of_range) and not readme_row"   # round trip: the test above
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", __file__, "-k", select],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for test in ("compute_everything_equals_full_on_the_embedded_model[mine]", "recomputes_its_budget[0.1-mine]",
                 "recomputes_its_budget[0.37-mine]", "every_knob_has_a_run_and_bench_flag",
                 "reads_no_cache_row_nothing_wrote[mine]", "every_family_reads_no_cache_row_nothing_wrote[llama]"):
        assert f"{test} PASSED" in proc.stdout, test


@pytest.mark.parametrize("name", [n for n in NAMES if get_method(n, 0.0).is_reuse()])
def test_a_method_that_says_it_is_reuse_gives_reuse_bits(answerer, embedded, name):
    """is_reuse() lets a sweep share reuse's prefill and decoding; it must then be reuse, bit for bit."""
    method = get_method(name, 0.0)
    prompt, exact, _ = embedded["many"]
    source = InMemoryKV([kv.half().float() for kv in exact.chunk_kvs], exact.chunk_extras)  # the store's float16
    got = method.prefill(answerer.engine, prompt, source, max_new_tokens=4)
    reuse = get_method("reuse").prefill(answerer.engine, prompt, source, max_new_tokens=4)
    assert torch.equal(got.logits, reuse.logits)
    assert torch.equal(got.cache.kv[:, :, :, : prompt.n_tokens], reuse.cache.kv[:, :, :, : prompt.n_tokens])
    assert got.recomputed_tokens == 0


def test_kvf_methods_json_lists_every_method_with_its_knob_defaults(capsys):
    """`kvf methods --json`, for scripts that build sweeps: every registered method, its knobs as values."""
    from kvf.cli.methods_cmd import methods_command
    methods_command(names=False, json_out=True)
    listed = {m["method"]: m for m in json.loads(capsys.readouterr().out)}
    assert sorted(listed) == sorted(NAMES)
    for name, cls in METHODS.items():
        assert listed[name]["knobs"] == {f.name: f.default for f in dataclasses.fields(cls.Knobs)}, name
        assert listed[name]["ratio_is_knob"] == cls.ratio_is_knob and listed[name]["summary"] == cls.summary
        assert listed[name]["configurations"] == cls.configurations, name   # `-m kvfuse:tuned`'s knobs, written out
    assert "tuned" in listed["kvfuse"]["configurations"]


def test_the_ratio_kvf_methods_shows_is_the_one_a_method_runs_at(capsys):
    """`kvf methods` showed cachecraft --ratio [0.3] and prophetkv [0.2] (their papers'), while `kvf run`
    and Workspace.answer ran every method at 0.15. The default shown is now the default used; a paper's
    own ratio is shown apart."""
    from kvf.cli.methods_cmd import method_row, methods_command
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO
    methods_command(names=False, json_out=True)
    listed = {m["method"]: m for m in json.loads(capsys.readouterr().out)}
    for name, cls in METHODS.items():
        built = get_method(name)                      # no ratio given, as `kvf run` without -r
        assert listed[name]["default_ratio"] == built.recompute_ratio, name
        assert built.recompute_ratio == (DEFAULT_RATIO if cls.ratio_is_knob else cls.fixed_ratio), name
    assert listed["cachecraft"]["paper_ratio"] == 0.3 and listed["prophetkv"]["paper_ratio"] == 0.2
    assert method_row(METHODS["prophetkv"], "prophetkv")["ratio"] == f"--ratio [{DEFAULT_RATIO:g}] (paper: 0.2)"
