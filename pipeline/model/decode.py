"""Greedy decoding from a fused cache: stop on EOS, a stop string, or --max-new-tokens."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvf.pipeline.model.forward import KVCache, SpanCalibration, Transformer
from kvf.pipeline.model.rope import apply_rope


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    decode_seconds: float
    step_logits: torch.Tensor | None = None   # [steps, vocab] the logits each step took its token from (keep_logits)


def stop_token_ids(tokenizer, model: Transformer) -> set[int]:
    """EOS from the tokenizer, the model's config and its generation_config.json: chat models end turns with their
    own token, which Llama-3-Instruct names there alone (<|eot_id|> beside <|end_of_text|>)."""
    ids = set()
    generation = getattr(model.hf_model, "generation_config", None)
    for source in (tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None),
                   getattr(generation, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        ids.add(im_end)
    return ids


@torch.inference_mode()
def greedy_decode(model: Transformer, tokenizer, logits: torch.Tensor, cache: KVCache, next_position: int,
                  max_new_tokens: int = 32, stop_strings: tuple[str, ...] = (),
                  calibration: SpanCalibration | None = None, keep_logits: bool = False) -> Generation:
    """The first token comes from the prefill's logits [vocab]; each next one from one decode step
    appended to `cache` at RoPE position next_position, next_position + 1, ...
    keep_logits: also return every step's logits (a stop token's step included)."""
    started = time.perf_counter()
    stops = stop_token_ids(tokenizer, model)
    token_ids: list[int] = []
    kept: list[torch.Tensor] = []
    position = next_position
    for step in range(max_new_tokens):
        if keep_logits:
            kept.append(logits)
        token = int(torch.argmax(logits))
        if token in stops:
            break
        token_ids.append(token)
        if stop_strings and answer_text(tokenizer, token_ids, stop_strings)[1]:
            break
        if step + 1 < max_new_tokens:
            logits = model.decode_step(token, position, cache, calibration)
            position += 1
    return Generation(answer_text(tokenizer, token_ids, stop_strings)[0], token_ids, time.perf_counter() - started,
                      torch.stack(kept) if kept else None)


def answer_text(tokenizer, token_ids: list[int], stop_strings: tuple[str, ...]) -> tuple[str, bool]:
    """The answer's text, cut at the first stop string after its first non-blank character (a base model's answer
    is its first line, which may follow a line break: "Answer:\nParis\n"), and whether a stop string cut it."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True).lstrip()
    cut = min((text.find(s) for s in stop_strings if s in text), default=-1)
    return (text if cut < 0 else text[:cut]).strip(), cut >= 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (one ending first counts there); None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def known_steps(step_logits: torch.Tensor | None, decoded: list[int], tokens: list[int]) -> int:
    """How many of teacher forcing's rows over `tokens` greedy decoding has already computed: row i is
    the logits after tokens[:i], which decoding saw while its own tokens were the same (i <= the first
    difference) and it reached step i. 0 if it kept no logits."""
    if step_logits is None:
        return 0
    parted = first_difference(decoded, tokens)
    same = len(tokens) if parted is None else parted
    return min(same + 1, len(step_logits), len(tokens))


def teacher_forced_logits(model: Transformer, known: torch.Tensor, cache: KVCache, prefill_rows: int,
                          next_position: int, tokens: list[int],
                          calibration: SpanCalibration | None = None, attention_out: list | None = None,
                          attention_rows: slice = slice(None)) -> torch.Tensor:
    """The logits [T, vocab] with which a fused cache would predict `tokens` (T of them, e.g. full prefill's
    answer), each given the ones before it: row i comes from tokens[:i] appended to the cache after its first
    prefill_rows rows, in one pass, as greedy_decode would append them one by one.

    known [k, vocab], k >= 1: the first rows, already computed: the prefill's first logits (k = 1), or more
    where greedy decoding wrote tokens[:k-1] into the cache's rows after prefill_rows (known_steps). The pass
    feeds only tokens[k-1:T-1]; the rows it writes (an answer decoded there) are overwritten. attention_out
    collects, per layer, the head-averaged attention [t', n] of the fed tokens picked by attention_rows."""
    item = Forced(known, cache, prefill_rows, next_position, calibration)
    return teacher_forced_batch(model, [item], tokens, attention_out, attention_rows)[0]


def forced_feed(known: torch.Tensor, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Teacher forcing's plan: (k, fed), the k rows of `known` it keeps and the indices [f] of the tokens it
    feeds, tokens[k-1:T-1] (none when every row is known)."""
    start = min(len(known), len(tokens))
    return start, torch.arange(start - 1, len(tokens) - 1)


@dataclass
class CacheRows:
    """One cache's part of a batched layer (layer_over_caches): the contiguous cache rows [f] its fed tokens
    take, their mask [f, n] (None: a decode step's one token, which sees every key) and its calibration."""
    cache: KVCache
    rows: torch.Tensor
    mask: torch.Tensor | None = None
    calibration: SpanCalibration | None = None


def layer_over_caches(model: Transformer, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      parts: list[CacheRows], attention_out: list | None = None,
                      attention_rows: slice = slice(None)) -> torch.Tensor:
    """One layer for the fed tokens of several caches, hidden [F, D] (each part's rows in turn, F in all) at
    RoPE tables cos/sin [F, d]: the projections, norms and MLP on all F rows in one call (on a CPU a small
    call's cost is mostly overhead), each part's K/V written to its cache and attention over its own cache.
    attention_out (one part only): the head-averaged attention [t', n] of its rows picked by attention_rows."""
    q, k, v = model.project_qkv(layer, hidden)                                        # [H, F, d], [KV, F, d]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    sizes = [len(part.rows) for part in parts]
    outs = []
    for part, q_i, k_i, v_i in zip(parts, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1)):
        cache = part.cache
        cache.write(layer, slice(int(part.rows[0]), int(part.rows[-1]) + 1), k_i, v_i)    # contiguous rows
        if attention_out is not None:
            probs = model.attention_probs(q_i[:, attention_rows], cache.keys(layer), part.mask[attention_rows])
            attention_out.append(probs.mean(dim=0))                                   # [t', n]
        outs.append(model.attention(q_i, cache.keys(layer), cache.values(layer), part.mask, rows=part.rows,
                                    calibration=part.calibration))                    # [f_i, H*d]
    return model.mlp(layer, hidden + model.layers[layer].self_attn.o_proj(torch.cat(outs)))


@dataclass
class Forced:
    """One cache for teacher_forced_batch: its known rows [k, vocab] (as teacher_forced_logits' `known`),
    the cache, its prefill's rows, the next RoPE position, and its decoding's calibration if any."""
    known: torch.Tensor
    cache: KVCache
    prefill_rows: int
    next_position: int
    calibration: SpanCalibration | None = None


@torch.inference_mode()
def teacher_forced_batch(model: Transformer, items: list[Forced], tokens: list[int], attention_out: list | None = None,
                         attention_rows: slice = slice(None)) -> list[torch.Tensor]:
    """teacher_forced_logits for several caches and the same `tokens`, in one pass: each layer is one
    layer_over_caches over every cache's fed rows (as greedy_decode_batch's steps are). -> per item, logits
    [T, vocab]. attention_out (one item only): per layer, the head-averaged attention [t', n] of its fed rows
    picked by attention_rows."""
    if attention_out is not None and len(items) != 1:
        raise ValueError("teacher_forced_batch: attention_out reads one cache's attention; give one item")
    plans = [forced_feed(item.known, tokens) for item in items]
    fed_items = [i for i, (_, fed) in enumerate(plans) if len(fed)]
    out = [item.known[:start] for item, (start, _) in zip(items, plans)]
    if not fed_items:
        return out
    parts = []
    for i in fed_items:
        item, fed = items[i], plans[i][1]
        item.cache.length = item.prefill_rows + len(tokens) - 1
        rows = item.prefill_rows + fed                                                # [f_i] cache rows
        parts.append(CacheRows(item.cache, rows, model.causal_mask(rows, item.cache.length), item.calibration))
    sizes = [len(part.rows) for part in parts]
    positions = torch.cat([items[i].next_position + plans[i][1] for i in fed_items])   # [F] RoPE positions
    cos, sin = model.rope.cos_sin(positions, model.dtype)                             # [F, d]
    hidden = model.embed(torch.tensor([tokens[j] for i in fed_items for j in plans[i][1].tolist()]))  # [F, D]
    for layer in range(model.n_layers):
        hidden = layer_over_caches(model, layer, hidden, cos, sin, parts, attention_out, attention_rows)
    for i, logits in zip(fed_items, model.logits(hidden).split(sizes)):             # [f_i, vocab] each
        out[i] = torch.cat([out[i], logits])                                          # [T, vocab]
    return out


@dataclass
class Pending:
    """A prefilled answer waiting to be decoded: first-token logits [vocab], its cache, its next position."""
    logits: torch.Tensor
    cache: KVCache
    next_position: int


@torch.inference_mode()
def greedy_decode_batch(model: Transformer, tokenizer, items: list[Pending], max_new_tokens: int = 32,
                        stop_strings: tuple[str, ...] = (), keep_logits: bool = False) -> list[Generation]:
    """Greedy decoding of several answers at once, each over its own cache: the same steps as
    greedy_decode, but each step is one layer_over_caches per layer over all active answers. decode_seconds
    of each Generation is the batch's time shared equally; keep_logits as in greedy_decode."""
    started = time.perf_counter()
    stops = stop_token_ids(tokenizer, model)
    tokens: list[list[int]] = [[] for _ in items]
    kept: list[list[torch.Tensor]] = [[] for _ in items]     # per answer, each step's logits [vocab]
    positions = [item.next_position for item in items]
    current = [item.logits for item in items]                # per answer, this step's logits [vocab]
    next_token = [int(torch.argmax(logits)) for logits in current]
    active = list(range(len(items)))
    for step in range(max_new_tokens):
        still = []
        for i in active:  # take this step's token; finish on a stop token or a stop string
            if keep_logits:
                kept[i].append(current[i])
            if next_token[i] in stops:
                continue
            tokens[i].append(next_token[i])
            if stop_strings and answer_text(tokenizer, tokens[i], stop_strings)[1]:
                continue
            still.append(i)
        active = still
        if not active or step + 1 == max_new_tokens:
            break
        parts = [CacheRows(items[i].cache, torch.tensor([items[i].cache.length])) for i in active]  # each new row
        for i in active:
            items[i].cache.length += 1
        hidden = model.embed(torch.tensor([tokens[i][-1] for i in active]))            # [a, D]
        cos, sin = model.rope.cos_sin(torch.tensor([positions[i] for i in active]), hidden.dtype)  # [a, d]
        for layer in range(model.n_layers):
            hidden = layer_over_caches(model, layer, hidden, cos, sin, parts)
        logits = model.logits(hidden)                                                   # [a, vocab]
        for j, i in enumerate(active):
            current[i] = logits[j]
            next_token[i] = int(torch.argmax(logits[j]))
            positions[i] += 1
    share = (time.perf_counter() - started) / max(1, len(items))
    generations = []
    for token_ids, steps in zip(tokens, kept):
        generations.append(Generation(answer_text(tokenizer, token_ids, stop_strings)[0], token_ids, share,
                                      torch.stack(steps) if steps else None))
    return generations
