"""``mooncake-register``: the registrar sidecar that registers an engine's KV-event streams
with conductors while the engine runs (docs/registrar.md).

``settings`` (flags and ``REGISTRAR_*`` env vars) and ``streams`` (what an engine serves as
``/register`` bodies) are pure; ``engine`` asks the engine, ``keeper`` talks to one
conductor, ``service`` runs them and serves the registrar's own ``/health``.
"""
