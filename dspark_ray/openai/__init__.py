"""The OpenAI-compatible HTTP front of a replica: the request schema, the routes and their rendering.

- ``protocol``: the request and response types (OpenAI's schema, vLLM's extensions);
- ``routes``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and the
  operator routes, over a replica's engine loop; ``errors``: the OpenAI error bodies;
- ``choices``: one request fanned out into engine requests and merged back;
  ``responses``: the choices rendered as bodies and stream chunks;
- ``tool_parsers``, ``reasoning``: tool calls and reasoning taken out of the text;
- ``http``: the replica's own HTTP server; ``balance``: connections evened out
  between the replicas that share its port; ``metrics``: what the HTTP server exports.

It knows the runtime only through ``dspark_ray.runtime.INTERFACE``.
"""
