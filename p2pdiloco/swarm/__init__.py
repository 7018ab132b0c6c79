"""Discovery, matchmaking and the all-reduce: everything that talks to other peers."""
