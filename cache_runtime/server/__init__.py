"""The runtime's HTTP server (SGLang's native and OpenAI routes, the HiCache admin API) over one
``engine.loop.Engine``; ``app.run`` serves it with uvicorn."""
