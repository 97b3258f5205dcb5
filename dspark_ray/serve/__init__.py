"""The Ray Serve application: ``import_path: dspark_ray.serve.app:build_app``.

- ``app``: the builder (``build_app``); ``config``: its settings (``AppConfig``,
  the YAML's ``args:``);
- ``server``: ``DSparkServer``, one replica: the runtime (``dspark_ray.runtime``)
  put together, served through the OpenAI routes (``dspark_ray.openai``) and the
  handle API; ``protocol``: the handle API's types (``GenerateRequest`` in,
  ``GenerateChunk`` out);
- ``autoscaling``: Serve's autoscaling policy on what the replicas hold.
"""
