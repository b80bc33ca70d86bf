"""The model worker: loads the checkpoint, runs the vision encoder and the language model over the paged
KV pool, samples; and the model families (``families/``), whose API half the API process loads. Imports
``wire`` only, never ``engine`` or ``app`` (docs/architecture.md, "Packages")."""
