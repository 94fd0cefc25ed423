"""Cache-aware, OpenAI-compatible router (proxy) in front of a fleet of engines."""
