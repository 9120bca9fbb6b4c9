"""Password and token hashing: the configuration's (``nemesis.config.passwords``)."""

from nemesis.config.passwords import hash_password, hash_token, new_token, verify_password

__all__ = ["hash_password", "hash_token", "new_token", "verify_password"]
