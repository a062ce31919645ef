"""Debug aids of the worker loop, off by default: per-step timestamps (step_trace.py) and
torch.profiler traces of prefill steps (step_profile.py)."""
