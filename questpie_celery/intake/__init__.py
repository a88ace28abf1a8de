"""How a dispatch enters the ledger, for a publish and a worker alike: the queue policy in
force for its job, its new row, and what is told when a policy slot refuses it."""
