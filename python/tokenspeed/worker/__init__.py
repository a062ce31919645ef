"""A worker rank: its process and step loop (loop.py), the model runner that turns a plan into a
forward pass (model_runner.py), sampling, CUDA graphs, and the plan codec shared with the Rust
engine (plan.py)."""
