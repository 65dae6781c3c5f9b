"""`nanoeuler serve`: an OpenAI-compatible HTTP API and a web chat page in front of a chat model.

server.py       the command: arguments, the engine process, the listening socket, uvicorn
app.py          the FastAPI routes, streaming, errors as OpenAI error bodies
protocol.py     request bodies checked into typed requests
prompts.py      chat messages -> prompt ids (the Alpaca template, multi-turn), stop strings
engine_proc.py  generation in a process of its own: the jobs' API here, the pipe, the engine's main loop there
scheduler.py    (in the engine process) the bounded queue and the worker thread that decodes requests together
backend.py      (in the engine process) the one adapter to the generation engine
structured.py   (in the engine process) JSON schemas as grammars that mask each step's tokens
metrics.py      /metrics
static/         the chat page
"""
