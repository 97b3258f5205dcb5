"""The Ray Serve application: actors, engine loop, OpenAI routes and the handle API."""
