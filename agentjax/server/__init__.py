"""The OpenAI-compatible HTTP server: `agentjax serve`.

`app.create_app` builds the FastAPI app on an engine; `async_engine.AsyncEngine` owns the engine in
one background thread; `protocol` holds the request and response schemas; `metrics` the
Prometheus collectors. Importing this package does not import jax.
"""
