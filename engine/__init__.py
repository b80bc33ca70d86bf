"""The engine process: scheduler, caches' bookkeeping (receiver cache, KV blocks, encoder cache), the
worker client and the loop around them. Plain Python, no torch; imports only ``wire`` (docs/architecture.md,
"Packages")."""
