"""The LLaVA-1.5 family: processing (API half), model (worker half), tiny checkpoint."""
