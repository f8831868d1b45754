"""The engine: requests, KV blocks, scheduling, the model thread's steps, outputs.

Everything here runs on the caller's thread (the event loop, or the offline `LLM`'s
thread) and imports no HTTP: the server in `app/server/` and the offline `LLM` are two
front ends over the same `EngineCore`.
"""
