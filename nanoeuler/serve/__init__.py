"""`nanoeuler serve`: an OpenAI-compatible HTTP API and a web chat page in front of a chat model.

server.py     the command: arguments, the listening socket, uvicorn
app.py        the FastAPI routes, streaming, errors as OpenAI error bodies
protocol.py   request bodies checked into typed requests
prompts.py    chat messages -> prompt ids (the Alpaca template, multi-turn), stop strings
scheduler.py  the bounded queue and the worker thread that decodes requests together
engine_proc.py  the scheduler in a process of its own, its jobs' API here (an experiment: the bench's --process)
backend.py    the one adapter to the generation engine
static/       the chat page
"""
