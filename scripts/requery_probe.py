"""Is the first token the gap? kvfuse shifts the kept rows after the first token, so the question's rows, and
with them the first token, never see the shift; scripts/correction_probe.py corrected the kept rows at the same
moment. Here the question's rows are computed once more, over the corrected cache, before the first token.

    python -m kvf.scripts.requery_probe --first 50 --last 65 --records DIR/50-64.jsonl   # answer
    python -m kvf.scripts.requery_probe --report DIR/*.jsonl --out results/kvfuse/requery.md   # and .csv

Per question, as scripts/correction_probe.py (the first --passages passages as chunks, prefix variant in
memory, full prefill's greedy answer, ProphetKV's ranking of the rows to recompute):
- `question`, `kvfuse`, `exact K and V`: correction_probe's configurations (its answers again: the check that
  this probe computes what that one did);
- `kvfuse, Q again`: kvfuse:requery=true, its shift at the end of its recompute pass, then a third pass of the
  question's tokens alone over the shifted cache (|Q| more token-layers: kvfuse with the shift inside TTFT);
- `exact K and V, Q again`: every kept row made full prefill's, then the question's tokens alone again (the
  most that correcting the kept rows before the first token can give).
"""
from __future__ import annotations

import sys

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionResult, FusionState
from kvf.pipeline.fusion.methods import get_method
from kvf.scripts.correction_probe import CorrectedWith, answers_with, write_report
from kvf.scripts.selection_probe import ROOT, main as probe_main

CONFIGS = ["question", "kvfuse", "kvfuse, Q again", "exact K and V", "exact K and V, Q again"]
NO_ROWS = torch.empty(0, dtype=torch.long)          # a pass that recomputes no chunk row: Q's rows alone


class CorrectedQAgain(CorrectedWith):
    """The kept rows corrected from full prefill at the end of pass 2, then a third pass of Q alone."""
    passes = 3

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        if state.pass_index == 0:
            return super().next_pass_rows(engine, state)
        self.correct(engine, state)
        return NO_ROWS

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        pass                                                    # corrected already, before the first token


def requeried(ratio: float, full_kv: torch.Tensor) -> dict:
    return {"question": get_method("kvfuse", ratio, propagate="off"), "kvfuse": get_method("kvfuse", ratio),
            "kvfuse, Q again": get_method("kvfuse", ratio, requery=True),
            "exact K and V": CorrectedWith(ratio, full_kv, "exact K and V"),
            "exact K and V, Q again": CorrectedQAgain(ratio, full_kv, "exact K and V")}


def report(args) -> None:
    write_report(args, "Is the first token the gap? The question's rows computed again over the corrected kept rows",
                 CONFIGS, "requery_probe", "| configuration | fidelity [95%] | − `question`, paired [95%] |")


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, doc=__doc__, answers_of=answers_with(requeried), report_of=report, prog="requery_probe",
                      default_out=ROOT / "results" / "kvfuse" / "requery.md")


if __name__ == "__main__":
    sys.exit(main())
