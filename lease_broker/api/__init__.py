"""The broker's HTTP API (REST under /api/v1, an event stream, /metrics)."""
