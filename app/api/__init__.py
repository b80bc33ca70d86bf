"""The HTTP API: app factory and lifespan, routes, OpenAI schemas and responses, the error envelope,
request guards, drain, the chat service and its detokenizer."""
