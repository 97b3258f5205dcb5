"""The runtime of one Serve replica: the engine loop, the worker actors and the paths between them.

- ``engine_loop``: the thread that runs the engine's steps for asyncio callers;
- ``actors``: the replica's services on Ray (target shards, draft worker, the
  application's slot manager) behind the engine's service interfaces;
- ``workers``: the worker actors themselves (``TargetShard``, ``DraftWorker``);
- ``channel``, ``context_push``: the per-step paths to and between the workers;
- ``group``: their torch.distributed group; ``cores``: the CPUs they bind to;
- ``deadline``, ``timeline``, ``metrics``, ``errors``: step deadlines, where
  time goes, what is exported, what fails.

The OpenAI front (``dspark_ray.openai``) reaches the runtime only through
``INTERFACE``: the engine loop (submit, stream, abort, drain; its refusals
``Overloaded``, ``Draining``, ``EngineDead``) and the failures a client is told
about (``errors``). The Serve application (``dspark_ray.serve``) puts the two
together. tests/test_layout.py holds the front to this.
"""

INTERFACE = ("dspark_ray.runtime.engine_loop", "dspark_ray.runtime.errors")
