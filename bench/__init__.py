"""The project's benchmarks, each a module run from the repository root with ``python -m
bench.<name>`` (``bench/README.md`` lists them with their results): ``conductor_bench``,
``trace_report`` (the trace simulator ``trace_sim``'s command line), ``router_replay``,
``soak``, ``fleet_latency``, ``store_bench`` and ``kv_store_check_bench``; ``stats`` holds
the statistics they share."""
