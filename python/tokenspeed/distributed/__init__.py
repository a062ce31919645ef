"""torch.distributed for the worker ranks: sizes, process groups, the collectives layers call,
and the lockstep of data-parallel attention (groups.py)."""
