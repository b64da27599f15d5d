"""Fusion rules as data (see :mod:`functe.rules._pattern` and docs/fusion.md).

Rule tables are module constants combined with ``+``; the executor
(:func:`functe.fuse`) takes a rule set as an argument, so nothing is
registered globally. ``DEFAULT_RULES`` is what ``fuse`` uses unless told
otherwise. Order matters within a phase: earlier rules win where matches
overlap (TransformerEngine tries ForwardLinearBiasAdd before
ForwardLinearBiasActivation).

``DEFAULT_RULES = LINEAR_RULES + QUANTIZE_RULES + ACTIVATION_RULES + NORM_RULES``:
in the forward phase the linear+add rules come first (TE's order), then the
q-in rules (a norm or activation feeding an FP8 linear), then
linear+bias+activation; in the backward phase the linear+add/scale rules, the
quantized activation+bias rules (which need the FP8 linear as producer), then
the unquantized activation+bias rules and add+norm. See docs/fusion.md §6.
"""

from ._check import check as check
from ._parallel import any_parallel_reason as any_parallel_reason
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
from .activation import ACTIVATION_RULES as ACTIVATION_RULES
from .activation import BACKWARD_ACTIVATION_RULES as BACKWARD_ACTIVATION_RULES
from .activation import FORWARD_ACTIVATION_RULES as FORWARD_ACTIVATION_RULES
from .core import BACKWARD_LINEAR_RULES as BACKWARD_LINEAR_RULES
from .core import FORWARD_LINEAR_RULES as FORWARD_LINEAR_RULES
from .core import LINEAR_RULES as LINEAR_RULES
from .norm import NORM_RULES as NORM_RULES
from .quantize import BACKWARD_QUANTIZE_RULES as BACKWARD_QUANTIZE_RULES
from .quantize import FORWARD_QUANTIZE_RULES as FORWARD_QUANTIZE_RULES
from .quantize import QUANTIZE_RULES as QUANTIZE_RULES

DEFAULT_RULES = LINEAR_RULES + QUANTIZE_RULES + ACTIVATION_RULES + NORM_RULES
"""The rules ``functe.fuse`` applies by default."""

__all__ = [
    "ACTIVATION_RULES",
    "BACKWARD_ACTIVATION_RULES",
    "BACKWARD_LINEAR_RULES",
    "BACKWARD_QUANTIZE_RULES",
    "DEFAULT_RULES",
    "FORWARD_ACTIVATION_RULES",
    "FORWARD_LINEAR_RULES",
    "FORWARD_QUANTIZE_RULES",
    "LINEAR_RULES",
    "NORM_RULES",
    "PHASES",
    "QUANTIZE_RULES",
    "Match",
    "Pattern",
    "RewriteStats",
    "Rule",
    "RuleSet",
    "any_parallel_reason",
    "backward_parallel_reason",
    "check",
    "first_reason",
    "forward_parallel_reason",
    "rewrite",
]
