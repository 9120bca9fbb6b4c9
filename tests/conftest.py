"""Shared fixtures: real SQLite files under tmp_path, real servers on 127.0.0.1."""
