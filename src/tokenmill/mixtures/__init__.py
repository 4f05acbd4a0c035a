"""Mixture specs: schema, planner, diff.

    from tokenmill.mixtures import load_mixture, plan_mixture, load_counts
    plan = plan_mixture(load_mixture("mixtures/demo.yaml"), load_counts("out/demo/tokens/counts.json"))
    plan.to_json()  # docs/formats.md, "Mixture plan" (a tokenmill.formats.plan.MixturePlan)

Names are imported lazily, so that `tokenmill --help` (which imports the `commands` module of this
package) does not pay for pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "MixtureError": "tokenmill.mixtures.errors",
    "Issue": "tokenmill.mixtures.errors",
    "Mixture": "tokenmill.mixtures.spec",
    "MixtureSpec": "tokenmill.mixtures.spec",
    "load_mixture": "tokenmill.mixtures.spec",
    "load_mixture_text": "tokenmill.mixtures.spec",
    "mixture_json_schema": "tokenmill.mixtures.spec",
    "MixturePlan": "tokenmill.formats.plan",
    "PhasePlan": "tokenmill.formats.plan",
    "SourcePlan": "tokenmill.formats.plan",
    "plan_mixture": "tokenmill.mixtures.plan",
    "load_counts": "tokenmill.mixtures.plan",
    "block_counts": "tokenmill.mixtures.plan",
    "diff_plans": "tokenmill.mixtures.diff",
    "parse_selector": "tokenmill.mixtures.selectors",
}
__all__ = [
    "Issue",
    "Mixture",
    "MixtureError",
    "MixturePlan",
    "MixtureSpec",
    "PhasePlan",
    "SourcePlan",
    "block_counts",
    "diff_plans",
    "load_counts",
    "load_mixture",
    "load_mixture_text",
    "mixture_json_schema",
    "parse_selector",
    "plan_mixture",
]

if TYPE_CHECKING:
    from tokenmill.formats.plan import MixturePlan, PhasePlan, SourcePlan
    from tokenmill.mixtures.diff import diff_plans
    from tokenmill.mixtures.errors import Issue, MixtureError
    from tokenmill.mixtures.plan import block_counts, load_counts, plan_mixture
    from tokenmill.mixtures.selectors import parse_selector
    from tokenmill.mixtures.spec import (
        Mixture,
        MixtureSpec,
        load_mixture,
        load_mixture_text,
        mixture_json_schema,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
