"""The derived speculation figures, defined once: ``sj.generate``'s stats, ``merge_outputs``,
the benchmarks, the engine's metrics and the server's per-request numbers all mean the same
thing by each name (vLLM's definitions)."""

from __future__ import annotations

import numpy as np


def acceptance_summary(counts: dict, acc_pos, num_rows: int) -> dict:
    """The derived speculation figures, defined once (vLLM's definitions; the engine's
    ``EngineMetrics`` and the server's per-request numbers use the same):

    * ``acceptance_rate`` = accepted / drafted: drafted counts every draft token the target
      verified (a tree: every node), so it means the same for chains, trees, n-gram and block
      drafters;
    * ``mean_accepted_length`` = 1 + accepted / speculative steps (tokens a step that verified
      drafts yields; a step cut by EOS / max_new_tokens counts its emitted drafts only);
    * ``per_position_acceptance`` [K] = steps that accepted draft i / speculative steps;
    * ``plain_steps`` = row-steps that verified no draft (an n-gram row without a match, an
      adaptive k = 0 step), reported apart; ``tokens_per_row_step`` = tokens after each row's
      first (prefill) one / all row-steps (what the wall clock sees).

    Args:
      counts: ``accepted_tokens``, ``drafted_tokens``, ``speculative_steps``, ``row_steps``,
        ``generated_tokens``.
      acc_pos: float [K] (or None when nothing is drafted): speculative steps that accepted
        draft i.
      num_rows: rows (each has one token from its prefill).
    """
    nan = float("nan")
    spec, rows, drafted = counts["speculative_steps"], counts["row_steps"], counts["drafted_tokens"]
    return {
        "acceptance_rate": counts["accepted_tokens"] / drafted if drafted else nan,
        "mean_accepted_length": 1 + counts["accepted_tokens"] / spec if spec else nan,
        "per_position_acceptance": ([] if acc_pos is None else
                                    (np.asarray(acc_pos, np.float64) / max(spec, 1)).tolist()),
        "plain_steps": rows - spec,
        "tokens_per_row_step": (counts["generated_tokens"] - num_rows) / rows if rows else nan,
    }
