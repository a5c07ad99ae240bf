"""`kvfuse`: kvf's own method. Design, ablation and held-out numbers: results/kvfuse.md.

What the harness showed on MuSiQue dev questions (the first ones of the file; held-out numbers use
later questions, results/kvfuse/runs/):
- at 15%, ProphetKV's layer-averaged question attention keeps more fidelity than FusionRAG's
  last-layer attention on the same similarity-enhanced (`fusion`) stored variant (dev: 0.90 vs 0.83);
  kvfuse ranks tokens by the layer average (score_layers=all) on the `fusion` variant. Scoring with
  the early layers only, or forcing EPIC's first tokens of every chunk into the budget, changed
  little (0.90, 0.91).
- what no method repairs is the 85% of rows it keeps: they still miss the cross-chunk context. The
  recomputed rows of the same chunk show, layer by layer, how that context moves K and V (fresh -
  stored). After each layer kvfuse adds each chunk's mean move to the chunk's kept rows (keys
  compared before RoPE and re-rotated at each kept row's position, so the move does not depend on
  where rows sit). The layer's own attention has already run, so the first token is ProphetKV's on
  the fusion variant; decoding reads the shifted rows (dev fidelity 0.94 vs 0.90 without).
  Cost: a few tensor ops per layer for all chunks at once (shift_kept_rows), no extra forward work;
  since only decoding reads the shifted rows, they are shifted after the first token (finish). The
  stored KV of the rows pass 2 overwrites is kept by the engine (engine.keep_stored_rows): on the CPU
  it is read from the source again after the first token rather than copied before it (the copy was
  1% of TTFT at 4K); on a GPU it is a device copy. TTFT is ProphetKV's on the fusion variant, and
  decoding pays the shift (timings.after_first_token).
- shifting before the layer's attention (propagate=before), so the recomputed rows and the question
  see the shifted rows too, halved the first-token KL on dev prompts (results/kvfuse/probe.md) but
  lost answer fidelity on held-out questions (0.55): a closer cache is not a closer answer.

- what the shift should carry (step 5): shrinking the mean by its rows' spread (james-stein) or
  per-row moves by stored-key similarity (kernel) did not help; shifting K only (shift_parts=k) led
  both dev splits (MuSiQue 0.976, RULER 0.675 vs the default's 0.944 / 0.600) but not held out
  (MuSiQue 11-49 0.841 vs 0.855, RULER 2K 0.725 vs 0.670; results/kvfuse.md): not the default.

- per-layer budgets (step 6, budget_slope): the same token-layers spent more early and fewer late, each
  layer's rows the top of one ranking; without the shift level with the flat budget on dev, with it one
  answer ahead on dev (0.974 vs 0.944) and level held out (MuSiQue 11-49 0.844 vs 0.855): not the default.

- whole chunks (step 7, select_unit=chunks): the budget on the chunks the question attends to most, each recomputed
  in full; behind tokens on MuSiQue dev (0.907 vs 0.944) and level with no shift on RULER dev (0.700): not the default.

- every chunk's first tokens (step 9, sink_tokens=8, inside the budget): ahead on both dev splits (MuSiQue 0.982,
  RULER 0.725); held out, RULER 2K 0.770 vs 0.670 (boundary 0.50 -> 0.92) but MuSiQue 11-49 0.816 vs 0.855: not the
  default; the knob is the choice where a chunk boundary splits the facts asked for (MuSiQue's passages begin
  mid-sentence too, and there it lost). Sinks only after the one or two most attended chunks (sinks_after_top) scored
  0.600 / 0.625 on RULER dev against 0.725 (boundary 0.4 / 0.5 against 0.7): the cut needle's chunk is not found so.

- where the question reads (step 10): averaged over the layers, the question's attention points at the chunk next to
  it in every RULER sample; layers 18-24 of 30 point at the fact's chunk in most (scripts/locate_probe.py). With
  locate_from=0.6:locate_to=0.85 those layers pick the chunks sinks_after_top puts sinks after: sink_tokens=8 with
  sinks_after_top=2 held out at RULER 2K 0.775 vs the default's 0.670 (boundary 0.50 -> 0.94) and MuSiQue 11-49
  unchanged (0.855, no answer changed). The configuration to use; not yet the default, which would change every
  committed kvfuse row. score_layers=band (every row ranked by those layers) held out at RULER 2K 0.780 but MuSiQue
  0.822: not kept. band_weight=0.5 (half of it in the ranking) with the located sinks led both dev splits and held
  out level with the located sinks alone (2K 0.780, MuSiQue 0.851): not kept.

- APE's calibration (step 11, ape_temperature / ape_scale: the question's attention over the chunks at APE's T and S,
  in pass 2 and decoding): lost on both dev splits (RULER 0.700 -> 0.575 with the located sinks, alias included;
  MuSiQue 0.944 -> 0.845). APE's alias score came with its own shared positions, which recomputed rows cannot take.
- the rows after each read row (step 12, span_after): alias's value sits in the words after the key the question
  finds; with 4 or 16 of them per read row RULER dev gains (0.750 vs 0.700 with the located sinks) but MuSiQue dev
  loses (0.872 / 0.747): not held out.
- the shift's guard (step 13, shift_guard): at 4K the shift cut a needle's number short in 8 of 200 samples (its
  kept digits moved with the chunk); leaving the 8 rows after each recomputed row as stored mends 7 of them and
  gains on RULER dev (0.650 vs 0.600) but loses MuSiQue dev (0.897 vs 0.944); only the rows closed in by recomputed
  rows on both sides (shift_guard_closed) mends 7 too, MuSiQue dev 0.924, RULER dev 0.600: neither held out.
- telling a copied number from a read sentence (step 14): the kept rows ranked next after the budget left as stored
  (shift_guard_ranked) mend 4-5 of the 8 and lose both dev splits; the shift only for a question whose attention reads
  few of its chunks (shift_max_spread=0.5: every MuSiQue dev question, no RULER dev sample) mends 7, ties MuSiQue and
  leads RULER dev (0.700), but held out loses RULER 2K (0.675 vs 0.750, alias 0.60 -> 0.20): the shift carries alias.
- the key move's size (step 16, key_shift_scale): half of it keeps MuSiQue 0-49's answers with full's answer KL 0.037
  against 0.053 (0.034 without the shift), ties RULER dev (0.600), and held out loses alias at RULER 2K (0.60 -> 0.35,
  all tasks 0.700 vs 0.750); 1.5 and 2 buy alias with boundary on RULER dev: a dial, not a gain. Not the default.
  Scaling each kept row's key move by its attention over the budget's cut (key_shift_by_attention) is no shift on
  both (RULER dev alias 0.4, MuSiQue KL 0.035): alias needs the keys of rows the question does not read. Not kept.
- a second hop (step 17, hop_rows): the question's top 16 rows computed alone over the stored cache, their attention
  ranking the budget. Seeded by the layer average it changed nothing on RULER dev; seeded by the locate band
  (hop_seeds=band) and ranking alone (hop_weight=1) with the located sinks it held out at RULER 2K 0.825 vs full's
  0.915 (the located sinks 0.775; boundary, niah_single and niah_multikey within 0.05 of full, alias not) and kept
  MuSiQue 11-49 (0.852 vs 0.855), but lost at 4K (0.500 vs 0.588) and its pass costs TTFT (1.28x ProphetKV's at 2K,
  1.11x at 4K). Not kept.
- the rows after the hop's rows (step 18, hop_after): at 4K the hop bought a needle's words and left its digits to the
  shift, which cut their copy short (9 cut copies of 80 against the located sinks' 2). Buying each hop row and the 12
  rows after it first, with the located sinks and the hop, held out at RULER 2K 0.855 vs full's 0.915 (boundary,
  niah_single and niah_multikey at full's numbers; alias 0.56 vs 0.80), at 4K 0.688 vs the located sinks' 0.588 and
  full's 0.825, and kept MuSiQue 11-49 (0.852). Its hop pass (its rows only since step 18) costs 1.16x ProphetKV's
  TTFT at 2K and 1.07x at 4K: the configuration for quality, not the default.
- the same with no hop pass (step 19, hop_weight=0 with hop_after): the band's top 16 rows and the 12 after each
  bought first, the rest ranked by the question. Held out RULER 2K 0.850 (alias 0.60), 4K 0.662, MuSiQue 11-49 0.851,
  at ProphetKV's TTFT (1.01x at 2K and 4K): the configuration to use on long prompts; not the default, since on
  NQ-open's short prompts its windows take the whole budget (0.560 vs the located sinks' 0.658 on 0-49, 0.538 vs
  0.572 on 50-99; 2WikiMQA 0.878 vs 0.886).
- step 19's windows run on into the next chunk (step 20a, hop_after_crosses): RULER dev 4K unchanged (0.800); the
  dev `boundary` misses get their number recomputed and stay wrong. Held to half the budget (step 20b, hop_share=0.5):
  every RULER and MuSiQue dev answer kept, NQ 0-49 0.648, but held out on NQ 50-99 0.525. Neither kept.
- step 19 located by layer 18 alone (step 21, locate_to=0.62; at 4K it finds the fact's chunk in 39 of 40 dev samples,
  the band in 19): RULER dev 2K 0.875, 4K 0.825 (one sample each over step 19), MuSiQue dev 0.953 (0.974). Not held out.
- where the question reads in the pass that makes the first token (step 22, scripts/read_probe.py): at 4K step 19's
  read of the fact chunks is full prefill's (0.54 vs 0.51 at layer 18); the answers part later, in decoding.
- every chunk's first tokens recomputed first (step 23, seam_tokens): at 4K the value probe (scripts/value_probe.py)
  found decoding not reading a number that opens its chunk (layer 20: 0.00 vs full's 0.73). seam_tokens=2 on step 19
  led or tied on the dev splits and held out level with it (RULER 2K 0.855 vs 0.850, 4K 0.662 with no answer changed,
  MuSiQue 11-49 0.852, NQ 0-49 0.568). Not kept.
- step 19's windows only where the budget holds them all (step 24, hop_if_fits): a rule fixed from the windows' size
  before any run. On RULER and MuSiQue, whose budgets hold the 208 rows, it is step 19; on NQ-open's short prompts,
  the located sinks (results/kvfuse.md, step 24).

Two passes, as ProphetKV: (1) the question's rows over the stored cache, recording their attention
at every layer; (2) recompute the top-budget chunk rows by the layer-averaged attention, shifting
each chunk's kept rows after every layer from propagate_from on. Knobs for the ablation:
score_layers, sink_tokens (and sinks_after_top, located by locate_from / locate_to), seam_tokens, band_weight, span_after,
ape_temperature / ape_scale, propagate (off / after / before), propagate_from and deviation_share (part of the
budget by CacheBlend's layer-1 deviation, measured between the passes; not kept: no gain on either dev split),
shift_estimate, shift_parts, key_shift_scale, key_shift_by_attention, shift_guard (shift_guard_closed),
shift_guard_ranked, shift_max_spread, budget_slope, select_unit and hop_rows (hop_seeds, hop_weight, hop_after,
hop_after_crosses, hop_share, hop_if_fits). Budget:
exactly round(ratio x chunk tokens), sinks included; the hop's rows are a pass of their own, outside it (they count
in recomputed_token_layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionResult, FusionState, StoredRows, recompute_budget
from kvf.pipeline.fusion.methods.base import (FusionMethod, KnobError, all_chunk_rows, chunk_attention, knob, register,
                                               top_rows)
from kvf.pipeline.fusion.methods.epic import chunk_initial_rows
from kvf.pipeline.model.forward import SpanCalibration
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.model.rope import apply_rope, unapply_rope


@dataclass
class KvFuseKnobs:
    score_layers: str = knob("all", "layers whose question attention ranks tokens: all (averaged), last, early "
                                    "(the first half), late (the second) or band (locate_from to locate_to)",
                             choices=("all", "last", "early", "late", "band"))
    sink_tokens: int = knob(0, "first tokens of every chunk always recomputed, inside the budget (8 mends a fact "
                               "cut by a chunk boundary: results/kvfuse.md, step 9)", min=0)
    sinks_after_top: int = knob(0, "with sink_tokens: only the chunks right after the N chunks the question attends to "
                                   "most get sinks (a fact the question reads may run on past that boundary); 0: every "
                                   "chunk. Found by every layer's attention, 1 and 2 did not mend a cut needle on RULER "
                                   "dev (step 9); found by layers 18-24 (locate_from=0.6, locate_to=0.85), 2 did, held "
                                   "out (results/kvfuse.md, step 10)", min=0)
    seam_tokens: int = knob(0, "the first N tokens of every chunk, recomputed first beside the sinks: stored alone, a "
                               "chunk's first token never saw the token before it, and decoding's copy finds a value "
                               "by what precedes it (at 4K a number opening its chunk got 0.00 of layer 20's read "
                               "against full prefill's 0.73). 2 on step 19 brought that read back and held out level "
                               "with step 19 (results/kvfuse.md, step 23); 0: none", min=0)
    locate_from: float = knob(0.0, "with sinks_after_top: the first layer, as a fraction of the depth, whose question "
                                   "attention finds the chunks the sinks go after (the layers that find a needle sit "
                                   "deep: 0.6 to 0.85 on SmolLM2-135M, results/kvfuse.md, step 10; another model: "
                                   "scripts/locate_probe.py); with score_layers=band, the rows too", min=0.0, max=1.0)
    locate_to: float = knob(1.0, "the end of that band of layers (layer l is in it when locate_from <= (l + 0.5) / "
                                 "layers < locate_to)", min=0.0, max=1.0)
    band_weight: float = knob(0.0, "the band's share of the row ranking: rows ranked by (1 - w) x the mean attention "
                                   "of score_layers' layers + w x the band's (with score_layers=all, 1 ranks as "
                                   "score_layers=band)", min=0.0, max=1.0)
    span_after: int = knob(0, "each chunk row also ranks as high as the best of the N rows before it in its chunk, so "
                              "a row the question attends to brings the N that follow it (the rest of its sentence: a "
                              "fact the question finds by one word may be carried by the words after it; 4 and 16 "
                              "lost MuSiQue dev answers: results/kvfuse.md, step 12)", min=0)
    propagate: str = knob("after", "shift each chunk's kept rows by the mean K/V change of its recomputed rows: "
                               "off, after (seen by decoding) or before (seen by this layer too)",
                          choices=("off", "after", "before"))
    propagate_from: float = knob(0.0, "first layer shifted, as a fraction of the layers (early layers barely move)",
                                 min=0.0, max=1.0)
    deviation_share: float = knob(0.0, "fraction of the budget given first to the rows whose layer-1 K moves most "
                                       "when layer 0 sees the other chunks (CacheBlend's deviation); the rest by attention",
                                  min=0.0, max=1.0)
    shift_estimate: str = knob("mean", "the move a kept row gets from its chunk's recomputed rows: their mean, "
                                       "james-stein (the mean shrunk by their spread; one row: none) or kernel "
                                       "(weighted by stored-key similarity)", choices=("mean", "james-stein", "kernel"))
    shift_parts: str = knob("kv", "what the shift moves: kv (both), k only (where rows are attended) or v only "
                                  "(what they carry)", choices=("kv", "k", "v"))
    key_shift_scale: float = knob(1.0, "the keys' share of the move: kept rows' keys move by c x their chunk's key "
                                       "move (values by the whole of theirs); 1: the whole move. 0.5 kept MuSiQue's "
                                       "answers at a lower answer KL and lost alias held out; above 1 buys alias "
                                       "with boundary (results/kvfuse.md, step 16)", min=0.0, max=2.0)
    key_shift_by_attention: bool = knob(False, "each kept row's key move is also scaled by its attention over the "
                                               "budget's cut (the scored layers' mean; at most 1): rows the question "
                                               "nearly reads move whole, rows it ignores barely (no shift's alias and KL "
                                               "on both dev splits: results/kvfuse.md, step 16)")
    shift_guard: int = knob(0, "kept rows within N rows after a recomputed row of their chunk stay as stored (the "
                               "shift moved a needle's kept digits and cut its copy short at 4K; 8 mended that and "
                               "lost MuSiQue dev answers: results/kvfuse.md, step 13)", min=0)
    shift_guard_closed: bool = knob(False, "with shift_guard: only the kept rows that recomputed rows of their chunk close "
                                           "in on both sides within N (a needle's digits between its read words and its "
                                           "full stop), not every row after a read one")
    shift_guard_ranked: float = knob(0.0, "kept rows the question's attention ranks next after the budget (the top "
                                          "(1 + N) x budget rows less the recomputed ones) stay as stored: what the "
                                          "question reads but the budget missed, e.g. a needle's last digits, keeps "
                                          "its stored K/V to be copied from (0.5 and 1 lost both dev splits: "
                                          "results/kvfuse.md, step 14)", min=0.0, max=4.0)
    shift_max_spread: float = knob(1.0, "the shift runs only for a question whose attention over the chunks (the "
                                        "scored layers' average) is at most this spread: the effective number of "
                                        "chunks it reads (1 / sum of squared chunk shares) over the number of chunks, "
                                        "1/C when it reads one chunk, 1 when it reads all evenly; 1: always (0.5 "
                                        "led RULER dev and lost held out, alias without the shift: results/kvfuse.md, "
                                        "step 14)", min=0.0, max=1.0)
    budget_slope: float = knob(0.0, "per-layer budget: layer l recomputes the top (1 + s (1 - 2l/(L-1))) x budget rows "
                                    "(more early, fewer late, each layer's rows among the layer before's; the same "
                                    "token-layers in all); 0: the same rows at every layer", min=0.0, max=1.0)
    select_unit: str = knob("tokens", "what the budget buys: tokens (the top rows by attention, wherever they are) or "
                                      "chunks (whole chunks, the most attended first; the last one by its top rows)",
                            choices=("tokens", "chunks"))
    ape_temperature: float = knob(1.0, "APE's attention temperature on the chunks' scores, for the question and "
                                       "decoding only (the chunk rows recomputed beside them attend plainly; 0.9 lost "
                                       "on both dev splits: results/kvfuse.md, step 11); 1: none", min=0.05, max=10.0)
    ape_scale: float = knob(1.0, "APE's scaling factor of the chunks' total attention weight, for the question and "
                                 "decoding only; 1: none", min=0.0, max=10.0)
    hop_rows: int = knob(0, "a second hop: the question's top N chunk rows are first computed alone over the stored "
                            "cache (a pass of their own, which leaves the cache as it found it), and the rows they "
                            "attend to join the ranking (a chain the question reads one link of: the link names the "
                            "next); 0: none. 16 seeded by the band gained at RULER 2K and lost at 4K, and its pass "
                            "costs TTFT (results/kvfuse.md, step 17)", min=0)
    hop_seeds: str = knob("scores", "with hop_rows: what ranks the hop's rows, the question's attention that ranks the "
                                    "budget (scores) or the locate band's (band: locate_from to locate_to, the layers that "
                                    "find a fact's chunk: results/kvfuse.md, step 10)", choices=("scores", "band"))
    hop_weight: float = knob(0.5, "with hop_rows: the hop's share of the row ranking, rows ranked by (1 - w) x the "
                                  "question's attention + w x the top rows' (the scored layers' mean of each); 0: the "
                                  "rows get no pass, and only hop_after uses them",
                             min=0.0, max=1.0)
    hop_after: int = knob(0, "with hop_rows: each of the hop's rows and the N rows after it in its chunk are bought "
                             "first, after the sinks (a fact's value follows the words that find it; at 4K the hop "
                             "bought a needle's words and left its digits stored, to be copied short once the shift "
                             "moved them: results/kvfuse.md, step 18); 0: none", min=0)
    hop_after_crosses: bool = knob(False, "with hop_after: the window runs on past its chunk's end into the next "
                                          "chunk's first rows, as the prompt reads (a fact cut by a chunk boundary "
                                          "opens the next chunk with its value: RULER's boundary task)")
    hop_share: float = knob(1.0, "with hop_after: the most of the budget that the hop's rows and the rows after them "
                                 "take, the best-ranked rows' windows first; 1: all of them (at NQ's 90-row budget "
                                 "step 19's 16 windows of 13 rows took the whole budget: results/kvfuse.md, step 20)",
                            min=0.0, max=1.0)
    hop_if_fits: bool = knob(False, "with hop_after: the windows are bought only where the budget left after the "
                                    "sinks holds all of them at their longest (hop_rows x (1 + hop_after) rows); "
                                    "elsewhere none is, and the budget is ranked as without them (on NQ-open's short "
                                    "prompts step 19's windows took the whole budget: results/kvfuse.md, step 24)")
    requery: bool = knob(False, "compute the question's tokens again, alone, over the fused rows before the first token "
                                "(a third pass); with propagate=after the shift moves before it and counts in TTFT")


@register
class KvFuse(FusionMethod):
    name = "kvfuse"
    summary = ("kvf's own: `fusion` variant, top-r tokens by layer-averaged Q attention, and each chunk's kept rows "
               "shifted by the mean K/V move of its recomputed rows, after the first token since only decoding reads "
               "them (results/kvfuse.md)")
    Knobs = KvFuseKnobs
    offline_variant = "fusion"
    query_pass = True
    reuse_at_ratio_zero = True  # no recomputed row: nothing to propagate
    # the configuration results/kvfuse.md's ablation chose (step 24: step 10's located sinks, step 19's windows where
    # the budget holds them). Not the default: every committed kvfuse record was made with step 3's, and a record
    # without a label reads as the default
    configurations = {"tuned": "sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:hop_rows=16:"
                               "hop_seeds=band:hop_weight=0:hop_after=12:hop_if_fits=true"}

    def __init__(self, recompute_ratio: float | None = None, knobs=None, **knob_values):
        super().__init__(recompute_ratio, knobs, **knob_values)
        if self.knobs.sinks_after_top and not self.knobs.sink_tokens:   # it places sinks; with none it would do nothing
            raise KnobError("sinks_after_top", str(self.knobs.sinks_after_top),
                            "places the sinks that sink_tokens asks for; give sink_tokens (--sink-tokens) a count above 0 too")
        if self.knobs.shift_guard_closed and not self.knobs.shift_guard:   # no distance to close in within
            raise KnobError("shift_guard_closed", "true", "narrows shift_guard's rows; give shift_guard "
                            "(--shift-guard) a number of rows above 0 too")
        if self.knobs.shift_max_spread < 1.0 and self.knobs.propagate == "off":   # no shift to hold back
            raise KnobError("shift_max_spread", str(self.knobs.shift_max_spread), "decides when the shift runs, and "
                            "propagate=off runs none; drop one of them")
        for name in changed_knobs(self.knobs, ("key_shift_scale", "key_shift_by_attention")):   # no key moves:
            if self.knobs.propagate == "off" or self.knobs.shift_parts == "v":                  # nothing to scale
                raise KnobError(name, str(getattr(self.knobs, name)).lower(), "scales the keys' shift, and "
                                "propagate=off or shift_parts=v moves no key; drop one of them")
        for name in changed_knobs(self.knobs, ("hop_after_crosses", "hop_share", "hop_if_fits")):   # no window
            if not self.knobs.hop_after:
                raise KnobError(name, str(getattr(self.knobs, name)).lower(), "shapes hop_after's windows, and "
                                "hop_after is 0; give hop_after (--hop-after) a count above 0 too")
        for name in changed_knobs(self.knobs, ("hop_weight", "hop_seeds", "hop_after")):   # a part of a hop that never runs
            if not self.knobs.hop_rows:
                raise KnobError(name, str(getattr(self.knobs, name)), "shapes the second hop, and hop_rows is 0; "
                                "give hop_rows (--hop-rows) a count above 0 too")
        if self.knobs.hop_rows and not self.runs_hop and not self.knobs.hop_after:   # rows chosen for nothing
            raise KnobError("hop_weight", "0", "leaves the hop's rows without a pass, and only hop_after buys them "
                            "then; give hop_after (--hop-after) a count above 0, or hop_weight above 0")
        band = (self.knobs.locate_from, self.knobs.locate_to)
        if band != (0.0, 1.0) and not (self.reads_band or self.knobs.score_layers == "band"):
            name = "locate_from" if band[0] != 0.0 else "locate_to"      # the band has nothing to find
            raise KnobError(name, str(getattr(self.knobs, name)),
                            "a band of layers for sinks_after_top, score_layers=band, band_weight or hop_seeds=band, "
                            "and none is given; add sinks_after_top (--sinks-after-top) with sink_tokens "
                            "(--sink-tokens), score_layers=band, band_weight or hop_seeds=band with hop_rows")
        if band[0] >= band[1]:
            raise KnobError("locate_to", str(band[1]), f"must be above locate_from ({band[0]})")

    def calibration(self, prompt: FusedPrompt) -> SpanCalibration | None:
        """APE's calibration of the chunks' span for Q's rows (from pass 2 on) and decoding; None at 1, 1. Pass 1
        stays the plain query pass: it is what ranks the rows, and a sweep's methods share it."""
        if (self.knobs.ape_temperature, self.knobs.ape_scale) == (1.0, 1.0):
            return None
        return SpanCalibration(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens, self.knobs.ape_temperature,
                               self.knobs.ape_scale, queries_from=prompt.n_tokens - len(prompt.question_ids))

    @property
    def passes(self) -> int:     # Q attention, (the hop,) recompute, and with requery Q alone over the shifted rows
        return 2 + int(self.runs_hop) + int(self.knobs.requery)

    @property
    def runs_hop(self) -> bool:
        """Whether the hop's rows get a pass of their own: only when their attention ranks the budget (hop_weight >
        0); at 0 they are chosen and bought with the rows after them (hop_after), with no pass."""
        return bool(self.knobs.hop_rows) and self.knobs.hop_weight > 0

    @property
    def recompute_pass(self) -> int:
        """The pass that recomputes the budget's rows: after the question's pass, and after the hop's if any."""
        return 2 if self.runs_hop else 1

    def pass_computes_question(self, pass_index: int) -> bool:
        """The hop's pass records what its rows attend to, which Q's rows never change (a chunk row does not attend
        to Q), and pass 2 computes Q afresh: it runs the hop's rows alone."""
        return not (self.runs_hop and pass_index == 1)

    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        return state.pass_index < self.recompute_pass and layer in self.recorded_layers(state.cache.kv.shape[0])

    @property
    def reads_band(self) -> bool:
        """Whether pass 2 reads the band's mean attention beside the scored layers' (to place sinks or to mix in)."""
        return bool(self.knobs.sinks_after_top or self.knobs.band_weight
                    or (self.knobs.hop_rows and self.knobs.hop_seeds == "band"))

    def recorded_mean(self, state: FusionState, layers: list[int]) -> torch.Tensor:
        """[n] the mean over `layers` of the attention this pass recorded (at recorded_layers, in order)."""
        recorded = dict(zip(self.recorded_layers(state.cache.kv.shape[0]), state.query_attention))   # layer -> [n]
        return torch.stack([recorded[layer] for layer in layers]).mean(dim=0)

    def recorded_layers(self, n_layers: int) -> list[int]:
        """The layers pass 1 records Q's attention at: those that rank rows, and those that locate sinks."""
        locating = self.locate_layers(n_layers) if self.reads_band else []
        return sorted(set(self.scored_layers(n_layers)) | set(locating))

    def locate_layers(self, n_layers: int) -> list[int]:
        return band_layers(self.knobs.locate_from, self.knobs.locate_to, n_layers)

    def scored_layers(self, n_layers: int) -> list[int]:
        if self.knobs.score_layers == "band":
            return self.locate_layers(n_layers)
        return {"all": list(range(n_layers)), "last": [n_layers - 1], "early": list(range(n_layers // 2)),
                "late": list(range(n_layers // 2, n_layers))}[self.knobs.score_layers]

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        if state.pass_index == self.recompute_pass:   # requery: the shift now (if `after`), then Q's rows alone again
            stored = state.scratch.pop("stored", None)
            if stored:
                self.shift_after_layers(engine, state, stored)
            return torch.empty(0, dtype=torch.long)
        if self.runs_hop and state.pass_index == 0:                         # the hop's pass first
            return self.start_hop(state)
        hop = self.end_hop(state) if self.runs_hop else None                # [n] the top rows' attention
        if self.knobs.hop_rows and not self.runs_hop:                       # the hop's rows, with no pass
            state.scratch["hop_seeds"] = self.hop_seeds(state)
        prompt = state.prompt
        state.calibration = self.calibration(prompt)                      # pass 2 and decoding (None: plain)
        budget = recompute_budget(self.recompute_ratio, prompt.n_chunk_tokens)
        n_layers = state.cache.kv.shape[0]
        scores = self.recorded_mean(state, self.scored_layers(n_layers))     # [n]
        if self.knobs.shift_max_spread < 1.0:                               # how evenly Q reads the chunks
            state.scratch["spread"] = chunk_spread(chunk_attention(scores, prompt))   # (a device sync: only if asked)
        located = (self.recorded_mean(state, self.locate_layers(n_layers))
                   if self.reads_band else None)                            # [n] the band's attention
        if self.knobs.band_weight:                                          # the band's pull mixed into the ranking
            scores = (1 - self.knobs.band_weight) * scores + self.knobs.band_weight * located
        if hop is not None:                                                 # what the question's top rows read
            scores = (1 - self.knobs.hop_weight) * scores + self.knobs.hop_weight * hop
        sinks = sink_rows(prompt, self.knobs.sink_tokens, budget,          # [s] first tokens of every chunk,
                          after_top=self.knobs.sinks_after_top, scores=located)   # or of those after the most read
        chunk_rows = all_chunk_rows(prompt)
        if self.knobs.key_shift_by_attention:                               # [n] attention over the budget's cut
            state.scratch["key_weight"] = attention_over_cut(scores, chunk_rows, budget)
        scores = scores[chunk_rows].clone()
        if self.knobs.span_after:                                           # a read row brings the rows after it
            scores = spread_after(scores, chunk_of(prompt, chunk_rows), self.knobs.span_after)
        if self.knobs.hop_after and self.windows_fit(budget - len(sinks)):  # the hop's rows and what follows them
            after = self.hop_windows(state, budget) - prompt.n_prefix
            scores[after] = torch.finfo(scores.dtype).max                   # next after the sinks
        scores[sinks - prompt.n_prefix] = float("inf")                     # sinks first, then by attention
        if self.knobs.seam_tokens:                                          # every chunk's first tokens, beside them
            scores[sink_rows(prompt, self.knobs.seam_tokens, budget) - prompt.n_prefix] = float("inf")
        if self.knobs.deviation_share > 0:                                  # then the most moved rows
            share = recompute_budget(self.knobs.deviation_share, budget)
            moved = top_rows(cross_chunk_deviation(engine, state), chunk_rows, share)
            scores[moved - prompt.n_prefix] = float("inf")
        if self.knobs.select_unit == "chunks":                              # whole chunks, most attended first
            scores = chunks_first(scores, chunk_of(prompt, chunk_rows), len(prompt.chunk_segments))
        if self.knobs.budget_slope > 0:                                    # nested rows, fewer at every layer
            ranked = chunk_rows[torch.argsort(scores, descending=True, stable=True)]   # [c] best first
            counts = layer_counts(budget, len(chunk_rows), state.cache.kv.shape[0], self.knobs.budget_slope)
            state.scratch["ranked"], state.scratch["layer_counts"] = ranked, counts
            selected = torch.sort(ranked[:counts[0]]).values
        else:
            selected = top_rows(scores, chunk_rows, budget)
        if self.knobs.shift_guard_ranked:                                  # ranked next: left as stored
            next_rows = int(self.knobs.shift_guard_ranked * budget + 0.5)                 # N x budget, halves up
            nearly = top_rows(scores, chunk_rows, budget + next_rows)
            state.scratch["guarded"] = nearly[~torch.isin(nearly, selected)]   # [g] sorted
        state.scratch["selected"] = selected
        return selected

    # ---- the second hop: the rows the question's top rows attend to ----
    def start_hop(self, state: FusionState) -> torch.Tensor:
        """The question's top hop_rows chunk rows, to compute alone over the stored cache, their attention recorded.
        Their stored K/V is kept and put back after (end_hop), so the pass leaves no trace in the cache: pass 2 and
        the shift see the stored rows, as without the hop."""
        hop = self.hop_seeds(state)                                                  # [h]
        state.scratch["question_attention"] = state.query_attention
        state.scratch["hop_seeds"] = hop                                   # pass 2 reads them too (hop_after)
        state.scratch["hop_stored"] = state.cache.kv[:, :, :, hop.to(state.cache.kv.device)].clone()
        state.recorded_rows = slice(0, len(hop))       # the hop's pass runs its rows alone (pass_computes_question)
        return hop

    def hop_seeds(self, state: FusionState) -> torch.Tensor:
        """[h] sorted: the question's top hop_rows chunk rows, by the attention hop_seeds names (pass 1's)."""
        chunk_rows = all_chunk_rows(state.prompt)
        return top_rows(self.seed_scores(state)[chunk_rows], chunk_rows, self.knobs.hop_rows)   # h <= chunk rows

    def seed_scores(self, state: FusionState) -> torch.Tensor:
        """[n] the question's attention that ranks the hop's rows: the locate band's or the scored layers' mean."""
        n_layers = state.cache.kv.shape[0]
        seeding = self.locate_layers(n_layers) if self.knobs.hop_seeds == "band" else self.scored_layers(n_layers)
        return self.recorded_mean(state, seeding)

    def hop_windows(self, state: FusionState, budget: int) -> torch.Tensor:
        """[m] sorted: the hop's rows and the hop_after rows after each; with hop_share below 1 at most that share
        of the budget, a row ranked by the best seed whose window holds it, and within a window the earliest
        first (the seed's words, then what follows them)."""
        seeds, prompt, n_after = state.scratch["hop_seeds"], state.prompt, self.knobs.hop_after
        if self.knobs.hop_share == 1.0:   # every window row: no ranking among them (steps 18-19's rows as recorded)
            return rows_after(seeds, prompt, n_after, self.knobs.hop_after_crosses)
        weights = self.seed_scores(state)[seeds].float().cpu().clamp_min(torch.finfo(torch.float32).tiny)  # [h] > 0
        window = window_scores(seeds, weights, prompt, n_after, self.knobs.hop_after_crosses)     # [c]
        most = min(recompute_budget(self.knobs.hop_share, budget), int((window > 0).sum()))
        ranked = torch.argsort(window, descending=True, stable=True)[:most]   # a window's rows: its earliest first
        return torch.sort(all_chunk_rows(prompt)[ranked]).values

    def windows_fit(self, room: int) -> bool:
        """Whether hop_after's windows are bought: always, or with hop_if_fits only where `room` rows hold every
        window at its longest, so that on a short prompt the question still ranks the budget."""
        return not self.knobs.hop_if_fits or self.knobs.hop_rows * (1 + self.knobs.hop_after) <= room

    def end_hop(self, state: FusionState) -> torch.Tensor:
        """After the hop's pass: [n] its rows' attention (the scored layers' mean), the stored K/V back in place,
        and the question's attention where the ranking reads it."""
        hop_attention = self.recorded_mean(state, self.scored_layers(state.cache.kv.shape[0]))   # [n]
        hop, stored = state.scratch["hop_seeds"], state.scratch.pop("hop_stored")    # [h], [L, 2, KV, h, d]
        state.cache.kv[:, :, :, hop.to(state.cache.kv.device)] = stored
        state.query_attention = state.scratch.pop("question_attention")
        state.recorded_rows = None
        return hop_attention

    def rows_at(self, state: FusionState, layer: int) -> torch.Tensor:
        """budget_slope > 0: the chunk rows recomputed at this layer, sorted (the top of the ranking)."""
        return torch.sort(state.scratch["ranked"][:state.scratch["layer_counts"][layer]]).values

    # ---- propagation: the rows kept from the store move with their chunk's recomputed rows ----
    def propagates(self, state: FusionState, layer: int) -> bool:
        n_layers = state.cache.kv.shape[0]
        return (state.pass_index == self.recompute_pass and self.knobs.propagate != "off"
                and layer >= round(self.knobs.propagate_from * n_layers)
                and (self.knobs.shift_max_spread == 1.0 or state.scratch["spread"] <= self.knobs.shift_max_spread))

    def keep_layer_rows(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        """budget_slope > 0: this layer recomputes fewer rows than the one before; the rows it drops keep their
        stored KV from here on (no later layer could compute them: their hidden state ends here)."""
        counts = state.scratch.get("layer_counts")
        if state.pass_index == self.recompute_pass and counts and layer > 0 and counts[layer] < counts[layer - 1]:
            engine.keep_rows(state, self.rows_at(state, layer))

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        self.keep_layer_rows(engine, state, layer)
        if not self.propagates(state, layer):
            return
        rows = state.active_chunk_rows()
        if self.knobs.propagate == "after":
            if "stored" not in state.scratch:  # what this and every later layer will overwrite (engine keeps it):
                # pass 1 loaded every layer, and pass 2 writes a layer's rows only when it runs that layer
                state.scratch["stored"] = engine.keep_stored_rows(state, layer, rows)
            return
        is_chunk = state.chunk_row_mask()[state.rows]
        fresh_k, fresh_v = engine.project_kv(state, layer)                      # [KV, a', d] all active rows
        fresh = torch.stack([fresh_k[:, is_chunk], fresh_v[:, is_chunk]])       # [2, KV, a, d]
        shift_kept_rows(engine, state, layer, rows, state.cache.kv[layer][:, :, rows], fresh, self.knobs)

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        """propagate=after: the shift of a layer's kept rows comes after that layer's attention, and no later
        layer reads them, so the first token does not depend on it. It runs after the first token, when
        decoding first reads the cache (FusionResult.cache): the same cache bit for bit, TTFT without it."""
        stored = state.scratch.pop("stored", None)
        if stored:
            result.after_first_token = lambda: self.shift_after_layers(engine, state, stored)
        if "layer_counts" in state.scratch:   # rows per layer on average (the last layer alone may have none)
            result.recomputed_tokens = sum(state.scratch["layer_counts"]) // len(state.scratch["layer_counts"])

    def shift_after_layers(self, engine: FusionEngine, state: FusionState, stored: StoredRows) -> None:
        """Every shifted layer's move, from its recomputed rows' stored (kept) and fresh (in the cache) K/V."""
        rows = stored.rows
        for layer in range(stored.first, state.cache.kv.shape[0]):
            before = engine.stored_rows(state, stored, layer)              # [2, KV, a, d]
            mine = rows
            if "layer_counts" in state.scratch:                            # only this layer's recomputed rows moved
                here = torch.isin(rows, self.rows_at(state, layer))
                mine, before = rows[here], before[:, :, here.to(before.device)]
            shift_kept_rows(engine, state, layer, mine, before, state.cache.kv[layer][:, :, mine], self.knobs)


def changed_knobs(knobs: KvFuseKnobs, names: tuple[str, ...]) -> list[str]:
    """Those of `names` whose value is not their default (what a user set)."""
    return [name for name in names if getattr(knobs, name) != KvFuseKnobs.__dataclass_fields__[name].default]


def spread_after(scores: torch.Tensor, chunk_of_row: torch.Tensor, n_after: int) -> torch.Tensor:
    """[c] chunk-row scores (rows in order) -> [c]: each row's score raised to the best of the n_after rows before it
    in the same chunk (a max over a window that looks back and stops at the chunk's start)."""
    spread = scores.clone()
    for shift in range(1, min(n_after, len(scores) - 1) + 1):
        same_chunk = chunk_of_row[shift:] == chunk_of_row[:-shift]                    # [c - shift]
        spread[shift:] = torch.where(same_chunk, torch.maximum(spread[shift:], scores[:-shift]), spread[shift:])
    return spread


def rows_after(rows: torch.Tensor, prompt: FusedPrompt, n: int, crosses: bool = False) -> torch.Tensor:
    """[r] chunk rows -> [m] sorted and distinct: each row and the n rows after it, within its chunk, or with
    `crosses` on into the next chunks (never into Q)."""
    return all_chunk_rows(prompt)[window_scores(rows, torch.ones(len(rows)), prompt, n, crosses) > 0]


def window_scores(rows: torch.Tensor, weights: torch.Tensor, prompt: FusedPrompt, n: int,
                  crosses: bool = False) -> torch.Tensor:
    """[r] chunk rows, [r] their weights (> 0) -> [c] per chunk row the best weight of a marked row at most n rows
    before it (span_after's window, spread_after), within its chunk or, with `crosses`, across; 0 outside."""
    chunk_rows = all_chunk_rows(prompt)                                                  # [c] in prompt order
    marked = torch.zeros(len(chunk_rows))
    marked[rows - prompt.n_prefix] = weights
    window = torch.zeros_like(chunk_rows) if crosses else chunk_of(prompt, chunk_rows)   # [c] one chunk, or each
    return spread_after(marked, window, n)


def chunk_spread(mass: torch.Tensor) -> float:
    """[C] attention per chunk -> the effective number of chunks it falls on (1 / sum of squared shares, an inverse
    Simpson index) over C: 1/C when all of it is on one chunk, 1 when it is even."""
    share = mass.double() / mass.double().sum()
    return float(1 / (share ** 2).sum() / len(mass))


def chunks_first(scores: torch.Tensor, chunk_of_row: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """[c] chunk-row scores -> [c] scores that rank the rows chunk by chunk: the chunk whose rows hold the most
    score first, and within a chunk by score (rows scored inf, e.g. sinks, still count as 0 to their chunk's mass)."""
    mass = torch.zeros(n_chunks).index_add_(0, chunk_of_row, scores.float().nan_to_num(posinf=0.0))   # [C]
    chunk_rank = torch.empty(n_chunks, dtype=torch.long)
    chunk_rank[torch.argsort(mass, descending=True, stable=True)] = torch.arange(n_chunks)            # [C] 0 = most
    row_rank = torch.empty(len(scores), dtype=torch.long)
    row_rank[torch.argsort(scores.float(), stable=True)] = torch.arange(len(scores))                  # [c] 0 = least
    order = torch.argsort((n_chunks - chunk_rank[chunk_of_row]) * len(scores) + row_rank)             # [c] worst first
    ranked = torch.empty(len(scores))
    ranked[order] = torch.arange(len(scores), dtype=torch.float32)   # the rank itself: exact in float32, unlike the key
    return ranked


def layer_counts(budget: int, n_rows: int, n_layers: int, slope: float) -> list[int]:
    """Rows recomputed at each layer, non-increasing and adding up to budget x n_layers: layer l's share
    (1 + slope (1 - 2l/(L-1))) x budget, capped at n_rows with what the cap cuts spread evenly over the
    layers below it. At budget = n_rows every layer recomputes every row (ratio 1 stays full prefill)."""
    exact = [budget * (1 + slope * (1 - 2 * layer / max(1, n_layers - 1))) for layer in range(n_layers)]
    for _ in range(n_layers):                              # each round caps at least one more layer, or ends
        cut = sum(max(0.0, x - n_rows) for x in exact)
        exact = [min(float(n_rows), x) for x in exact]
        below = [layer for layer, x in enumerate(exact) if x < n_rows]
        if cut < 1e-9 or not below:
            break
        for layer in below:
            exact[layer] += cut / len(below)
    counts = [int(x + 1e-9) for x in exact]                # floors, non-increasing
    below = [layer for layer, c in enumerate(counts) if c < n_rows]
    for layer in below[:budget * n_layers - sum(counts)]:  # what the floors lost, to the first layers below the cap
        counts[layer] += 1
    return counts


def shift_kept_rows(engine: FusionEngine, state: FusionState, layer: int, rows: torch.Tensor,
                    stored: torch.Tensor, fresh: torch.Tensor, knobs: KvFuseKnobs) -> None:
    """Add to every kept (not recomputed) row of a chunk the change fresh - stored [2, KV, a, d] of that
    chunk's recomputed `rows` at this layer, as knobs.shift_estimate carries it over (keys compared
    before RoPE), to the parts in knobs.shift_parts. All chunks at once: a handful of tensor ops per
    layer however many chunks there are (a GPU pays per op launched, not per row)."""
    if len(rows) == 0:
        return
    chunk_of_row, kept, chunk_of_kept = kept_rows_by_chunk(state, rows)            # [a], [m], [m]
    if knobs.shift_guard:                                                            # next to a read row: as stored
        kept, chunk_of_kept = unguarded(rows, chunk_of_row, kept, chunk_of_kept, knobs.shift_guard,
                                        knobs.shift_guard_closed)
    if "guarded" in state.scratch:                                                   # ranked next: as stored
        unmoved = torch.isin(kept, state.scratch["guarded"])
        kept, chunk_of_kept = kept[~unmoved], chunk_of_kept[~unmoved]
    if len(kept) == 0:
        return
    cos, sin, scaling = state.cos, state.sin, engine.model.rope.scaling              # [n, d] at state.positions
    delta_k = unapply_rope(fresh[0] - stored[0], cos[rows], sin[rows], scaling)     # [KV, a, d] before RoPE
    delta_v = fresh[1] - stored[1]
    if knobs.shift_estimate == "mean":                                               # [KV, m, d] each
        means = chunk_means(torch.cat([delta_k, delta_v]), chunk_of_row, len(state.prompt.chunk_segments))
        move_k, move_v = means[:, chunk_of_kept].split(delta_k.shape[0])
    else:
        move_k, move_v = per_chunk_moves(engine, state, layer, rows, chunk_of_row, kept, chunk_of_kept,
                                         stored, delta_k, delta_v, knobs.shift_estimate)
    if "key_weight" in state.scratch:                                                # [m] attention over the cut
        move_k = move_k * state.scratch["key_weight"][kept].to(move_k.device)[None, :, None]
    if "k" in knobs.shift_parts:
        state.cache.kv[layer, 0][:, kept] += apply_rope(knobs.key_shift_scale * move_k, cos[kept], sin[kept])
    if "v" in knobs.shift_parts:
        state.cache.kv[layer, 1][:, kept] += move_v


def attention_over_cut(scores: torch.Tensor, chunk_rows: torch.Tensor, budget: int) -> torch.Tensor:
    """scores [n] (the question's attention per row) -> [n] each row's score over the budget-th highest chunk row's
    (the attention at which the budget's ranking cuts), at most 1; 1 for every row if the budget takes all. On the CPU."""
    chunk_scores = scores[chunk_rows].float().cpu()                                  # [c]
    if budget == 0 or budget >= len(chunk_rows):
        return torch.ones(len(scores))
    cut = torch.topk(chunk_scores, budget).values[-1].clamp_min(1e-12)
    return (scores.float().cpu() / cut).clamp(max=1.0)


def kept_rows_by_chunk(state: FusionState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [a] (recomputed chunk rows, sorted) -> the chunk of each, and the kept rows [m] that move (the
    chunk rows not recomputed, in chunks that recompute at least one row) with their chunks. On the CPU."""
    chunk_of_row = chunk_of(state.prompt, rows)                                      # [a]
    kept, chunk_of_kept = kept_chunk_rows(state, rows)                               # [m'], [m']
    moves = torch.bincount(chunk_of_row, minlength=len(state.prompt.chunk_segments)) > 0   # [C] chunks with a move
    keep = moves[chunk_of_kept]
    return chunk_of_row, kept[keep], chunk_of_kept[keep]


def unguarded(rows: torch.Tensor, chunk_of_row: torch.Tensor, kept: torch.Tensor, chunk_of_kept: torch.Tensor,
              guard: int, closed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kept rows [m] and their chunks, less those within `guard` rows after a recomputed row (rows [a], sorted) of
    the same chunk: the rows a read row's sentence goes on with (a needle's digits) keep their stored K/V. closed:
    only those with a recomputed row of the chunk within `guard` rows after them too (a run closed on both sides)."""
    at = torch.searchsorted(rows, kept)                                              # [m] the first recomputed row after
    before, after = (at - 1).clamp_min(0), at.clamp_max(len(rows) - 1)
    near = (rows[before] < kept) & (kept - rows[before] <= guard) & (chunk_of_row[before] == chunk_of_kept)
    if closed:
        near &= (rows[after] > kept) & (rows[after] - kept <= guard) & (chunk_of_row[after] == chunk_of_kept)
    return kept[~near], chunk_of_kept[~near]


def kept_chunk_rows(state: FusionState, recomputed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk rows [m] not among `recomputed` (sorted), and the chunk of each [m]. On the CPU."""
    chunk_rows = all_chunk_rows(state.prompt)                                         # [c]
    active = torch.zeros(state.n, dtype=torch.bool)
    active[recomputed] = True
    kept = chunk_rows[~active[chunk_rows]]
    return kept, chunk_of(state.prompt, kept)


def chunk_of(prompt: FusedPrompt, rows: torch.Tensor) -> torch.Tensor:
    """rows [r] of chunk tokens (cache rows) -> the index of the chunk each lies in [r]."""
    starts = torch.tensor([start for start, _ in prompt.chunk_spans()])               # [C]
    return torch.searchsorted(starts, rows, right=True) - 1


def chunk_means(delta: torch.Tensor, chunk_of_row: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """delta [B, a, d] of rows in sorted chunk order -> [B, C, d] each chunk's mean over its rows (0 where
    it has none). Rows go into a zero-padded [B, C, r_max, d] and are summed over r: bit for bit each
    chunk's own delta[:, its rows].mean(dim=1) on the CPU, trailing zeros changing no sum."""
    counts = torch.bincount(chunk_of_row, minlength=n_chunks)                         # [C]
    within = torch.arange(len(chunk_of_row)) - (torch.cumsum(counts, 0) - counts)[chunk_of_row]  # [a] index in chunk
    padded = delta.new_zeros(delta.shape[0], n_chunks, int(counts.max()), delta.shape[2])  # [B, C, r_max, d]
    padded[:, chunk_of_row.to(delta.device), within.to(delta.device)] = delta
    return padded.sum(dim=2) / counts.clamp_min(1).to(delta.device)[None, :, None]


def per_chunk_moves(engine: FusionEngine, state: FusionState, layer: int, rows: torch.Tensor,
                    chunk_of_row: torch.Tensor, kept: torch.Tensor, chunk_of_kept: torch.Tensor,
                    stored: torch.Tensor, delta_k: torch.Tensor, delta_v: torch.Tensor,
                    estimate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ablation's estimates (james-stein, kernel), chunk by chunk -> moves [KV, m, d] of the kept rows."""
    cos, sin, scaling = state.cos, state.sin, engine.model.rope.scaling
    moves_k, moves_v = [], []
    for chunk in torch.unique_consecutive(chunk_of_kept).tolist():
        mine, its_kept = chunk_of_row == chunk, kept[chunk_of_kept == chunk]
        if estimate == "kernel":                                                      # [KV, m_c, r] by stored keys
            weights = key_similarity(unapply_rope(state.cache.kv[layer, 0][:, its_kept], cos[its_kept], sin[its_kept], scaling),
                                     unapply_rope(stored[0][:, mine], cos[rows[mine]], sin[rows[mine]], scaling))
            moves_k.append(weights @ delta_k[:, mine])
            moves_v.append(weights @ delta_v[:, mine])
        else:                                                                         # [KV, 1, d] for all m_c
            moves_k.append(chunk_mean_move(delta_k[:, mine], estimate).expand(-1, len(its_kept), -1))
            moves_v.append(chunk_mean_move(delta_v[:, mine], estimate).expand(-1, len(its_kept), -1))
    return torch.cat(moves_k, dim=1), torch.cat(moves_v, dim=1)


def chunk_mean_move(delta: torch.Tensor, estimate: str) -> torch.Tensor:
    """[KV, r, d] moves of a chunk's r recomputed rows -> [KV, 1, d] the move every kept row gets.
    james-stein: the mean scaled by max(0, 1 - noise / |mean|^2) per head, noise being the trace of the
    mean's covariance (spread / r). Rows that move together give the whole mean; rows that scatter
    (or a single row: no spread to judge by) leave the kept rows where they were."""
    mean = delta.mean(dim=1, keepdim=True)                                           # [KV, 1, d]
    if estimate == "mean":
        return mean
    r = delta.shape[1]
    if r < 2:
        return torch.zeros_like(mean)
    noise = (delta - mean).pow(2).sum(dim=(1, 2)) / ((r - 1) * r)                     # [KV]
    factor = (1 - noise / mean.pow(2).sum(dim=(1, 2)).clamp_min(1e-12)).clamp_min(0)  # [KV]
    return mean * factor[:, None, None]


def key_similarity(kept_keys: torch.Tensor, recomputed_keys: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """[KV, m, d], [KV, r, d] stored keys before RoPE -> [KV, m, r]: each kept row's softmax weights over
    its chunk's recomputed rows by cosine similarity, so a kept row takes the move of the rows whose stored
    keys point its way. Cosine, not q.k: stored keys' norms make the scaled dot product near one-hot (one
    row's move, noisier than the mean); 0.1 was the best of 0.02-0.3 on the chunk-rows error to full
    on the synthetic prompt of tests/test_methods.py's long_case as it was at a85a809 (three ~1,070-token
    chunks; it is shorter now)."""
    kept_keys = torch.nn.functional.normalize(kept_keys, dim=-1)
    recomputed_keys = torch.nn.functional.normalize(recomputed_keys, dim=-1)
    return torch.softmax(kept_keys @ recomputed_keys.transpose(1, 2) / temperature, dim=-1)


def cross_chunk_deviation(engine: FusionEngine, state: FusionState) -> torch.Tensor:
    """[c] per chunk row: how far its layer-1 K moves when layer 0 runs over the whole cache, i.e.
    sees the other chunks (CacheBlend's deviation). One engine step of layer 0 with every chunk row
    active: layer 0's K/V depend on the token and its position only, so the rows it writes equal the
    stored ones. The pass that follows restarts from layer 0 with the rows chosen."""
    engine.restart(state, all_chunk_rows(state.prompt), state.pass_index)
    engine.step(state, 0)
    return engine.kv_deviation(state, 1)[state.chunk_row_mask()[state.rows]]


def band_layers(start: float, end: float, n_layers: int) -> list[int]:
    """The layers in [start, end) of the depth (layer l when start <= (l + 0.5) / n_layers < end), at least one:
    a band between two layers' centres gives the layer nearest its start."""
    band = [layer for layer in range(n_layers) if start <= (layer + 0.5) / n_layers < end]
    return band or [min(int(start * n_layers), n_layers - 1)]


def sink_rows(prompt: FusedPrompt, per_chunk: int, budget: int, after_top: int = 0,
              scores: torch.Tensor | None = None) -> torch.Tensor:
    """The first `per_chunk` rows of every chunk, cut to the budget (earlier chunks first). after_top = N > 0: of
    the chunks right after the N chunks whose rows hold the most of `scores` [n] (the question's attention) only."""
    counts = [min(per_chunk, len(c)) for c in prompt.chunk_segments]
    if after_top > 0:
        mass = chunk_attention(scores, prompt)                                       # [C]
        top = torch.argsort(mass, descending=True, stable=True)[:after_top].tolist()
        counts = [c if i - 1 in top else 0 for i, c in enumerate(counts)]
    rows = chunk_initial_rows(prompt, counts)
    return rows[:budget]
