"""The input path of a request, from parsed messages to an ``AddRequest`` on the wire, taken in one call
(``submission.submit``): prompts, mm_hash lookups, the processor cache, the IPC mirror, the shm object
store, the preprocessing pool, the encoder budgets and the engine client."""
