"""Model building blocks shared by every model family: linear, embedding, norm, rotary, attention
(its backends and the paged KV cache they write), MoE (the experts and their exchange across
ranks) and quantization; and the host-to-device copies a step's inputs take (host_copy.py).
Layers never import models or the worker."""
