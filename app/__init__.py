"""The API process and the launcher. Subpackages, top to bottom: ``launch`` (CLI, processes, supervision),
``proxy`` (the encoder / LM split's front), ``api`` (HTTP: routes, schemas, errors, streaming),
``inputs`` (the input path: prompts, caches, IPC mirror, preprocessing, engine client), ``media`` (URL
policy, fetch, decode). ``errors``, ``settings`` and ``metrics`` are shared by all of them
(docs/architecture.md, "Packages")."""
