"""The DLQ web UI: a FastAPI application over nemesis.dlq (never imported by nemesis)."""
