"""`hetero serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    hetero serve [--model DIR] [--adapters name=DIR ...] [--host 127.0.0.1] [--port 8000]

hetero.server.app is the API, hetero.server.state what a server process holds, hetero.server.main
the command. Needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
