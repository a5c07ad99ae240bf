"""`full`: ordinary prefill of the whole prompt, S included. The quality ceiling and TTFT reference."""
from __future__ import annotations

from kvf.pipeline.fusion.methods.base import FusionMethod, register


@register
class FullPrefill(FusionMethod):
    name = "full"
    summary = "everything (quality ceiling, TTFT reference)"
    uses_store = False    # the engine runs an ordinary prefill (FusionEngine.full_prefill)
    ratio_is_knob = False
    fixed_ratio = 1.0     # full prefill recomputes everything whatever the ratio says
