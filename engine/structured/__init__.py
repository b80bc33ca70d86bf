"""Structured outputs in the engine: grammars compiled off the step loop into a bounded cache, and one
matcher per constrained request that masks what it may sample next (docs/architecture.md, "Structured
outputs")."""
