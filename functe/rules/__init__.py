"""Fusion rules as data (see :mod:`functe.rules._pattern` and docs/fusion.md).

Rule tables are module constants combined with ``+``; the executor
(:func:`functe.fuse`) takes a rule set as an argument, so nothing is
registered globally. ``DEFAULT_RULES`` is what ``fuse`` uses unless told
otherwise. Order matters within a phase: earlier rules win where matches
overlap (TransformerEngine tries ForwardLinearBiasAdd before
ForwardLinearBiasActivation).

Phase 2 (after the activation, norm and FP8 ops land) adds tables here, e.g.
``DEFAULT_RULES = LINEAR_RULES + ACTIVATION_RULES + NORM_RULES + QUANTIZE_RULES``
(forward linear+bias+activation after the linear+add rules; backward
activation+bias; add+rms_norm; norm/activation+quantize under a recipe).
"""

from ._check import check as check
from ._parallel import backward_parallel_reason as backward_parallel_reason
from ._parallel import first_reason as first_reason
from ._parallel import forward_parallel_reason as forward_parallel_reason
from ._pattern import PHASES as PHASES
from ._pattern import Match as Match
from ._pattern import Pattern as Pattern
from ._pattern import RewriteStats as RewriteStats
from ._pattern import Rule as Rule
from ._pattern import RuleSet as RuleSet
from ._pattern import rewrite as rewrite
from .core import BACKWARD_LINEAR_RULES as BACKWARD_LINEAR_RULES
from .core import FORWARD_LINEAR_RULES as FORWARD_LINEAR_RULES
from .core import LINEAR_RULES as LINEAR_RULES

DEFAULT_RULES = LINEAR_RULES
"""The rules ``functe.fuse`` applies by default."""

__all__ = [
    "BACKWARD_LINEAR_RULES",
    "DEFAULT_RULES",
    "FORWARD_LINEAR_RULES",
    "LINEAR_RULES",
    "PHASES",
    "Match",
    "Pattern",
    "RewriteStats",
    "Rule",
    "RuleSet",
    "backward_parallel_reason",
    "check",
    "first_reason",
    "forward_parallel_reason",
    "rewrite",
]
