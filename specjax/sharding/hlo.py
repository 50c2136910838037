"""Collectives of a compiled (SPMD-partitioned) program, read off its HLO text.

``collectives(compiled.as_text())`` lists every all-gather / all-reduce / reduce-scatter /
collective-permute / all-to-all / collective-broadcast with its result shape and whether it runs
inside a top-level while loop (the decode loop). The tests use it to check that the loop never
moves a weight or a page pool; docs/sharding.md tabulates it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLED = re.compile(r"(?:condition|body|calls|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute|all-to-all|collective-broadcast)(?:-start)?\(")
_ARRAY = re.compile(r"(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    op: str  # "all-gather", "all-reduce", ...
    shape: str  # its result type, e.g. "f32[4,1,64]"
    elements: int  # elements of the largest array in the result
    in_loop: bool  # inside a top-level while loop (the decode loop)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled (SPMD-partitioned) HLO module, marked in-loop or not.

    "In loop" = reachable from the body or condition of a while loop of the entry computation
    (the decode loop; scans nested in it count as in-loop too).
    """
    comps, entry, cur = {}, None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and cur is None:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def reachable(roots):
        seen, stack = set(), list(roots)
        while stack:
            c = stack.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                stack += _CALLED.findall(line)
                for group in _BRANCHES.findall(line):
                    stack += [g.strip().lstrip("%") for g in group.split(",")]
        return seen

    loops = reachable([c for line in comps[entry] for pair in _WHILE.findall(line) for c in pair])
    found = []
    for c in sorted(reachable([entry])):
        for line in comps[c]:
            m = _COLLECTIVE.match(line)
            if m:
                sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                         for _, dims in _ARRAY.findall(m.group(1))]
                shape = re.sub(r"\{[^}]*\}", "", m.group(1))  # drop layouts
                found.append(Collective(m.group(2), shape, max(sizes, default=0), c in loops))
    return found
