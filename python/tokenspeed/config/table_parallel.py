"""Flag table, part 2: parallelism (split TP, DP, PP, EP), multi-node, PD disaggregation.

TokenSpeed splits tensor parallelism by layer family: attention (`--attn-tp-size`, which the
familiar `--tensor-parallel-size` / `--tp` / `--tp-size` map to), dense MLP (`--dense-tp-size`)
and MoE (`--moe-tp-size`). The combinations are checked in `tokenspeed.distributed.groups.ParallelSizes`
(which names both values of an impossible pair); the MoE layers take their expert-parallel /
MoE-TP slice from those groups (layers/moe.py) and sum their partial outputs over the world
(`--all2all-backend naive`, distributed.MoeAllReduce). Data parallelism (`--dp-size`) runs one
engine and worker group per replica behind the Rust server's router (rust/server/src/router.rs).
Attention TP smaller than the world (`--world-size 8 --attn-tp-size 4`, or SGLang's
`--tp 8 --dp 2 --enable-dp-attention`) is data-parallel attention: one world of ranks, one engine
per attention group behind that router, the MoE layers gathering every group's tokens
(`--all2all-backend allgather_reducescatter`, distributed.MoeAllGather) in lockstep (worker.py).
`--all2all-backend torch_all2all` (layers.moe_all2all.MoeAllToAll) sends each token only to the ranks
holding its experts instead, in either layout.
"""

from __future__ import annotations

from tokenspeed.config.flag import (
    G_EP,
    G_MULTINODE,
    G_PARALLEL,
    G_PD,
    Flag,
    b,
    c,
    f,
    i,
    s,
)

# Why each external all-to-all library is refused, and what to use instead: the one place the
# messages of --all2all-backend, --moe-a2a-backend and --enable-deepep-moe come from.
_BUILT_IN = ("use --all2all-backend allgather_reducescatter (all-gather the tokens, reduce-scatter "
             "the outputs) or torch_all2all (send each token only to the ranks holding its "
             "experts; better for many expert-parallel ranks and large batches)")
DEEPEP_REFUSAL = (
    "DeepEP needs DeepSeek's deep_ep package, CUDA kernels built against NVSHMEM for "
    "NVLink-connected Hopper-class GPUs within a node and RDMA NICs (InfiniBand or RoCE) "
    "between nodes; TokenSpeed neither ships nor calls it. "
    f"Instead, {_BUILT_IN}")
A2A_REFUSALS: dict[str, str] = {
    "deepep": DEEPEP_REFUSAL,
    "deepep_high_throughput": DEEPEP_REFUSAL,
    "deepep_low_latency": DEEPEP_REFUSAL,
    "pplx": ("pplx needs Perplexity's pplx-kernels package, CUDA kernels built against NVSHMEM "
             f"for NVLink/RDMA-connected GPUs; TokenSpeed neither ships nor calls it. Instead, "
             f"{_BUILT_IN}"),
    "flashinfer_all2allv": ("FlashInfer's all2allv kernels (multi-node NVLink systems) are not "
                            "built into TokenSpeed, which does not call them. "
                            f"Instead, {_BUILT_IN}"),
    "mooncake": ("Mooncake's expert-parallel backend needs the mooncake package and RDMA NICs; "
                 f"TokenSpeed neither ships nor calls it. Instead, {_BUILT_IN}"),
    "ascend_fuseep": f"it runs on Huawei Ascend NPUs only. On GPUs, {_BUILT_IN}",
}


def _refusals(choices: tuple[str, ...]) -> dict[str, str]:
    return {v: A2A_REFUSALS[v] for v in choices if v in A2A_REFUSALS}


_ALL2ALL_CHOICES = ("naive", "allgather_reducescatter", "torch_all2all", "pplx",
                    "deepep_high_throughput", "deepep_low_latency", "flashinfer_all2allv")
_MOE_A2A_CHOICES = ("none", "deepep", "mooncake", "ascend_fuseep")

# The table is laid out by hand, one flag per few lines.
# fmt: off
PARALLEL_FLAGS: list[Flag] = [
    i("--tp-size", "Attention tensor-parallel size: GPUs that split each attention layer (and, "
      "unless set apart, the dense and MoE layers). --tensor-parallel-size, --tp and "
      "--attn-tp-size are the same setting; give only one.", G_PARALLEL, 1,
      aliases=("--tensor-parallel-size", "--tp", "--attn-tp-size"), minimum=1,
      readers=("launch",), implemented=True, metavar="N"),
    i("--dense-tp-size", "Tensor-parallel size of dense MLP layers, when it differs from "
      "attention TP (a divisor of it: each dense shard is then replicated).", G_PARALLEL,
      minimum=1, readers=("launch",), implemented=True, metavar="N"),
    i("--moe-tp-size", "Tensor-parallel size of MoE expert layers, when it differs from "
      "attention TP (times the expert-parallel size it must equal the world size).",
      G_PARALLEL, minimum=1, readers=("launch",), implemented=True, metavar="N"),
    i("--world-size", "Total number of worker processes across all nodes (default: the "
      "attention TP size; given alone, it is also the TP size). Larger than --attn-tp-size: "
      "data-parallel attention, world / attn-tp attention groups, each with its own scheduler, "
      "prefix cache and KV pool, sharing the MoE experts (dense layers stay inside a group; "
      "one node; CUDA graphs off; for attention TP 1 use --enable-dp-attention, since --tp 1 "
      "is the default).", G_PARALLEL, minimum=1,
      readers=("launch",), implemented=True, metavar="N"),
    i("--nprocs-per-node", "Worker processes started on each node (default: world size / "
      "nodes).", G_PARALLEL, minimum=1, readers=("launch",), implemented=True, metavar="N"),
    i("--dp-size", "Data-parallel size: number of independent model replicas behind one "
      "endpoint, each with its own scheduler, prefix cache, KV pool and worker group of "
      "--tp-size ranks (on GPU replica r uses GPUs r*tp .. r*tp+tp-1; on CPU they share it). "
      "With --enable-dp-attention it is the number of attention groups in one world instead.",
      G_PARALLEL, 1, aliases=("--data-parallel-size", "--dp"), minimum=1, readers=("server", "worker"),
      implemented=True, metavar="N"),
    c("--load-balance-method", "How requests are spread over data-parallel replicas: "
      "round_robin (in turn; SGLang's default), shortest_queue (fewest running and queued "
      "requests), cache_aware (the replica whose radix cache holds the longest exact prefix of "
      "the prompt, when that is at least half of it, else the least loaded). minimum_tokens "
      "(DP attention) is not built yet.", G_PARALLEL,
      ("round_robin", "shortest_queue", "minimum_tokens", "cache_aware"), "round_robin",
      supported=("round_robin", "shortest_queue", "cache_aware"), implemented=True),
    f("--load-watch-interval", "Seconds between load checks of data-parallel replicas.",
      G_PARALLEL, 0.1, minimum=0.0, min_exclusive=True),
    b("--prefill-round-robin-balance", "Balance prefill servers round-robin so decode servers "
      "can infer the data-parallel rank.", G_PARALLEL),
    b("--enable-dp-attention", "Run attention data-parallel (SGLang's spelling): with --tp T "
      "--dp D, one world of T ranks in D attention groups of T/D ranks, each group with its own "
      "scheduler, prefix cache and KV pool; MoE layers span the world (--ep-size/--moe-tp-size), "
      "dense MLP layers stay tensor-parallel inside a group (unlike SGLang, not over the "
      "world). One node; runs without CUDA graphs.", G_PARALLEL, readers=("launch",),
      implemented=True),
    b("--enable-dp-lm-head", "Keep the output head data-parallel under DP attention, avoiding "
      "an all-gather.", G_PARALLEL, readers=("worker",)),
    i("--pp-size", "Pipeline-parallel size: number of stages the layers are split into.",
      G_PARALLEL, 1, aliases=("--pipeline-parallel-size",), minimum=1, readers=("server", "worker"),
      metavar="N"),
    i("--pp-max-micro-batch-size", "Largest micro-batch in pipeline parallelism.", G_PARALLEL,
      minimum=1, readers=("server", "worker")),
]

MULTINODE_FLAGS: list[Flag] = [
    s("--dist-init-addr", "Address (host:port) of rank 0, where all nodes meet to form the process group "
      "(default: a free port on 127.0.0.1).",
      G_MULTINODE, aliases=("--nccl-init-addr",), readers=("launch",), implemented=True,
      metavar="HOST:PORT"),
    i("--nnodes", "Number of nodes the deployment spans. Node 0 serves HTTP and schedules; "
      "each other node relays its plans (needs --dist-init-addr).", G_MULTINODE, 1, minimum=1,
      readers=("launch",), implemented=True),
    i("--node-rank", "Index of this node, from 0. Only this differs between nodes.",
      G_MULTINODE, 0, minimum=0, readers=("launch",), implemented=True),
]

EP_FLAGS: list[Flag] = [
    i("--ep-size", "Expert-parallel size: ranks the MoE experts are spread over (each holds a "
      "contiguous 1/N of them whole; N must divide the model's expert count and the world "
      "size; the MoE-TP size defaults to world / N).", G_EP, 1,
      aliases=("--expert-parallel-size", "--ep"), minimum=1, readers=("launch",),
      implemented=True, metavar="N"),
    b("--enable-expert-parallel", "Spread MoE experts over all ranks of the deployment: the "
      "expert-parallel size becomes the world size (vLLM's meaning; with --ep-size it must "
      "agree).", G_EP, readers=("launch",), implemented=True),
    c("--moe-backend", "Kernels of the mixture-of-experts layers: triton (fused routing, grouped "
      "GEMMs and combine; runs in decode CUDA graphs) or torch_native (a loop over the experts: "
      "the reference, and no CUDA graphs for MoE models). Default: triton on CUDA, torch_native "
      "on CPU.", G_EP, ("triton", "torch_native"), readers=("worker",), implemented=True),
    c("--all2all-backend", "How MoE layers exchange tokens with the ranks holding their "
      "experts (vLLM's names). naive: every rank already holds every token (attention TP "
      "replicates them), computes a partial output over its experts and the partials are "
      "all-reduced over the world. allgather_reducescatter: the tokens of every attention "
      "group are all-gathered first and the partials reduce-scattered back, each group getting "
      "its own rows; data-parallel attention uses it unless torch_all2all is asked for (with "
      "one attention group it is naive). torch_all2all: each rank sends its share of the "
      "tokens, routed by the model's router, only to the ranks holding one of its top-k experts "
      "(torch.distributed all_to_all_single, split sizes exchanged first), the outputs come "
      "back the same way; with or without data-parallel attention. It moves top-k ranks' worth "
      "of rows per token instead of the world's, but reads the split sizes on the host every "
      "layer, so it runs without CUDA graphs: for many expert-parallel ranks and large "
      "batches, not small-batch decode. The others (pplx, DeepEP, FlashInfer all2allv) are "
      "external libraries TokenSpeed does not call: refused, saying why.", G_EP,
      _ALL2ALL_CHOICES, "naive", supported=("naive", "allgather_reducescatter", "torch_all2all"),
      refusals=_refusals(_ALL2ALL_CHOICES), readers=("worker",), implemented=True),
    c("--moe-a2a-backend", "All-to-all backend for expert parallelism, SGLang's flag. "
      "TokenSpeed's own exchanges are chosen with --all2all-backend.", G_EP, _MOE_A2A_CHOICES,
      "none", refusals=_refusals(_MOE_A2A_CHOICES), readers=("worker",)),
    s("--moe-runner-backend", "Kernel runner for MoE layers.", G_EP, "auto", readers=("worker",)),
    c("--flashinfer-mxfp4-moe-precision", "Compute precision of FlashInfer MXFP4 MoE kernels.",
      G_EP, ("default", "bf16"), "default", readers=("worker",)),
    b("--enable-flashinfer-allreduce-fusion", "Fuse all-reduce with residual RMSNorm.", G_EP,
      readers=("worker",)),
    c("--deepep-mode", "DeepEP dispatch mode: normal, low_latency, or auto (choose per batch).",
      G_EP, ("normal", "low_latency", "auto"), "auto", readers=("worker",)),
    i("--ep-num-redundant-experts", "Extra expert replicas placed for load balancing.", G_EP, 0,
      minimum=0, readers=("worker",)),
    s("--ep-dispatch-algorithm", "How a rank is picked among an expert's replicas.", G_EP,
      readers=("worker",)),
    s("--init-expert-location", "Initial placement of experts on ranks.", G_EP, "trivial",
      readers=("worker",)),
    b("--enable-eplb", "Turn on expert-parallel load balancing (moving experts at run time).",
      G_EP, readers=("worker",)),
    s("--eplb-algorithm", "Algorithm used by the expert load balancer.", G_EP, "auto",
      readers=("worker",)),
    i("--eplb-rebalance-num-iterations", "Forward steps between expert rebalances.", G_EP, 1000,
      minimum=1, readers=("worker",)),
    i("--eplb-rebalance-layers-per-chunk", "Layers moved per rebalancing step.", G_EP, minimum=1,
      readers=("worker",)),
    f("--eplb-min-rebalancing-utilization-threshold", "Rebalance only when GPU utilization is "
      "below this fraction.", G_EP, 1.0, minimum=0.0, maximum=1.0, readers=("worker",)),
    s("--expert-distribution-recorder-mode", "What the expert-usage recorder collects.", G_EP,
      readers=("worker",)),
    i("--expert-distribution-recorder-buffer-size", "Steps of history the expert-usage recorder "
      "keeps.", G_EP, minimum=1, readers=("worker",)),
    b("--enable-expert-distribution-metrics", "Export expert-usage balance metrics.", G_EP,
      readers=("worker",)),
    s("--deepep-config", "DeepEP tuning file or JSON string.", G_EP, readers=("worker",)),
    i("--moe-dense-tp-size", "Tensor-parallel size of dense MLP layers in MoE models.", G_EP,
      minimum=1, readers=("server", "worker")),
    s("--elastic-ep-backend", "Collective backend for elastic expert parallelism.", G_EP,
      readers=("worker",)),
    s("--mooncake-ib-device", "InfiniBand device(s) for Mooncake elastic EP.", G_EP,
      readers=("worker",)),
]

PD_FLAGS: list[Flag] = [
    c("--disaggregation-mode", "Role in prefill/decode disaggregation: prefill (computes prompts "
      "and sends their KV), decode (receives it and generates), or null (a normal combined "
      "server). A pair is one prefill and one decode server of the same model, page size and "
      "--tp, behind `tokenspeed router --pd` or SGLang's router in PD mode "
      "(docs/parallelism.md).", G_PD,
      ("null", "prefill", "decode"), "null", readers=("server", "worker"), implemented=True),
    c("--disaggregation-transfer-backend", "Transport that moves KV cache from prefill to decode "
      "servers: nccl (GPU to GPU, torch.distributed send/recv) or gloo (through host memory, "
      "--device cpu).", G_PD, ("nccl", "gloo", "mooncake", "nixl", "ascend", "fake"), "nccl",
      supported=("nccl", "gloo"),
      refusals={name: "only the torch.distributed backends are built; use nccl (GPU) or gloo "
                "(CPU)" for name in ("mooncake", "nixl", "ascend", "fake")},
      readers=("worker",), implemented=True),
    i("--disaggregation-bootstrap-port", "Port of the prefill server's bootstrap service (a "
      "torch.distributed store its first rank hosts; the decode server connects to it). A "
      "request whose `bootstrap_port` names another is refused.", G_PD,
      8998, minimum=1, maximum=65535, readers=("server", "worker"), implemented=True),
    s("--disaggregation-bootstrap-host", "Host of the prefill server's bootstrap service (set on "
      "decode servers; a request whose `bootstrap_host` names another is refused).", G_PD,
      "127.0.0.1", readers=("server", "worker"), implemented=True),
    i("--disaggregation-decode-tp", "Tensor-parallel size of the decode servers (set on prefill "
      "servers).", G_PD, minimum=1),
    i("--disaggregation-decode-dp", "Data-parallel size of the decode servers (set on prefill "
      "servers).", G_PD, minimum=1),
    i("--disaggregation-prefill-pp", "Pipeline-parallel size of the prefill servers (set on "
      "decode servers).", G_PD, 1, minimum=1),
    s("--disaggregation-ib-device", "InfiniBand device(s) for KV transfer, comma-separated.",
      G_PD),
    b("--disaggregation-decode-enable-offload-kvcache", "Offload KV cache to host memory on "
      "decode servers.", G_PD),
    i("--num-reserved-decode-tokens", "KV tokens reserved per running request when admitting new "
      "ones on decode servers.", G_PD, 512, minimum=0),
    i("--disaggregation-decode-polling-interval", "Poll for incoming requests every this many "
      "decode steps.", G_PD, 1, minimum=1),
    b("--enable-pdmux", "Multiplex prefill and decode on one GPU with green contexts.", G_PD,
      readers=("server", "worker")),
    s("--pdmux-config-path", "Configuration file for prefill/decode multiplexing.", G_PD,
      metavar="PATH"),
    i("--sm-group-num", "Number of SM partitions for prefill/decode multiplexing.", G_PD, 8,
      minimum=1, readers=("worker",)),
]

PARALLEL_TABLE: list[Flag] = [*PARALLEL_FLAGS, *MULTINODE_FLAGS, *EP_FLAGS, *PD_FLAGS]
# fmt: on
