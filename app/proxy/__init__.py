"""``mmserve proxy``: the HTTP front of an encoder / LM split (its own process, no engine)."""
