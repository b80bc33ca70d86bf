"""How a constrained request ends when its grammar cannot go on (engine/scheduler.py applies them)."""

from __future__ import annotations

from wire.protocol import ErrorInfo

# The worker sampled a token the request's grammar refused: it masks with the grammar, so this is a bug
GRAMMAR_BROKEN = ErrorInfo(
    message="internal error: a sampled token broke the request's grammar",
    code="internal_error",
    http_status=500,
)
# The request's constraint allows no token where its answer must go on (its language is empty, from
# the start or past the tokens generated): no answer satisfies it. The request's fault, not the server's.
CONSTRAINT_UNSATISFIABLE = ErrorInfo(
    message="The request's constraint (response_format, structured_outputs, a tool's parameters) allows "
    "no output here: no answer can satisfy it (a grammar that only refers to itself, say).",
    code="constraint_unsatisfiable",
    http_status=400,
)
