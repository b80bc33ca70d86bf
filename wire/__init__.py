"""What crosses a process boundary, shared by every role: the messages (protocol.py), the shared-memory
ring of processed items (shm_ring.py), the encoder-cache stores (ec_store/), the mm_hash content key
(hashing.py) and the names of the figures the engine reports (metric_names.py). Imports nothing from
app, engine or workers, and no torch (docs/architecture.md, "Packages")."""
