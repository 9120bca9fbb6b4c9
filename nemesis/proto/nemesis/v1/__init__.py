"""``nemesis.v1``: the handler contract; ``handler_pb2`` is generated (``nemesis.proto``)."""
