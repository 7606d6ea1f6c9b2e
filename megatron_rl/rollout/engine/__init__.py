"""The engine's side: what runs one vLLM engine, wherever it is placed.

- :mod:`.runner`: the loop that owns one engine (requests, interruptions, versions, loads);
- :mod:`.vllm_engine`: the vLLM engine itself, stepped by its runner;
- :mod:`.interruption`: ScaleRL's forced length interruption, on token ids;
- :mod:`.routing`: the experts each token was routed to (routing replay);
- :mod:`.output`: an engine process's output copied to its log;
- :mod:`.serve`: a generator task's end of the remote connection (``placement: remote``).
"""
