"""Operations tools behind the `dspark` command: Grafana dashboards and the NCCL bandwidth check.

- ``dashboards``: the Grafana dashboards of ``dashboards/``, written as data;
  ``dspark dashboards build`` writes the JSON, ``dspark dashboards push``
  uploads it (``grafana_push``).
- ``nccl_check``: ``dspark nccl-check``, nccl-tests' ``all_reduce_perf`` when
  installed, else a torch.distributed all-reduce probe between Ray actors.
"""
