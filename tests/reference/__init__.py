"""Test-only: transformers' own (torchvision-based) video processing as the reference for the product's,
run in a subprocess over a separate environment (setup_env.py installs it, hf_video.py runs there,
client.py is what tests call)."""
