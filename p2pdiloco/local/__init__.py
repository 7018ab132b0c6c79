"""Local workers: one swarm member per machine, K processes training its replica.

``p2pdiloco join --local-workers K`` starts K worker processes on this machine (:mod:`.launch`).
Local rank 0 is the swarm member: the DHT node, the identity, the all-reduce, the checkpoint and the
metrics, exactly as a one-process peer (:mod:`p2pdiloco.train.loop`). Ranks 1..K-1 never touch the
network (:mod:`.worker`). Inside the machine the replica trains data-parallel: every worker takes
its inner step on its own sub-shard of the peer's data, the gradients are averaged (``torch.distributed``,
gloo on CPU, nccl on CUDA) and every worker applies the same AdamW step. After each inner step rank
0 tells the others whether to go on and sends them whatever its DiLoCo changed: the model's
parameters when a sync result reached them, the global copy (θ and momentum) of each fragment whose
outer step landed (:mod:`.group`), so every worker logs the swarm's digest. All of it stays on
loopback (the rendezvous, gloo's and nccl's sockets), and the workers exchange tensors and one
fixed-format message (:mod:`.messages`), never a pickle.

``local.sharding = "fsdp"`` (:mod:`.fsdp`): the workers hold the replica in shards (torch FSDP2)
for a model that does not fit one device; rank 0 keeps the full parameters DiLoCo needs on its CPU.
The launcher also watches each worker's heartbeat (:mod:`.launch`): a stopped or frozen worker takes
the machine's peer down as a dead one does.
"""
