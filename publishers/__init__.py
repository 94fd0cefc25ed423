"""Engine side of the system: the vLLM-wire KV-event publisher, engine simulator and store tier."""
