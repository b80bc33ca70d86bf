"""The API process and the launcher. Subpackages, top to bottom: ``launch`` (CLI, processes, supervision),
``proxy`` (the encoder / LM split's front), ``api`` (HTTP: routes, schemas, errors, streaming),
``inputs`` (the input path: prompts, caches, IPC mirror, preprocessing, engine client), ``media`` (URL
policy, fetch, decode). ``errors``, ``settings``, ``metrics`` and ``child_processes`` (the fork server
its children are forked from) are shared by all of them
(docs/architecture.md, "Packages")."""
