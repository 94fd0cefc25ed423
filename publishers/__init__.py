"""The engine side of the system, what feeds the conductor and serves the router.

``publisher`` (vLLM's ZMQ KV-event publisher, with ``encoding``'s byte-exact payloads),
``engine`` (a GPU-less vLLM look-alike: scheduler, block manager, timing model, OpenAI API),
``store`` (vLLM's Mooncake-store key layout, a batch client and local store processes, which
the simulator's ``engine.store_tier`` connector uses to save and load KV blocks; the store
itself publishes no events), ``local`` (services as loopback subprocesses) and ``demo``.
"""
