"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL family: processing (API half), model (worker half), image-only HF
processor and tiny checkpoints."""
