"""What an ftlaunch agent and its ranks agree on, so that neither imports the other.

``launcher`` (the agent) and ``trainer_shim`` (imported into every rank) both depend on
this package and on nothing of each other: the environment variables they exchange
(``environment``), the messages and their schemas (``protocol``: control plane and
node-local), the staging layout in shared memory (``staging``), the checkpoint format on
storage (``shards``, ``storage``), how a rank answers a stack-dump request
(``stack_dump``) and what it does before its interpreter finalizes (``rank_exit``).
Torch-free and ZeroMQ-free: it is loaded into every rank.
"""
