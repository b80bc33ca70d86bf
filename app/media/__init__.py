"""Media from a request: which URLs may be fetched (url_policy), the fetch itself (fetch), decoding
images (images)."""
