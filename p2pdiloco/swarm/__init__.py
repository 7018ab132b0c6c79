"""Discovery, matchmaking and the all-reduce: everything that talks to other peers.

One job per module, lower ones first (a module imports only those above it in this list, and
:mod:`p2pdiloco.ids` for short peer ids):

* ``keys``: the DHT keys and stream names of a run, formatted and parsed here only.
* ``group``: the values matchmaking hands to the all-reduce (``Group``, ``Coverage``, tiers).
* ``partition``: who reduces which slice of a vector, and its chunks on the wire.
* ``protocol``: frames, the version check, offences and bans (``PeerGate``), traffic counters.
* ``standing``: whose claims count and what a majority of them decides (partners, lineage).
* ``signing``, ``records``: who wrote a DHT record, and its schema.
* ``lifeline``, ``ledger``: the DHT process's lifetime and its byte ledger (benchmarks).
* ``relay``, ``dialing``, ``punch``, ``reachability``: reaching a peer, behind NAT too (through a relay,
  or directly after a hole punch).
* ``node``: ``SwarmNode``, one peer's DHT and p2p client and its event loop.
* ``formation``: matchmaking's rules, pure functions (who waits, who leads, who owns, who is left out).
* ``leading``, ``joining``: the leader's side of a round; the join protocol, both ends.
* ``matchmaking``: ``Matchmaker``, the steps of forming one (fragment, round)'s group.
* ``allreduce_owner``, ``allreduce_member``: the owner's and the member's side of the all-reduce.
* ``allreduce``: ``AllReducer``, one butterfly all-reduce over a group (the protocol's description).
* ``state_sync``: state transfer to a joining or lagging peer (serve and download).
* ``timeouts``: waits derived from measured speed.
* ``swarm``: ``Swarm``, what the training loop uses of all of the above.
"""
