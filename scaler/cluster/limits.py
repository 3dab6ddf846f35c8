"""The largest node the cluster model takes.

Per-node state is dense (`ClusterState.gpu_free` is nodes x the largest node's GPUs) and a
node's MIG layout is searched for, so one node claiming a billion GPUs, or a hundred
thousand MIG instances, would take the process's memory or minutes of CPU. Real nodes hold
8 or 16 GPUs; the bound leaves room for any built so far and refuses the rest by name.
"""

MAX_NODE_GPUS = 64  # GPUs one node holds, whole and MIG together
