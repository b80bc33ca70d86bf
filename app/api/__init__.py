"""The HTTP API: app factory and lifespan, routes, OpenAI schemas and responses, the error envelope,
request guards, drain, the chat service (sampling parameters, its detokenizer, the request fields it
sorts) and the tokenize service."""
