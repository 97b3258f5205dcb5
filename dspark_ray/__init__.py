"""dspark_ray: speculative-decoding LLM serving on Ray with request-stable slots."""

__version__ = "0.1.0"
