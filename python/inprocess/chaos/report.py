"""The checker's findings as a user reads them: a table, the violations, and a JSON line."""

from __future__ import annotations

import json
from typing import Any

from .invariants import Finding


def table(findings: list[Finding]) -> str:
    width = max(len(f.invariant) for f in findings)
    lines = [f"{'invariant':<{width}}  {'checked':>8}  violations"]
    lines += [f"{f.invariant:<{width}}  {f.checked:>8}  {len(f.violations)}" for f in findings]
    for f in findings:
        lines += [f"  {v}" for v in f.violations[:20]]
        if len(f.violations) > 20:
            lines.append(f"  ... and {len(f.violations) - 20} more of {f.invariant}")
    return "\n".join(lines)


def as_json(findings: list[Finding], **extra: Any) -> str:
    return json.dumps({**extra, "invariants": {f.invariant: {"checked": f.checked, "violations": len(f.violations)}
                                               for f in findings},
                       "violations": [str(v) for f in findings for v in f.violations]})
