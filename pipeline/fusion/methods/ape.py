"""`ape`: Adaptive Parallel Encoding (Yang, Chen and Chen, "APE: Faster and Longer Context-Augmented
Generation via Adaptive Parallel Encoding", ICLR 2025, arXiv 2502.05431). Training-free.

What we follow (paper §4, "Adaptive Parallel Encoding", and the authors' reference code,
github.com/Infini-AI-Lab/APE, ape/ape_llama.py):
- Parallel encoding after a shared prefix (§4, "prepending a shared prefix"): every chunk was encoded
  right after S (our `prefix` variant), and every chunk keeps the positions it had there, so all
  chunks share one position range [|S|, |S| + |Ci|); Q comes after the longest chunk. These are
  `pcw`'s positions. No chunk token is recomputed: the ratio is not a knob.
- Attention temperature and scaling factor (§4): Q's attention over the chunks' rows (the
  "context") is computed apart from its attention over S and Q itself: context scores are divided
  by the temperature T, and the context's total weight is rescaled by mixing the two parts with
  softmax([T * S * lse_context, lse_other]), lse = log-sum-exp of each part's scores (the reference
  code's `lse_context * scale * temperature`). Generated tokens attend the same way (the reference
  code uses the query path for decoding too): the calibration is kept for decoding.
- Defaults T = 0.9, S = 0.9: the reference implementation's defaults ("by default, the temperature
  and scaling factor are set to 0.9").
Where we had to choose:
- The paper tunes T and S per task (its appendix lists settings); we keep the published defaults on
  every dataset and expose both as knobs.
- Prompt layout: the paper's template puts the instruction in the shared prefix and the query after
  the contexts, which is kvf's `S | C1..Ck | Q`; S is our system prefix (chat head + instruction).
- Position reuse: the paper reuses positions so that any number of contexts fits the model's
  window; we always reuse them (like `pcw`), and refuse prompts whose longest chunk does not fit.
With T = S = 1 the calibration is plain attention and APE is `pcw`; on one chunk both equal `full`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvf.pipeline.fusion.engine import FusionEngine, FusionPlan, LayerKVSource
from kvf.pipeline.fusion.methods.base import FusionMethod, knob, register
from kvf.pipeline.fusion.methods.pcw import parallel_positions
from kvf.pipeline.model.forward import SpanCalibration
from kvf.pipeline.model.prompt import FusedPrompt


@dataclass
class ApeKnobs:
    temperature: float = knob(0.9, "attention temperature T on the chunks' scores (< 1 sharpens)", min=0.05, max=10.0)
    scale: float = knob(0.9, "scaling factor S of the chunks' total attention weight", min=0.0, max=10.0)


@register
class Ape(FusionMethod):
    name = "ape"
    summary = ("only Q; parallel positions, Q's attention over the chunks calibrated by a temperature and a scaling "
               "factor (APE, ICLR 2025)")
    Knobs = ApeKnobs
    ratio_is_knob = False   # nothing is recomputed: APE calibrates attention instead
    fixed_ratio = 0.0
    oracle_knobs = {"temperature": 1.0, "scale": 1.0}

    def plan(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
             max_new_tokens: int) -> FusionPlan:
        positions = parallel_positions(prompt.n_prefix, [len(c) for c in prompt.chunk_segments], len(prompt.question_ids))
        context = SpanCalibration(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens,
                                  self.knobs.temperature, self.knobs.scale)
        return FusionPlan(self.initial_chunk_rows(prompt), positions, calibration=context)
