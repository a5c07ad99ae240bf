"""The Python API behind `kvf.open_workspace`: answer questions from a built workspace in a notebook."""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path

from kvf.cachestore import remote_failure
from kvf.errors import KvfError, called_as, counted, errors_name_arguments, percent_as_fraction, warn
from kvf.pipeline.data.datasets import digits_of
from kvf.pipeline.fusion.methods import METHODS, build_method, check_method_name
from kvf.pipeline.fusion.controller import DEFAULT_QUALITY_FLOOR, measure_token_layer_seconds
from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO, knob_errors_named
from kvf.pipeline.workflows.run import (DEFAULT_TOP_K, check_index_fresh, parse_method_spec, repeated, warn_corpus_changed,
                                       with_auto_ratio)
from kvf.pipeline.workflows.devices import dtype_name
from kvf.pipeline.workflows.session import Session, check_entries_dtype, workspace_path
from kvf.pipeline.workflows.workspace import VARIANTS, document_meant


def store_failures_named(function):
    """An object store's failure mid-call (its endpoint went down after the workspace opened) raised as a
    KvfError, the line the CLI gives, not as botocore's or aiohttp's own exception."""
    @functools.wraps(function)
    def named(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except KvfError:
            raise
        except Exception as e:
            said = remote_failure(e)
            if said is None:
                raise
            raise KvfError(said) from None
    return named


class SearchHit(typing.NamedTuple):
    """One chunk `search()` found: what `kvf search --json` prints of it."""
    chunk_id: str
    score: float
    doc_id: str                        # the document it is cut from (a file name, or a .jsonl's "id")
    text: str


@dataclass
class WorkspaceAnswer:
    text: str
    chunk_ids: list[str]               # the chunks in prompt order
    recomputed_tokens: int
    chunk_tokens: int
    prompt_tokens: int
    timings: dict                      # seconds: load, select, recompute, first_token (TTFT), decode
    settings: dict = field(default_factory=dict)


class WorkspaceSession:
    """kvf.open_workspace(path): `answer()` retrieves (or takes) chunks and fuses their stored KVs."""

    @errors_name_arguments({"path": "--workspace"})
    def __init__(self, path: str | Path, model: str | None = None, device: str = "cpu", dtype: str | None = None):
        if not isinstance(path, (str, Path)):
            raise KvfError(f"open_workspace({path!r}): pass the workspace's folder, e.g. open_workspace(\"workspace\")")
        for name, value, kinds, example in (("model", model, (str, Path), "a model folder or .gguf file"),
                                            ("device", device, str, "'cpu' or 'cuda'"),
                                            ("dtype", dtype, str, "'float32', 'bfloat16' or 'float16'")):
            if value is not None and not isinstance(value, kinds):
                raise KvfError(f"{name}={value!r}: pass {example}")   # an AttributeError deep in kvf otherwise
        ws = workspace_path(path)
        if not ws.manifest_path.is_file():
            raise ws.not_built(named="", pass_as="path='{}'")
        self.path = ws.root
        warn_corpus_changed(ws)
        self._session = Session(ws, model, device, dtype)
        try:
            check_entries_dtype(ws, dtype_name(self.session.dtype),
                                fix=called_as("pass --dtype {built}", "pass open_workspace(..., dtype=\"{built}\")"))
        except KvfError:
            self.close()   # refused: the store is let go now, not when the half-made object is collected
            raise
        self._searchers: dict[str, object] = {}
        self._token_layer_seconds: float | None = None   # ratio="auto"'s calibration, measured on first use
        # a model that fails to load on the first answer is named model=..., as open_workspace() took it
        self.opened_with = {"--model": ("model", model), "--device": ("device", device), "--dtype": ("dtype", dtype)}

    def close(self) -> None:
        """Release the workspace's store (`kvf store gc` refuses while a session holds it) and the model;
        answer() and search() refuse after. `with kvf.open_workspace(...) as ws:` closes it at the block's end."""
        if self._session is not None:
            self._session.close()
            self._session, self._searchers = None, {}

    def __repr__(self) -> str:
        """What a notebook shows for `ws`: the workspace, its size, and what answers from it."""
        if self._session is None:
            return f"<kvf workspace {self.path} (closed)>"
        s = self._session
        # a workspace kvf run (or build-cache --indexes-only) made has no variant built whole: its store holds
        # what earlier questions needed, and "none yet" read as an empty store
        variants = s.manifest["variants"]
        kvs = f"KV variants {', '.join(variants)}" if variants else "KVs computed as questions need them"
        return (f"<kvf workspace {self.path}: {counted(len(s.chunks_by_id), 'chunk')} (up to "
                f"{s.manifest['chunk_tokens']} tokens), {kvs}; {s.model_ref.name} on {s.device}, {dtype_name(s.dtype)}>")

    def __enter__(self) -> "WorkspaceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def session(self) -> Session:
        if self._session is None:
            raise KvfError("this workspace was closed (ws.close(), or the end of its with block); open it again "
                           "with kvf.open_workspace(...)")
        return self._session

    @store_failures_named
    @errors_name_arguments(more=lambda self: self.opened_with)
    def search(self, question: str, top_k: int = DEFAULT_TOP_K, retriever: str | None = None) -> list[SearchHit]:
        """The top-k chunks for a question, best first: each one's chunk id, score, document id and text
        (retriever: bm25, or dense in a workspace built --no-bm25, unless given)."""
        check_question(question)
        retriever = retriever or self.session.ws.default_retriever()
        check_argument("top_k", top_k, int, low=1, why="retrieve at least 1 chunk")
        if retriever not in ("bm25", "dense"):
            raise KvfError(f"--retriever {retriever}: use bm25 or dense")
        if retriever not in self._searchers:   # an index of an older chunk set would miss every newer document
            check_index_fresh(self.session.ws, retriever)
            self._searchers[retriever] = self.session.ws.open_searcher(retriever)
        found = self._searchers[retriever].search(question, top_k)                    # [(chunk id, score)]
        chunks = self.session.chunks([cid for cid, _ in found], retriever)
        return [SearchHit(cid, score, chunk.doc_id, chunk.text) for (cid, score), chunk in zip(found, chunks)]

    @store_failures_named
    @errors_name_arguments(more=lambda self: self.opened_with)
    def answer(self, question: str, method: str = "cacheblend", ratio: float | str | None = None,
               top_k: int | None = None, retriever: str | None = None, documents: list[str] | None = None,
               variant: str | None = None, max_new_tokens: int = 32, quality_floor: float | None = None,
               **knobs) -> WorkspaceAnswer:
        """Answer by fusing stored chunk KVs: the chunks of `documents` (ids of the workspace's corpus), in
        order, or else the top-k retrieved ones (top_k 5, retriever bm25 or the workspace's only index, unless
        given). Knobs are the method's (e.g. check_layer=2 for cacheblend). `method` may also be kvf run -m's
        entry: a named configuration ('kvfuse:tuned') or knobs written in ('cacheblend:check_layer=2:variant=fusion'),
        a keyword knob overriding the entry's. ratio="auto": the loading controller picks it, as kvf run -r auto
        does (recomputing a layer takes as long as loading one; at least quality_floor, default --quality-floor's)."""
        s = self.session
        if isinstance(documents, (list, tuple)):   # a .jsonl corpus's {"id": 1} is document "1"
            documents = [digits_of(d) for d in documents]
        check_answer_args(question, method, ratio, top_k, variant, max_new_tokens, documents, quality_floor)   # retriever: search() checks it
        auto = ratio == "auto"
        if documents is not None:   # they name the chunks: a retrieval argument beside them would be dropped
            for name, value in (("top_k", top_k), ("retriever", retriever)):
                if value is not None:
                    flag = "--" + name.replace("_", "-")   # as kvf ask names it; a notebook's call sees top_k=3
                    raise KvfError(f"{flag} {value}: --documents name the chunks, so nothing is retrieved; leave out "
                                   f"{flag}, or leave out --documents to retrieve")
        top_k, retriever = top_k or DEFAULT_TOP_K, retriever or s.ws.default_retriever()
        spec = parse_method_spec(method, f"method={method!r}")   # 'kvfuse:tuned', as kvf run -m and kvf bench -m take it
        check_own_knobs(spec.name, knobs)
        if variant is not None and spec.variant not in (None, variant):
            raise KvfError(f"variant={variant!r}: method={method!r} sets variant={spec.variant}; give it once")
        knobs = {**spec.knobs, **knobs}   # a keyword knob overrides the entry's, as a knob after it does in -m
        # a knob was an argument here: the same line, naming it check_layer=99 rather than --check-layer 99
        with knob_errors_named(knobs, lambda knob, problem: f"{knob}={knobs[knob]!r}: {problem}"):
            fusion = build_method(spec.name, ratio if ratio is not None and not auto else DEFAULT_RATIO, knobs)
            fusion.check_model(s.n_layers)
        if ratio is not None and not fusion.ratio_is_knob and (auto or abs(ratio - fusion.recompute_ratio) > 1e-9):
            raise KvfError(f"ratio={ratio!r}: {spec.name} always recomputes {fusion.recompute_ratio:g} of the chunk "
                           "tokens; leave ratio out, or pick a method with a ratio (kvf methods)")
        if documents is not None:
            if not documents:   # an empty list would answer with no context at all
                raise KvfError("documents=[]: name at least one document id, or leave documents out to retrieve")
            doc_chunks = s.ws.doc_chunks()
            missing = [d for d in documents if d not in doc_chunks]
            if missing:
                meant = document_meant(missing[0], doc_chunks)
                raise KvfError(f"{called_as('--documents: ', '')}document {missing[0]!r} is not in workspace {s.ws.root}"
                               + (f"; did you mean {meant!r}?" if meant else
                                  f"; its ids are its documents' own, e.g. {next(iter(doc_chunks))!r} (each "
                                  "hit of `kvf search`, or of ws.search(), has its doc_id)"))
            if twice := repeated(documents):   # as kvf run says of a question citing a passage twice
                warn(f"{called_as('--documents', 'documents=[...]')} names {twice[0]!r} more than once; its chunks go "
                     "into the prompt each time it is named")
            chunk_ids = [cid for d in documents for cid in doc_chunks[d]]
        else:
            chunk_ids = [hit.chunk_id for hit in self.search(question, top_k, retriever)]
            if not chunk_ids:   # BM25 matched no word of it: every method would answer alike, without context
                raise KvfError(f"{retriever} retrieval found no chunk for {question!r}; rephrase it, pass "
                               "--retriever dense, or name its --documents (ids of the workspace's documents)")
        chunks = s.chunks(chunk_ids, retriever)
        prompt = s.prompt(chunks, question)
        variant = variant or spec.variant or fusion.offline_variant
        s.serve_extras(fusion)   # cachecraft's entries carry summaries: computed here, as kvf run computes them
        keys = s.entries(variant, chunks) if fusion.uses_store else None
        if auto:   # untimed, as in kvf run: a calibration of this store's reads against this model's layers
            fusion = with_auto_ratio(fusion, s.store, keys, prompt, self.token_layer_seconds(),
                                     DEFAULT_QUALITY_FLOOR if quality_floor is None else quality_floor)
        fused = s.answer(prompt, fusion, keys, max_new_tokens)
        record = fused.answer.record()
        return WorkspaceAnswer(fused.answer.text, chunk_ids, record["recomputed_tokens"], record["chunk_tokens"],
                               record["prompt_tokens"], record["timings"],
                               {**fusion.settings(), "variant": variant, **({"ratio_mode": "auto"} if auto else {})})

    def token_layer_seconds(self) -> float:
        """Seconds to push one token through one layer of this workspace's model (ratio="auto" weighs it against
        the store's reads), measured once."""
        if self._token_layer_seconds is None:
            self._token_layer_seconds = measure_token_layer_seconds(self.session.answerer.transformer)
        return self._token_layer_seconds


def check_argument(name: str, value, kind: type, low: float, high: float | None = None, why: str = "",
                   also: str = "") -> None:
    """One number a notebook passes: of its kind (a string or a bool would fail deep in torch, or pass as 1),
    within its range. None means "not given" and passes."""
    if value is None:
        return
    kinds = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise KvfError(f"{name}={value!r}: must be {'a number' if kind is float else 'an integer'}"
                       + (f" {also}" if also else ""))
    if not low <= value or (high is not None and not value <= high):   # written so that NaN fails too
        raise KvfError(f"{name}={value!r}: {why}")


def check_question(question) -> None:
    if not isinstance(question, str) or not question.strip():
        raise KvfError(f"question={question!r}: pass the question as a non-empty string")


def check_answer_args(question, method, ratio, top_k, variant, max_new_tokens, documents, quality_floor) -> None:
    """answer()'s own arguments, named as a notebook passes them (the engine's checks name the CLI's flags)."""
    check_question(question)
    if not isinstance(method, str):   # a list of methods is kvf run's -m; answer() runs one
        raise KvfError(f"method={method!r}: pass one method's name, e.g. method='cacheblend' (kvf methods lists "
                       "them); answer() runs one method a call")
    # a bare string would be read letter by letter as document ids
    if documents is not None and (not isinstance(documents, (list, tuple))
                                  or not all(isinstance(d, str) for d in documents)):
        raise KvfError(f"documents={documents!r}: pass a list of document ids, e.g. documents=['acme.md']")
    percent = percent_as_fraction(str(ratio)) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else None
    if ratio != "auto":
        check_argument("ratio", ratio, float, low=0, high=1, why="must be within [0, 1] (a fraction of the chunk tokens)"
                       + (f"; for {ratio:g}% pass ratio={percent}" if percent else ""), also="or 'auto'")
    check_argument("quality_floor", quality_floor, float, low=0, high=1, why="must be within [0, 1]")
    if quality_floor is not None and ratio != "auto":   # it would be dropped without a word
        raise KvfError(f"quality_floor={quality_floor!r}: it is the least ratio=\"auto\" picks; pass ratio=\"auto\", "
                       "or leave quality_floor out")
    check_argument("top_k", top_k, int, low=1, why="retrieve at least 1 chunk")
    if variant is not None and variant not in VARIANTS:
        raise KvfError(f"variant={variant!r}: use prefix or fusion (or leave it out: the method's own)")
    check_argument("max_new_tokens", max_new_tokens, int, low=0, why="must be >= 0 (0: the first token's work only)")


# what other tools (and kvf's own code) call answer()'s arguments
ARGUMENT_ALIASES = {"k": "top_k", "topk": "top_k", "top_n": "top_k", "recompute_ratio": "ratio",
                    "max_tokens": "max_new_tokens", "docs": "documents", "doc_ids": "documents",
                    "passages": "documents"}   # a questions file's "passages" are documents here
WORKSPACE_ARGUMENTS = ("model", "device", "dtype")   # the workspace's model and where it runs: one per open workspace


def check_own_knobs(method: str, knobs: dict) -> None:
    """answer(**knobs): a knob the method does not take (a typo, another method's, one of answer()'s own
    arguments under another name) is refused, not ignored."""
    check_method_name(method, f"method={method!r}")   # named as the notebook passed it
    own = [f.name for f in dataclasses.fields(METHODS[method].Knobs)]
    for name in knobs:
        if name in own:   # a method's own knob, even one named like an argument (a KVF_METHOD_PATH method's `k`)
            continue
        if name in WORKSPACE_ARGUMENTS:
            raise KvfError(f"{name}={knobs[name]!r}: the workspace's, not an answer's; pass it when opening: "
                           f"kvf.open_workspace(path, {name}={knobs[name]!r})")
        if name in ARGUMENT_ALIASES:
            raise KvfError(f"{name}={knobs[name]!r}: answer() calls it {ARGUMENT_ALIASES[name]}; "
                           f"pass {ARGUMENT_ALIASES[name]}={knobs[name]!r}")
        raise KvfError(f"{name}={knobs[name]!r}: not a knob of {method}; its knobs: {', '.join(own) or 'none'} "
                       "(kvf methods lists them)")
