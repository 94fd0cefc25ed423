"""The project's benchmarks, each a module run from the repository root with ``python -m
bench.<name>`` (``bench/README.md`` says how to run each; its results, dated, are in
``bench/results/``): ``conductor_bench``, ``index_bench``, ``load_bench``, ``trace_report``
(the trace simulator ``trace_sim``'s command line), ``router_replay``, ``router_compare``,
``router_overhead``, ``soak``, ``fleet_latency``, ``store_bench`` and
``kv_store_check_bench``; ``harness`` holds what they share (statistics, the machine, a
conductor under test and its numbers, the workload shape)."""
