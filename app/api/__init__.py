"""The HTTP API: app factory and lifespan, routes, OpenAI schemas and responses, the error envelope,
request guards, drain, the output path every endpoint formats from (outputs.py, its detokenizer, tool
calls), the chat service (sampling parameters, the request fields it sorts), the Responses service and the
tokenize service."""
